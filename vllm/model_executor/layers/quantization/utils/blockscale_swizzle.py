# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Swizzle FP8 block scales to the 128x4 layout and back, in bounded memory."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_tensor,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    ChunkProgress,
    check_cap,
    run_chunks,
    tile_bytes,
    unit_chunks,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    swizzled_blockscale_shape,
)

__all__ = [
    "blockscale_storage_for_swizzle",
    "swizzle_blockscale_bounded",
    "unswizzle_blockscale_bounded_",
]


def blockscale_storage_for_swizzle(
    e: int, r: int, c: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """A float8_e4m3fn [E, R, C] tensor (zeros) whose storage has room for its
    swizzled, padded [E, Rp, Cp] form, so that
    :func:`swizzle_blockscale_bounded` (``storage_has_room=True``) swizzles it
    in place even when padding is needed."""
    rp, cp = swizzled_blockscale_shape(r, c)
    flat = torch.zeros(max(e * rp * cp, 1), dtype=torch.float8_e4m3fn, device=device)
    return flat[: e * r * c].view(e, r, c)


def _storage_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D uint8 view of ``numel`` bytes of ``t``'s storage from its offset."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), (numel,))


class _GroupPlan:
    """How the swizzle and its inverse walk [E, R, C] scales in groups of 128
    rows, at most ``per_chunk`` groups a chunk: as one [1, E*R, C] expert when
    R is a multiple of 128 (no group straddles two experts), else whole
    experts when one fits, else groups of one expert. A chunk is one strided
    block of the linear tensor and one contiguous block of the swizzled one.
    """

    def __init__(self, e: int, r: int, c: int, per_chunk: int) -> None:
        rp, cp = swizzled_blockscale_shape(r, c)
        if r % 128 == 0 and e > 0:
            e, r, rp = 1, e * r, e * rp
        self.e, self.r, self.c, self.cp = e, r, c, cp
        self.groups = rp // 128  # per (walked) expert
        # (first expert, experts, first group, groups)
        self.chunks = unit_chunks(e, self.groups, max(1, per_chunk))

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
    check_blockscale_tensor("scale", scale)
    cap = check_cap(max_transient_bytes)
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
            run_chunks(0, lambda idx: None, progress)
        return scale.new_zeros((e, rp, cp)) if padded and not in_place else scale
    per = max(1, min(cap, tile_bytes(scale.device)) // group_bytes)
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
            dst = torch.empty(
                (e * rp // 128, group_bytes), dtype=torch.uint8, device=scale.device
            )
            progress = None
        buf = torch.empty(per * group_bytes, dtype=torch.uint8, device=scale.device)
        words = _word_aligned(dst, buf)

        def move(idx: int) -> Callable[[], object]:
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
            perm, out = _swizzle_words(
                pad, dst[first : first + groups], groups, cp, words
            )
            return lambda: out.copy_(perm)  # the chunk's only write

        run_chunks(len(chunks), move, progress)
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
    check_blockscale_tensor("swizzled", swizzled)
    cap = check_cap(max_transient_bytes)
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
        run_chunks(0, lambda idx: None, progress)
        return swizzled[:, :rows, :cols]
    per = max(1, min(cap, tile_bytes(swizzled.device)) // group_bytes)
    plan = _GroupPlan(e, rows, cols, per)
    per = max(k * n for _, k, _, n in plan.chunks)
    with torch.no_grad():
        flat = _storage_view(swizzled, e * rp * cp)
        src = flat.view(-1, group_bytes)
        dst = plan.linear(flat)
        buf = torch.empty(per * group_bytes, dtype=torch.uint8, device=swizzled.device)
        words = _word_aligned(src, buf)

        def move(idx: int) -> Callable[[], object]:
            chunk = plan.chunks[idx]
            i, k, g0, n = chunk
            lo, hi = plan.rows(chunk)
            groups = k * n
            lin = buf[: groups * group_bytes]
            first = i * plan.groups + g0
            perm, swz = _swizzle_words(
                lin, src[first : first + groups], groups, cp, words
            )
            # Read the whole chunk before writing any of its destination.
            perm.copy_(swz)
            block = lin.view(k, n * 128, cp)[:, : hi - lo, :cols]
            return lambda: dst[i : i + k, lo:hi].copy_(block)  # the only write

        run_chunks(len(plan.chunks), move, progress)
    if (rp, cp) == (rows, cols):
        return swizzled
    return flat[: e * rows * cols].view(e, rows, cols).view(torch.float8_e4m3fn)
