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

# Size of the reused bounce buffer, per device type. The swap moves every byte
# of a half through the buffer (a -> buf, b -> a, buf -> b); when the buffer
# stays resident in cache, the round trip through it costs no DRAM traffic and
# the swap approaches one read plus one write of the tensor, i.e. a memcpy.
# Measured on the 2-core CI machine (1 MiB L2 per core, 32 MiB L3) at the
# Qwen3.6-35B-A3B layer shape, as time / memcpy of the same bytes
# (benchmarks/kernels/benchmark_reorder_w1w3.py --tile-sweep-kib ...):
#   buffer  64K   128K  256K  512K  1M    2M    4M    8M    16M   64M
#   x memcpy 4.15 2.32  1.53  1.17  0.88  0.79  0.77  1.02  1.10  2.46
# Below ~512 KiB the per-chunk dispatch overhead dominates; above the L3-resident
# range the temporary spills to DRAM and traffic grows to 1.5x. 2 MiB (1 MiB per
# core when torch splits a copy over two threads) sits on the plateau.
# The CPU buffer is 64 KiB short of 2 MiB, so that it and a layer's few [E]
# float32 tensors of bookkeeping (alphas, input scales: 8 x 4 bytes per
# expert, 64 KiB at 2048 experts) stay within 2 MiB together.
# On CUDA every chunk costs three kernel launches (~5 us each) while even a
# 32 MiB L2 of a consumer Blackwell card keeps a 16 MiB buffer resident, so
# the buffer is larger there; this value is reasoned, not measured on SM12x.
_TILE_BYTES = {"cpu": (2 << 20) - (64 << 10), "cuda": 16 << 20}
_DEFAULT_TILE_BYTES = 2 << 20


#: The CUDA caching allocator rounds every block up to a multiple of 512
#: bytes and ``torch.cuda.memory_allocated`` counts the rounded size. The
#: bounded steps plan their caps in rounded sizes on every device, so a cap
#: that holds on a CPU holds as the CUDA allocator counts too
#: (tests/kernels/moe/test_nvfp4_moe_prep_rounding.py simulates it).
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
# Every bounded step (reorder, fold, swizzle, unswizzle) is a sequence of
# chunks run by ``run_chunks``. A chunk reads its source into the bounce
# buffer before its last operation writes the destination, so
# an exception raised by any torch call of a chunk leaves the chunk either
# wholly undone or (the swap, whose second write follows its first) undone
# explicitly. An asynchronous KeyboardInterrupt (SIGINT) is held back until the
# chunk in flight and its bookkeeping are complete. So when control leaves a
# step, every chunk is either done and counted in its ``ChunkProgress`` or not
# started, and no byte exists only in the buffer.


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
    intra-op threads when ``device`` is a CPU (1 by default; 0 leaves
    torch's setting); elsewhere, or when already set, a no-op.

    One thread because a bounded step is many short operations on
    cache-sized chunks, each of which would wait for its slowest thread (the
    design page's "Threads" has the figures). The previous setting is
    restored on exit; nested uses change nothing. The setting is
    process-wide while it lasts.
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
