# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Low-peak-memory helpers that rearrange NVFP4 MoE weights for FlashInfer."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from vllm import envs
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    FLOAT8_E4M3_MAX,
    swizzled_blockscale_shape,
)

__all__ = [
    "DEFAULT_MAX_TRANSIENT_BYTES",
    "ChunkProgress",
    "blockscale_storage_for_swizzle",
    "check_blockscale_values",
    "fold_global_scale_into_blockscale_",
    "moe_prep_threads",
    "reorder_w1w3_to_w3w1",
    "swizzle_blockscale_bounded",
    "unswizzle_blockscale_bounded_",
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
# On CUDA every chunk costs three kernel launches (~5 us each) while even a
# 32 MiB L2 of a consumer Blackwell card keeps a 16 MiB buffer resident, so
# the buffer is larger there; this value is reasoned, not measured on SM12x.
_TILE_BYTES = {"cpu": 2 << 20, "cuda": 16 << 20}
_DEFAULT_TILE_BYTES = 2 << 20


def _tile_bytes(device: torch.device) -> int:
    return _TILE_BYTES.get(device.type, _DEFAULT_TILE_BYTES)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (the swap is done in place on its "
            f"storage), got shape {tuple(t.shape)} with stride {t.stride()}"
        )
    return t


def _normalize_dim(name: str, t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"dim={dim} is out of range for {name} with {t.dim()} dimensions "
            f"(expected -{t.dim()} <= dim < {t.dim()})"
        )
    return dim % t.dim()


def _as_halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """View contiguous ``t`` as bytes of shape [outer, 2, half_bytes].

    ``outer`` is the product of the sizes before ``dim``; ``half_bytes`` is half
    of ``t.shape[dim]`` times the sizes after ``dim`` times the element size.
    The result aliases ``t``.
    """
    outer = 1
    for s in t.shape[:dim]:
        outer *= s
    half_bytes = t.numel() * t.element_size() // max(outer, 1) // 2
    return t.reshape(-1).view(torch.uint8).view(outer, 2, half_bytes)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


# --- interruption safety ------------------------------------------------------
#
# Every bounded step below is a sequence of chunks. A chunk reads its source
# into the bounce buffer before its last operation writes the destination, so
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

    Why one thread: a bounded step is many short operations on cache-sized
    chunks, and every parallel operation waits for its slowest thread. When
    another process holds a core, that wait (a scheduler time slice) dwarfs
    the work: at the Qwen3.6-35B-A3B layer shape, with a torch process
    copying on 2 threads beside it, the reorder took 87 ms on two threads
    and 47 ms on one; on a quiet machine one thread costs about 1.4x (see
    the design page, "Threads"). The previous setting is restored on exit;
    nested uses change nothing. The setting is process-wide while it lasts.
    """
    n = envs.VLLM_MOE_PREP_CPU_THREADS
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


def _run_chunks(
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


def _bounce_buffer_bytes(
    nbytes_per_half: list[int], device: torch.device, max_transient_bytes: int
) -> int:
    """Bounce-buffer size in bytes for swapping halves of the given sizes.

    The buffer is never larger than ``max_transient_bytes``, the device's tile
    size, or the largest half (no point allocating more than is moved).
    """
    largest = max(nbytes_per_half, default=0)
    return max(1, min(max_transient_bytes, _tile_bytes(device), largest))


def _swap_chunk(a: torch.Tensor, b: torch.Tensor, tmp: torch.Tensor) -> None:
    """Swap equal-shape ``a`` and ``b`` through ``tmp``: done, or undone."""
    tmp.copy_(a)
    a.copy_(b)
    try:
        b.copy_(tmp)
    except BaseException:
        # a holds b's bytes and a's are only in tmp: put them back.
        a.copy_(tmp)
        raise


def _swap_chunks(halves: torch.Tensor, cap: int) -> list[tuple[int, int, int, int]]:
    """Chunks ``(row, n_rows, start, n_bytes)`` that swap ``halves`` [outer, 2,
    L] through a buffer of ``cap`` bytes: several whole rows per chunk when a
    row fits, else pieces of one row."""
    outer, _, row = halves.shape
    if row <= cap:
        per = cap // row
        return [(s, min(per, outer - s), 0, row) for s in range(0, outer, per)]
    return [
        (i, 1, s, min(cap, row - s)) for i in range(outer) for s in range(0, row, cap)
    ]


def reorder_w1w3_to_w3w1(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dim: int = -2,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swap the gate and up halves of a fused MoE weight and its scales, in place.

    FlashInfer's NVFP4 MoE kernels want the fused gate/up projection as
    ``[w3; w1]`` (up first); checkpoints load it as ``[w1; w3]``. Along ``dim``
    of size ``2I``::

        before:  rows [0, I) = w1 (gate)   rows [I, 2I) = w3 (up)
        after:   rows [0, I) = w3 (up)     rows [I, 2I) = w1 (gate)

    The result is bit-identical to ``torch.cat([w3, w1], dim)`` for every
    dtype, but no second copy of either tensor is ever alive.

    Args:
        weight: contiguous tensor, any dtype, e.g. ``w13_weight``
            [E, 2I, H/2] uint8 (packed FP4).
        scale: contiguous tensor on the same device, any dtype, e.g.
            ``w13_weight_scale`` [E, 2I, H/16] float8_e4m3fn in the linear
            (unswizzled) layout. Its size along ``dim`` must equal weight's.
        dim: the dimension holding ``[w1; w3]``; normalized against each
            tensor's own rank. Must have an even size.
        max_transient_bytes: upper bound on all memory this call allocates,
            together. Any positive value works: when one index along ``dim``
            spans more bytes than the cap, it is split further.
        progress: resumption point (see :class:`ChunkProgress`). The swap is
            an involution: without ``progress``, a retry after an exception
            would swap the chunks already done back.

    Returns:
        ``(weight, scale)``: the same tensor objects, modified in place;
        storage, data pointers, shape, strides and contiguity unchanged.

    Memory and speed: one bounce buffer of ``min(max_transient_bytes, tile,
    largest half)`` bytes is allocated once, before the first write, and reused
    for every chunk of both tensors, so a failed allocation leaves both inputs
    untouched. ``tile`` is 2 MiB on CPU and 16 MiB on CUDA: a buffer that stays
    in cache makes the swap cost about one read and one write of each byte,
    like a memcpy (the per-device measurements are at ``_TILE_BYTES``).

    Interruption: an exception (or SIGINT, held back to the end of the chunk)
    leaves every chunk either swapped or untouched; none of its bytes is left
    only in the buffer.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a tensor is not contiguous, the tensors are on different
            devices or overlap, ``dim`` is out of range, the size along ``dim``
            is odd or differs between the tensors, or the cap is not positive.
            Nothing is modified when an error is raised.
    """
    _check_tensor("weight", weight)
    _check_tensor("scale", scale)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    _check_cap(max_transient_bytes)
    if weight.device != scale.device:
        raise ValueError(
            "weight and scale must be on the same device, got "
            f"weight on {weight.device} and scale on {scale.device}"
        )
    w_dim = _normalize_dim("weight", weight, dim)
    s_dim = _normalize_dim("scale", scale, dim)
    size = weight.shape[w_dim]
    if scale.shape[s_dim] != size:
        raise ValueError(
            f"weight and scale must have the same size along dim={dim}, got "
            f"weight {tuple(weight.shape)} (size {size}) and scale "
            f"{tuple(scale.shape)} (size {scale.shape[s_dim]})"
        )
    if size % 2 != 0:
        raise ValueError(
            f"the size along dim={dim} must be even ([w1; w3] halves), got "
            f"{size} for weight {tuple(weight.shape)}"
        )
    if _overlaps(weight, scale):
        raise ValueError("weight and scale must not share memory")

    with torch.no_grad():
        targets = [
            _as_halves(t, d)
            for t, d in ((weight, w_dim), (scale, s_dim))
            if t.numel() > 0
        ]
        if not targets:
            _run_chunks(0, lambda idx: None, progress)
            return weight, scale
        buf_bytes = _bounce_buffer_bytes(
            [h.shape[0] * h.shape[2] for h in targets],
            weight.device,
            max_transient_bytes,
        )
        chunks = [(h, c) for h in targets for c in _swap_chunks(h, buf_bytes)]
        # The only allocation, made before any write: a failure mutates nothing.
        buf = torch.empty(buf_bytes, dtype=torch.uint8, device=weight.device)

        def swap(idx: int) -> None:
            halves, (row, rows, start, n) = chunks[idx]
            a = halves[row : row + rows, 0, start : start + n]
            b = halves[row : row + rows, 1, start : start + n]
            _swap_chunk(a, b, buf[: rows * n].view(rows, n))

        _run_chunks(len(chunks), swap, progress, weight.device)
    return weight, scale


def _check_cap(max_transient_bytes: object) -> int:
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


def _check_blockscale(name: str, scale: object) -> torch.Tensor:
    _check_tensor(name, scale)
    if scale.dtype != torch.float8_e4m3fn or scale.dim() != 3:
        raise ValueError(
            f"{name} must be a float8_e4m3fn [E, R, C] tensor, got "
            f"{scale.dtype} of shape {tuple(scale.shape)}"
        )
    return scale


def check_blockscale_values(
    name: str,
    scale: torch.Tensor,
    *,
    first_expert: int = 0,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
) -> None:
    """Raise ValueError if FP8 E4M3 block scales hold NaN or negative values.

    ``scale`` is float8_e4m3fn [E, ...] (any layout, contiguous). E4M3 has no
    infinity; its NaN codes are 0x7F and 0xFF. Scales are ``amax / 6``, never
    negative (-0.0 is accepted). One allocation-free min/max pass over the
    bytes decides the common case; only a tensor that may hold a bad value is
    scanned again in chunks of at most ``max_transient_bytes`` (two bool
    masks of half a tile at most) to find it;
    the message names ``name`` and the first bad expert (``first_expert`` is
    the global id of index 0, for expert parallelism). Nothing is modified.
    """
    if scale.numel() == 0:
        return
    e = scale.shape[0]
    per_expert = scale.numel() // e
    flat = scale.reshape(-1).view(torch.uint8)
    cap = _check_cap(max_transient_bytes)
    # Fast path, one pass and no temporaries: as int8, valid scales are
    # 0..126 (0x00..0x7E) and -128 (0x80, -0.0); NaN is 127 or -1 and the
    # negatives are -127..-1. All in 0..126 is the common case.
    with moe_prep_threads(scale.device):
        lo, hi = torch.aminmax(flat.view(torch.int8))
    if int(lo) >= 0 and int(hi) <= 126:
        return
    step = max(1, min(cap // 4, _tile_bytes(scale.device) // 2))
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step]
        # NaN is 0x7F / 0xFF, negative is 0x81..0xFE: byte > 0x80 or == 0x7F.
        bad = chunk > 0x80
        bad |= chunk == 0x7F
        if bool(bad.any()):
            pos = start + int(bad.nonzero()[0, 0])
            byte = int(flat[pos])
            what = "NaN" if byte & 0x7F == 0x7F else "negative"
            raise ValueError(
                f"{name}: block scale of expert {first_expert + pos // per_expert} "
                f"is {what} (FP8 byte 0x{byte:02x}); block scales must be finite "
                "and non-negative"
            )


# The fold's fixed allocations: the 256 FP8 codes as float32 (1 KiB, 1.25 KiB
# while they are made) and, per (expert, row group) segment, its float32
# factor (a view when scale_2 is float32); per segment in a chunk: its table
# (float32 and FP8: 1280 bytes) and offset (4 bytes); per element in a chunk:
# its int32 index (4 bytes).
_FOLD_CODES_BYTES = 1280
_FOLD_TABLE_BYTES = 256 * 5 + 4


def _fold_min_cap(segments: int) -> int:
    """The smallest cap the fold works with: codes, factors, one table and
    the index of one element."""
    return _FOLD_CODES_BYTES + 4 * segments + _FOLD_TABLE_BYTES + 4


def _unit_chunks(units: int, unit_len: int, per: int) -> list[tuple[int, ...]]:
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


def _fp8_codes(device: torch.device) -> torch.Tensor:
    """float32 [256]: the value of every float8_e4m3fn byte 0x00..0xFF."""
    codes = torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).float()


def fold_global_scale_into_blockscale_(
    scale: torch.Tensor,
    scale_2: torch.Tensor,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Multiply FP8 block scales by their per-expert global scale, in place.

    Args:
        scale: float8_e4m3fn [E, R, C] block scales, linear layout, contiguous.
        scale_2: float32 global scales in the DEQUANTIZATION direction
            (ModelOpt ``weight_scale_2``): [E] for one per expert, or [E, G]
            for G equal row groups per expert (G = 2 for ``w13`` with separate
            w1 and w3 scales: rows [0, R/2) use ``scale_2[:, 0]``, rows
            [R/2, R) use ``scale_2[:, 1]``).
        max_transient_bytes: cap on what the call allocates: at least
            2.5 KiB plus 4 bytes per (expert, row group).
        progress: resumption point (see :class:`ChunkProgress`); without it a
            retry after an exception would fold the chunks already done twice.

    Returns ``scale`` itself, each element replaced by
    ``fp8(clamp(float(scale) * scale_2, -448, 448))`` (round to nearest
    even). ``scale_2`` is not modified: the caller sets it to 1 once the
    whole tensor is folded.

    How: each (expert, row group) segment maps each of the 256 FP8 bytes
    through the same function, so a chunk of segments builds that
    function's 256-entry table for each of its segments (the float32 formula
    above, applied to every code) and looks its bytes up in it
    (``index_select`` on an int32 index): bit-identical to the formula,
    with no FP8 -> float32 conversion of the data. Chunks hold whole
    segments when one fits the buffer, else pieces of one segment, so the
    call issues O(bytes / tile) operations. Each chunk is written by one
    operation, after its table and index are built: an exception leaves it
    folded or untouched.
    """
    _check_blockscale("scale", scale)
    cap = _check_cap(max_transient_bytes)
    if not isinstance(scale_2, torch.Tensor):
        raise TypeError(f"scale_2 must be a torch.Tensor, got {type(scale_2).__name__}")
    e, r, c = scale.shape
    groups = 1 if scale_2.dim() == 1 else scale_2.shape[-1]
    if scale_2.dim() not in (1, 2) or scale_2.shape[0] != e or r % groups != 0:
        raise ValueError(
            f"scale_2 must be [E] or [E, G] with E = {e} and G dividing the "
            f"{r} rows of scale, got shape {tuple(scale_2.shape)}"
        )
    if scale_2.device != scale.device:
        raise ValueError(
            f"scale_2 is on {scale_2.device} but scale is on {scale.device}"
        )
    segs = e * groups
    if cap < _fold_min_cap(segs):
        raise ValueError(
            f"max_transient_bytes must be at least {_fold_min_cap(segs)} for "
            f"the fold of {segs} (expert, row group) segments (the 256 FP8 "
            f"codes, one lookup table, one index, the factors), got {cap}"
        )
    if scale.numel() == 0:
        _run_chunks(0, lambda idx: None, progress)
        return scale
    seg_len = (r // groups) * c
    data = scale.view(torch.uint8).view(segs, seg_len)  # [E*G, L]
    budget = max(min(cap, _tile_bytes(scale.device)), _fold_min_cap(segs))
    budget -= _FOLD_CODES_BYTES + 4 * segs  # what chunks may use
    if seg_len * 4 + _FOLD_TABLE_BYTES <= budget:
        per = (budget // (seg_len * 4 + _FOLD_TABLE_BYTES)) * seg_len
    else:
        per = (budget - _FOLD_TABLE_BYTES) // 4
    chunks = _unit_chunks(segs, seg_len, per)
    kmax = max(k for _, k, _, _ in chunks)
    nmax = max(k * n for _, k, _, n in chunks)
    with torch.no_grad():
        factors = scale_2.reshape(segs).float()  # [E*G]
        codes = _fp8_codes(scale.device).view(1, 256)
        table_f = torch.empty(kmax, 256, dtype=torch.float32, device=scale.device)
        table = torch.empty(kmax * 256, dtype=torch.uint8, device=scale.device)
        offsets = torch.arange(0, kmax * 256, 256, dtype=torch.int32,
                               device=scale.device)  # fmt: skip
        index = torch.empty(nmax, dtype=torch.int32, device=scale.device)

        def fold(idx: int) -> None:
            first, k, start, n = chunks[idx]
            # The k tables: fp8(clamp(code * factor)) for all 256 codes.
            tf = table_f[:k]
            torch.mul(codes, factors[first : first + k].unsqueeze(1), out=tf)
            tf.clamp_(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)
            table[: k * 256].view(torch.float8_e4m3fn).view(k, 256).copy_(tf)
            # index = byte + 256 * (segment within the chunk)
            src = data[first : first + k, start : start + n]
            ix = index[: k * n].view(k, n)
            ix.copy_(src)
            if k > 1:
                ix.add_(offsets[:k].unsqueeze(1))
            # The chunk's only write: the looked-up bytes onto the source.
            torch.index_select(table[: k * 256], 0, index[: k * n],
                               out=src.view(k * n))  # fmt: skip

        _run_chunks(len(chunks), fold, progress, scale.device)
    return scale


def blockscale_storage_for_swizzle(
    e: int, r: int, c: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """A float8_e4m3fn [E, R, C] tensor (zeros) whose storage already has room
    for its swizzled, padded [E, Rp, Cp] form, so that
    :func:`swizzle_blockscale_bounded` (called with ``storage_has_room=True``)
    can swizzle it in place even when padding is needed. The extra bytes are
    the padding the kernel needs anyway."""
    rp, cp = swizzled_blockscale_shape(r, c)
    flat = torch.zeros(max(e * rp * cp, 1), dtype=torch.float8_e4m3fn, device=device)
    return flat[: e * r * c].view(e, r, c)


def _storage_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D uint8 view of ``numel`` bytes of ``t``'s storage from its offset."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), (numel,))


class _GroupPlan:
    """How the swizzle and its inverse walk [E, R, C] scales 128 rows at a
    time, in chunks of at most ``per_chunk`` groups (G = Rp / 128 groups per
    expert, group j of expert i is global group i * G + j).

    When R is a multiple of 128 no group straddles two experts and the
    expert boundary does not matter: the tensor is walked as one [1, E*R, C]
    expert. Otherwise a chunk holds whole experts when one fits, else groups
    of one expert. Either way a chunk is one strided block of the linear
    tensor and one contiguous block of the swizzled one, so it is read and
    written by one copy each, and there are O(bytes / chunk) chunks.
    """

    def __init__(self, e: int, r: int, c: int, per_chunk: int) -> None:
        rp, cp = swizzled_blockscale_shape(r, c)
        if r % 128 == 0 and e > 0:
            e, r, rp = 1, e * r, e * rp
        self.e, self.r, self.c, self.cp = e, r, c, cp
        self.groups = rp // 128  # per (walked) expert
        # (first expert, experts, first group, groups)
        self.chunks = _unit_chunks(e, self.groups, max(1, per_chunk))

    def linear(self, flat: torch.Tensor) -> torch.Tensor:
        """The linear [e, r, c] view of the first bytes of ``flat``."""
        return flat[: self.e * self.r * self.c].view(self.e, self.r, self.c)

    def rows(self, chunk: tuple[int, int, int, int]) -> tuple[int, int]:
        """The linear rows [lo, hi) a chunk covers in each of its experts."""
        _, _, g0, n = chunk
        return g0 * 128, min(self.r, (g0 + n) * 128)


def _as_words(x: torch.Tensor, shape: tuple[int, ...], words: bool) -> torch.Tensor:
    """Contiguous uint8 ``x`` as ``shape`` int32 words (4 scale columns of a
    row are one word), or as ``shape + (4,)`` bytes when not 4-aligned."""
    if words:
        return x.view(torch.int32).view(shape)
    return x.view(*shape, 4)


def _word_aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 4 == 0 for t in tensors)


def _swizzle_words(
    lin: torch.Tensor, swz: torch.Tensor, k: int, cp: int, words: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lin`` (k*128 rows of Cp bytes, linear) and ``swz`` (k swizzled
    groups) as matching views: ``swz.copy_(perm)`` swizzles, and
    ``perm.copy_(swz)`` unswizzles, where ``perm`` is the permuted ``lin``."""
    perm = _as_words(lin, (k, 4, 32, cp // 4), words).permute(
        (0, 3, 2, 1) if words else (0, 3, 2, 1, 4)
    )
    return perm, _as_words(swz, (k, cp // 4, 32, 4), words)


def swizzle_blockscale_bounded(
    scale: torch.Tensor,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    storage_has_room: bool = False,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Swizzle block scales [E, R, C] into the 128x4 layout with bounded memory.

    Produces the bytes of
    :func:`~vllm.model_executor.layers.quantization.utils.nvfp4_utils.swizzle_blockscale`
    (rows padded to Rp, a multiple of 128, and columns to Cp, a multiple of 4).

    * In place when no padding is needed ((Rp, Cp) == (R, C)), or when the
      caller states that ``scale``'s storage was made for the padded result
      (``storage_has_room=True``, e.g. by :func:`blockscale_storage_for_swizzle`;
      ValueError if the storage is in fact too small). Only the tensor's own
      bytes, and with ``storage_has_room`` the padding bytes after them, are
      written: spare room in a storage is never taken for free. Groups of
      128 rows move from the last to the first: a group's swizzled bytes
      start at or after its linear bytes, so only groups already moved are
      overwritten. Returns a [E, Rp, Cp] view of the same storage (``scale``
      itself when no padding is needed). ``progress`` makes a retry after an
      exception resume where it stopped.
    * Otherwise: the padded result [E, Rp, Cp] is allocated once (it replaces
      ``scale``, which the caller then drops) and filled group by group from
      the source through the buffer; ``scale`` is left unchanged, and a retry
      simply starts again (``progress`` is not used).

    Apart from such a result, at most ``max_transient_bytes`` is allocated;
    one group of 128 rows (128 * Cp bytes) must fit, else ValueError.
    """
    _check_blockscale("scale", scale)
    cap = _check_cap(max_transient_bytes)
    e, r, c = scale.shape
    rp, cp = swizzled_blockscale_shape(r, c)
    group_bytes = 128 * cp
    if cap < group_bytes:
        raise ValueError(
            f"max_transient_bytes={cap} is below one group of 128 rows of "
            f"block scales ({group_bytes} bytes for {cp} scale columns), the "
            "least the swizzle can move at a time"
        )
    padded = (rp, cp) != (r, c)
    if storage_has_room:
        room = scale.untyped_storage().nbytes() - scale.storage_offset()
        if room < e * rp * cp:
            raise ValueError(
                f"storage_has_room=True but the storage of the [{e}, {r}, {c}] "
                f"scale has {room} bytes from its offset; the padded "
                f"[{e}, {rp}, {cp}] result needs {e * rp * cp}"
            )
    in_place = storage_has_room or not padded
    if scale.numel() == 0:
        if in_place:
            _run_chunks(0, lambda idx: None, progress)
        return scale.new_zeros((e, rp, cp)) if padded and not in_place else scale
    per = max(1, min(cap, _tile_bytes(scale.device)) // group_bytes)
    plan = _GroupPlan(e, r, c, per)
    per = max(k * n for _, k, _, n in plan.chunks)  # groups in the largest chunk
    chunks = plan.chunks
    with torch.no_grad():
        if in_place:
            flat = _storage_view(scale, e * rp * cp)
            src = plan.linear(flat)
            dst = flat.view(-1, group_bytes)  # [E * Rp / 128, 128 * Cp]
            chunks = chunks[::-1]  # last to first
        else:
            src = plan.linear(scale.view(torch.uint8).reshape(-1))
            dst = torch.empty((e * rp // 128, group_bytes), dtype=torch.uint8,
                              device=scale.device)  # fmt: skip
            progress = None
        buf = torch.empty(per * group_bytes, dtype=torch.uint8, device=scale.device)
        words = _word_aligned(dst, buf)

        def move(idx: int) -> None:
            chunk = chunks[idx]
            i, k, g0, n = chunk
            lo, hi = plan.rows(chunk)
            groups = k * n
            pad = buf[: groups * group_bytes]
            if padded:
                pad.zero_()
            # Read the whole chunk before writing any of its destination.
            pad.view(k, n * 128, cp)[:, : hi - lo, :c].copy_(src[i : i + k, lo:hi])
            first = i * plan.groups + g0
            perm, out = _swizzle_words(pad, dst[first : first + groups], groups,
                                       cp, words)  # fmt: skip
            out.copy_(perm)  # the chunk's only write

        _run_chunks(len(chunks), move, progress, scale.device)
        if in_place and not padded:
            return scale
        return dst.view(e, rp, cp).view(torch.float8_e4m3fn)


def unswizzle_blockscale_bounded_(
    swizzled: torch.Tensor,
    rows: int,
    cols: int,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> torch.Tensor:
    """Undo :func:`swizzle_blockscale_bounded` in place: [E, Rp, Cp] in the
    128x4 layout -> linear [E, rows, cols].

    Returns a contiguous [E, rows, cols] view of the first ``E * rows * cols``
    bytes of ``swizzled``'s storage (``swizzled`` itself when no padding was
    needed); the padding bytes after them keep stale values. Groups of 128
    rows move from the first to the last (the mirror of the swizzle): a
    group's linear bytes end before the swizzled bytes of any later group,
    so only groups already read are overwritten. One reused buffer of at most
    ``max_transient_bytes`` (one group, 128 * Cp bytes, must fit); each chunk
    is written by one copy, after it is read; ``progress`` makes a retry
    resume where it stopped.
    """
    _check_blockscale("swizzled", swizzled)
    cap = _check_cap(max_transient_bytes)
    e = swizzled.shape[0]
    rp, cp = swizzled_blockscale_shape(rows, cols)
    if tuple(swizzled.shape[1:]) != (rp, cp):
        raise ValueError(
            f"swizzled has shape {tuple(swizzled.shape)}; a swizzled "
            f"[{e}, {rows}, {cols}] scale is [{e}, {rp}, {cp}]"
        )
    group_bytes = 128 * cp
    if cap < group_bytes:
        raise ValueError(
            f"max_transient_bytes={cap} is below one group of 128 rows of "
            f"block scales ({group_bytes} bytes)"
        )
    if swizzled.numel() == 0:
        _run_chunks(0, lambda idx: None, progress)
        return swizzled[:, :rows, :cols]
    per = max(1, min(cap, _tile_bytes(swizzled.device)) // group_bytes)
    plan = _GroupPlan(e, rows, cols, per)
    per = max(k * n for _, k, _, n in plan.chunks)
    with torch.no_grad():
        flat = _storage_view(swizzled, e * rp * cp)
        src = flat.view(-1, group_bytes)
        dst = plan.linear(flat)
        buf = torch.empty(per * group_bytes, dtype=torch.uint8,
                          device=swizzled.device)  # fmt: skip
        words = _word_aligned(src, buf)

        def move(idx: int) -> None:
            chunk = plan.chunks[idx]
            i, k, g0, n = chunk
            lo, hi = plan.rows(chunk)
            groups = k * n
            lin = buf[: groups * group_bytes]
            first = i * plan.groups + g0
            perm, swz = _swizzle_words(lin, src[first : first + groups], groups,
                                       cp, words)  # fmt: skip
            # Read the whole chunk before writing any of its destination.
            perm.copy_(swz)
            block = lin.view(k, n * 128, cp)[:, : hi - lo, :cols]
            dst[i : i + k, lo:hi].copy_(block)  # the chunk's only write

        _run_chunks(len(plan.chunks), move, progress, swizzled.device)
    if (rp, cp) == (rows, cols):
        return swizzled
    return flat[: e * rows * cols].view(e, rows, cols).view(torch.float8_e4m3fn)
