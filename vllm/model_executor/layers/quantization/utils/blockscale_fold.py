# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fold per-expert global scales into FP8 block scales in place, with bounded memory."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_tensor,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ALLOCATION_GRANULE,
    DEFAULT_MAX_TRANSIENT_BYTES,
    ChunkProgress,
    allocation_bytes,
    check_cap,
    run_chunks,
    tile_bytes,
    unit_chunks,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    FLOAT8_E4M3_MAX,
)

__all__ = [
    "fold_global_scale_into_blockscale_",
]


# The fold's allocations, each block rounded up to 512 bytes as the CUDA
# allocator counts: the 256 FP8 codes as float32 (1 KiB; while they are made,
# int32 and uint8 [256] too), one float32 factor per (expert, row group)
# segment (counted even when a view), and per chunk of k segments and n
# elements four blocks: tables float32 [k, 256] and FP8 [k * 256], offsets
# int32 [k], index int32 [n]. Smallest chunk (one segment, 128 elements):
# 1024 + 3 * 512 bytes.
_FOLD_CODES_BYTES = 1024
_FOLD_SMALLEST_CHUNK_BYTES = 1024 + 3 * ALLOCATION_GRANULE


def _fold_chunk_bytes(k: int, n: int) -> int:
    """Allocated bytes of a chunk of ``k`` segments and ``n`` elements."""
    return sum(allocation_bytes(b) for b in (1024 * k, 256 * k, 4 * k, 4 * n))


def _fold_min_cap(segments: int) -> int:
    """The smallest cap the fold works with: factors, codes, smallest chunk."""
    return (
        allocation_bytes(4 * segments) + _FOLD_CODES_BYTES + _FOLD_SMALLEST_CHUNK_BYTES
    )


def _fold_elements_per_chunk(segs: int, seg_len: int, budget: int) -> int:
    """Elements per chunk whose allocations fit ``budget`` bytes: whole
    segments when one fits (as many as fit), else pieces of one segment."""
    if _fold_chunk_bytes(1, seg_len) <= budget:
        k = 1
        while k < segs and _fold_chunk_bytes(k + 1, (k + 1) * seg_len) <= budget:
            k += 1
        return k * seg_len
    index_bytes = budget - _fold_chunk_bytes(1, 0)  # after one segment's tables
    return max(1, index_bytes // ALLOCATION_GRANULE * ALLOCATION_GRANULE // 4)


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
        max_transient_bytes: cap on what the call allocates, each block
            counted rounded up to 512 bytes as the CUDA allocator does: at
            least 3.5 KiB plus 4 bytes per (expert, row group), rounded.
        progress: resumption point (see :class:`ChunkProgress`); without it a
            retry after an exception would fold the chunks already done twice.

    Returns ``scale`` itself, each element replaced by
    ``fp8(clamp(float(scale) * scale_2, -448, 448))`` (round to nearest
    even), bit for bit; ``scale_2`` is not modified (the caller sets it to 1
    once the whole tensor is folded). Each chunk is written by one operation
    (a 256-entry table lookup per segment): an exception leaves it folded or
    untouched.

    """
    check_blockscale_tensor("scale", scale)
    cap = check_cap(max_transient_bytes)
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
        run_chunks(0, lambda idx: None, progress)
        return scale
    seg_len = (r // groups) * c
    data = scale.view(torch.uint8).view(segs, seg_len)  # [E*G, L]
    budget = max(min(cap, tile_bytes(scale.device)), _fold_min_cap(segs))
    # What chunks may use: the rest after the factors and the codes.
    budget -= allocation_bytes(4 * segs) + _FOLD_CODES_BYTES
    per = _fold_elements_per_chunk(segs, seg_len, budget)
    chunks = unit_chunks(segs, seg_len, per)
    kmax = max(k for _, k, _, _ in chunks)
    nmax = max(k * n for _, k, _, n in chunks)
    with torch.no_grad():
        factors = scale_2.reshape(segs).float()  # [E*G]
        codes = _fp8_codes(scale.device).view(1, 256)
        table_f = torch.empty(kmax, 256, dtype=torch.float32, device=scale.device)
        table = torch.empty(kmax * 256, dtype=torch.uint8, device=scale.device)
        offsets = torch.arange(
            0, kmax * 256, 256, dtype=torch.int32, device=scale.device
        )
        index = torch.empty(nmax, dtype=torch.int32, device=scale.device)

        def fold(idx: int) -> Callable[[], object]:
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
            return lambda: torch.index_select(
                table[: k * 256], 0, index[: k * n], out=src.view(k * n)
            )

        run_chunks(len(chunks), fold, progress)
    return scale
