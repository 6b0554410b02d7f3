# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunked, resumable, interrupt-safe execution of the bounded NVFP4 MoE steps."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vllm import envs

__all__ = [
    "env_int",
    "ALLOCATION_GRANULE",
    "DEFAULT_MAX_TRANSIENT_BYTES",
    "ChunkProgress",
    "allocation_bytes",
    "check_cap",
    "check_contiguous",
    "largest_block_within",
    "moe_prep_threads",
    "run_chunks",
    "tile_bytes",
    "unit_chunks",
]

#: Default cap on the memory one preparation call may allocate (64 MiB).
DEFAULT_MAX_TRANSIENT_BYTES = 64 << 20

# The reused bounce buffer, per device type: 2 MiB less 64 KiB on CPU (room
# for a layer's [E] bookkeeping within 2 MiB), 16 MiB on CUDA. The sweep
# behind them: docs/design/nvfp4_moe_weight_preparation.md.
_TILE_BYTES = {"cpu": (2 << 20) - (64 << 10), "cuda": 16 << 20}
_DEFAULT_TILE_BYTES = 2 << 20


#: The CUDA caching allocator's block rounding. The bounded steps plan their
#: caps in rounded sizes on every device, so a cap that holds on a CPU holds
#: as ``torch.cuda.memory_allocated`` counts too.
ALLOCATION_GRANULE = 512


def allocation_bytes(nbytes: int) -> int:
    """What a block of ``nbytes`` counts as on CUDA: rounded up to 512."""
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE


def largest_block_within(cap: int) -> int:
    """The largest block size whose rounded size fits ``cap`` bytes; ``cap``
    itself below 512 bytes (no block that small exists on CUDA)."""
    if cap < ALLOCATION_GRANULE:
        return max(1, cap)
    return cap // ALLOCATION_GRANULE * ALLOCATION_GRANULE


def tile_bytes(device: torch.device) -> int:
    return _TILE_BYTES.get(device.type, _DEFAULT_TILE_BYTES)


def check_contiguous(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (the swap is done in place on its "
            f"storage), got shape {tuple(t.shape)} with stride {t.stride()}"
        )
    return t


def check_cap(max_transient_bytes: object) -> int:
    if isinstance(max_transient_bytes, bool) or not isinstance(
        max_transient_bytes, int
    ):
        raise TypeError(
            "max_transient_bytes must be an int, got "
            f"{type(max_transient_bytes).__name__}"
        )
    if max_transient_bytes <= 0:
        raise ValueError(
            f"max_transient_bytes must be positive, got {max_transient_bytes}"
        )
    return max_transient_bytes


def unit_chunks(units: int, unit_len: int, per: int) -> list[tuple[int, ...]]:
    """Chunks ``(first unit, n units, start, length)`` covering ``units``
    units of ``unit_len`` items with at most ``per`` items each: several
    whole units per chunk when one fits (``start == 0``, ``length ==
    unit_len``), else pieces of one unit. Never more than about twice
    ``units * unit_len / per`` chunks, whatever the unit size."""
    if unit_len <= per:
        k = per // unit_len
        return [(u, min(k, units - u), 0, unit_len) for u in range(0, units, k)]
    return [
        (u, 1, s, min(per, unit_len - s))
        for u in range(units)
        for s in range(0, unit_len, per)
    ]


# --- interruption safety ------------------------------------------------------
#
# A chunk reads its source into the buffer before its last operation writes
# the destination (the swap undoes its first write if the second fails), and
# SIGINT is held back until the chunk and its bookkeeping are complete: when
# control leaves a step, every chunk is done and counted in its
# ``ChunkProgress`` or untouched, and no byte exists only in the buffer.


@dataclass
class ChunkProgress:
    """How far a chunked in-place step got: a resumption point.

    Pass the same object to a retry of the same call (same tensors, shapes and
    cap) after an exception: chunks already done are skipped, so the result is
    byte-identical to an uninterrupted call. ``total`` is set by the first
    call; a later call with a different chunk count raises ValueError.
    """

    done: int = 0
    total: int | None = None

    @property
    def complete(self) -> bool:
        return self.total is not None and self.done >= self.total


class _InterruptLatch:
    """Holds SIGINT back while installed; ``release`` raises it afterwards."""

    def __init__(self) -> None:
        self.pending = False

    def handler(self, signum, frame) -> None:
        self.pending = True

    def release(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def _deferred_interrupts() -> Iterator[_InterruptLatch]:
    latch = _InterruptLatch()
    if threading.current_thread() is not threading.main_thread():
        yield latch  # SIGINT is only ever delivered to the main thread
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous in (signal.SIG_IGN,):
        yield latch
        return
    signal.signal(signal.SIGINT, latch.handler)
    try:
        yield latch
    finally:
        signal.signal(signal.SIGINT, previous)
        # Even when another exception is leaving the step, a Ctrl-C held back
        # is not lost: it is raised (with that exception as its context).
        latch.release()


@contextlib.contextmanager
def moe_prep_threads(device: torch.device | str) -> Iterator[None]:
    """Run the enclosed weight preparation with ``VLLM_MOE_PREP_CPU_THREADS``
    intra-op threads when ``device`` is a CPU (1 by default: many short
    operations on cache-sized chunks; 0 leaves torch's setting); elsewhere, or
    when already set, a no-op. Process-wide while it lasts; the previous
    setting is restored on exit.
    """
    n = env_int("VLLM_MOE_PREP_CPU_THREADS", default=1)
    if torch.device(device).type != "cpu" or n == 0:
        yield
        return
    previous = torch.get_num_threads()
    if previous == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """``vllm.envs.<name>`` as an int of at least ``minimum``, or ``default``
    where the envs module does not define ``name``; ValueError naming the
    variable and its text otherwise."""
    try:
        value = getattr(envs, name)
    except AttributeError:
        return default
    except ValueError:
        value = None
    if value is None or int(value) < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}, got {os.getenv(name)!r}"
        )
    return int(value)


def run_chunks(
    n: int,
    do_chunk: Callable[[int], None],
    progress: ChunkProgress | None,
    device: torch.device | None = None,
) -> None:
    """Run ``do_chunk(0..n-1)`` in order, resuming after ``progress.done``,
    under :func:`moe_prep_threads` for ``device``."""
    start = 0
    if progress is not None:
        if progress.total is None:
            progress.total = n
        elif progress.total != n:
            raise ValueError(
                f"progress belongs to a different call: it counts {progress.total} "
                f"chunks, this call has {n} (same tensors and cap are required to "
                "resume)"
            )
        start = progress.done
    threads = contextlib.nullcontext() if device is None else moe_prep_threads(device)
    with threads, _deferred_interrupts() as latch:
        for idx in range(start, n):
            do_chunk(idx)
            if progress is not None:
                progress.done = idx + 1
            latch.release()
