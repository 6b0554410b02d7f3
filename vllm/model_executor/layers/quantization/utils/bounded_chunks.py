# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chunked, resumable execution of the bounded NVFP4 MoE steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "ALLOCATION_GRANULE",
    "DEFAULT_MAX_TRANSIENT_BYTES",
    "ChunkProgress",
    "allocation_bytes",
    "check_cap",
    "check_contiguous",
    "largest_block_within",
    "run_chunks",
    "tile_bytes",
    "unit_chunks",
]

#: Default cap on the memory one preparation call may allocate beyond the
#: weights (64 MiB; every bounded step takes ``max_transient_bytes``).
DEFAULT_MAX_TRANSIENT_BYTES = 64 << 20

# The reused bounce buffer, per device type: 2 MiB less 64 KiB on CPU (room
# for a layer's [E] bookkeeping within 2 MiB), 16 MiB on CUDA. The sweep
# behind them: docs/design/nvfp4_moe_weight_preparation.md.
_TILE_BYTES = {"cpu": (2 << 20) - (64 << 10), "cuda": 16 << 20}
_DEFAULT_TILE_BYTES = 2 << 20


#: The CUDA caching allocator's block rounding. The bounded steps plan their
#: caps in rounded sizes on every device, so a cap that holds on a CPU holds
#: as ``torch.accelerator.memory_allocated`` counts too.
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


def unit_chunks(units: int, unit_len: int, per: int) -> list[tuple[int, int, int, int]]:
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
# A chunk reads its source into the buffer before its last write, which reads
# only the buffer: a chunk function returns that write, and run_chunks runs
# it (the swap, whose two writes depend on each other, runs both and undoes
# the first if either raises). An exception raised by any operation of the
# chunk before the write leaves the chunk untouched; one that leaves the
# write, before or after its bytes landed (a KeyboardInterrupt is delivered
# when the torch call returns), runs the write once more and counts the
# chunk, so a retry never applies an in-place chunk twice. When control
# leaves a step, every chunk is done and counted in its ``ChunkProgress`` or
# untouched, and no byte exists only in the buffer. Signals are the
# process's to handle: a command that wants Ctrl-C to land only between
# whole preparations holds SIGINT back around them.


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
    #: a chunk whose write failed twice (see :func:`run_chunks`)
    torn: int | None = None

    @property
    def complete(self) -> bool:
        return self.total is not None and self.done >= self.total


def run_chunks(
    n: int,
    do_chunk: Callable[[int], Callable[[], object] | None],
    progress: ChunkProgress | None,
) -> None:
    """Run ``do_chunk(0..n-1)`` in order, resuming after ``progress.done``,
    and count each chunk there once it is complete.

    ``do_chunk(idx)`` reads its chunk and returns the chunk's last write (a
    callable that reads only the buffer, so running it again writes the same
    bytes), or None when it did all of its writing itself; when it raises,
    its chunk must be untouched. An exception leaving the returned write
    runs it once more, counts the chunk and goes on (chained to a second
    failure, which leaves ``progress.torn`` set: that chunk may be half
    written, and a retry with the same ``progress`` raises ValueError).
    """
    start = 0
    if progress is not None:
        if progress.torn is not None:
            raise ValueError(
                f"progress records chunk {progress.torn} half-written by a "
                "failed write: the tensor cannot be resumed; load it again"
            )
        if progress.total is None:
            progress.total = n
        elif progress.total != n:
            raise ValueError(
                f"progress belongs to a different call: it counts {progress.total} "
                f"chunks, this call has {n} (same tensors and cap are required to "
                "resume)"
            )
        start = progress.done
    for idx in range(start, n):
        write = do_chunk(idx)
        if write is not None:
            try:
                write()
            except BaseException:
                _finish_write(write, progress, idx)
                raise
        if progress is not None:
            progress.done = idx + 1


def _finish_write(
    write: Callable[[], object], progress: ChunkProgress | None, idx: int
) -> None:
    try:
        write()
    except BaseException:
        if progress is not None:
            progress.torn = idx
        raise
    if progress is not None:
        progress.done = idx + 1
