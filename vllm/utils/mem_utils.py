# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Measure the peak memory torch allocates while a block of code runs, and
the memory this process may still allocate."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "CUDA_ALLOCATION_ROUNDING",
    "PeakMemory",
    "available_memory_bytes",
    "measure_peak_memory",
]

#: The CUDA caching allocator rounds every block up to a multiple of 512
#: bytes (``kMinBlockSize``); ``torch.accelerator.memory_allocated`` counts the
#: rounded sizes. ``measure_peak_memory(..., round_to=...)`` simulates it.
CUDA_ALLOCATION_ROUNDING = 512


@dataclass
class PeakMemory:
    """Result of :func:`measure_peak_memory`, filled in when the block exits.

    Attributes:
        device: the device that was measured.
        peak_bytes: the largest amount of memory allocated on ``device`` above
            what was allocated when the block started (never negative).
        net_bytes: allocated at the end minus allocated at the start (negative
            when the block freed memory it did not allocate).
        timeline: on CPU, (time_ns, bytes allocated above the start) after
            every allocation and free, in order; empty on CUDA.
    """

    device: torch.device
    peak_bytes: int = 0
    net_bytes: int = 0
    timeline: list[tuple[int, int]] = field(default_factory=list)

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / (1 << 20)


def _cpu_allocation_events(
    prof: torch.profiler.profile,
) -> list[tuple[int, int, int]]:
    """(time_ns, signed bytes, pointer) of every CPU allocator event, in time
    order, from ``experimental_event_tree`` (a private torch API, whose
    behaviour a test pins)."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        stack.extend(node.children)
    # A stable sort on time keeps the recorded order of same-timestamp events.
    events.sort(key=lambda e: e[0])
    return events


def _own_allocation_levels(
    events: list[tuple[int, int, int]], round_to: int = 1
) -> list[tuple[int, int]]:
    """(time_ns, bytes live) after each event, each allocation rounded up to
    ``round_to``. Frees of blocks not allocated here are ignored: torch's CPU
    size table can keep a stale entry, so such a free may carry another
    block's size."""
    live: dict[int, int] = {}
    level, out = 0, []
    for t_ns, delta, ptr in events:
        if delta > 0:
            delta = -(-delta // round_to) * round_to
            live[ptr] = live.get(ptr, 0) + delta
            level += delta
        elif delta < 0 and ptr in live:
            level -= live.pop(ptr)
        else:
            continue
        out.append((t_ns, level))
    return out


@contextlib.contextmanager
def _stderr_fd_silenced() -> Iterator[None]:
    # Kineto logs a "profiler_start/stop" line to fd 2 on every use unless
    # KINETO_LOG_LEVEL was set before torch loaded; keep benchmark output clean.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


@contextlib.contextmanager
def measure_peak_memory(
    device: torch.device | str, *, round_to: int = 1
) -> Iterator[PeakMemory]:
    """Measure the peak bytes allocated above the starting point in a block.

    Usage::

        with measure_peak_memory("cpu") as mem:
            reorder_w1w3_to_w3w1(w, s)
        print(mem.peak_bytes)

    CUDA: the caching allocator's statistics (``memory_allocated`` and
    ``max_memory_allocated``), the device synchronized at both ends; this
    resets the device's global peak counter.

    CPU: torch's allocator events as the profiler reports them
    (``profile_memory=True``), matched by pointer: the peak of the block's own
    live allocations. Frees of tensors allocated before the block are not
    reported, so the CPU figure is an upper bound of the CUDA one (equal when
    the block frees nothing older than itself). ``round_to`` (CPU only)
    rounds every allocation up; ``CUDA_ALLOCATION_ROUNDING`` gives the figure
    the CUDA allocator would report. Not process RSS. The profiler slows the
    block: do not time code while measuring it.

    Raises:
        ValueError: ``round_to`` not a positive int; a device neither CPU nor
            CUDA.
    """
    if isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1:
        raise ValueError(f"round_to must be a positive int, got {round_to!r}")
    device = torch.device(device)
    result = PeakMemory(device=device)
    if device.type == "cuda":
        acc = torch.accelerator
        acc.synchronize(device)
        acc.reset_peak_memory_stats(device)
        start = acc.memory_allocated(device)
        yield result
        acc.synchronize(device)
        result.peak_bytes = max(0, acc.max_memory_allocated(device) - start)
        result.net_bytes = acc.memory_allocated(device) - start
        return
    if device.type != "cpu":
        raise ValueError(
            f"measure_peak_memory supports cpu and cuda devices, got {device}"
        )
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    )
    with _stderr_fd_silenced():
        prof.start()
    try:
        yield result
    finally:
        with _stderr_fd_silenced():
            prof.stop()
    result.timeline = _own_allocation_levels(_cpu_allocation_events(prof), round_to)
    result.peak_bytes = max((lvl for _, lvl in result.timeline), default=0)
    result.net_bytes = result.timeline[-1][1] if result.timeline else 0


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def available_memory_bytes() -> int | None:
    """Bytes this process can still allocate, as far as the system says: the
    least of the machine's available memory (``MemAvailable``), the room left
    under the address-space and data limits (``ulimit -v``/``-d``) and under
    the cgroup's memory limit (v2 or v1). None when none is known."""
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) << 10)
    except OSError:
        pass
    for limit, used in (
        (resource.RLIMIT_AS, "VmSize"),
        (resource.RLIMIT_DATA, "VmData"),
    ):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and (now := _status_kib(used)) is not None:
            candidates.append(max(0, soft - now))
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:
            candidates.append(max(0, limit - usage))
    return min(candidates) if candidates else None
