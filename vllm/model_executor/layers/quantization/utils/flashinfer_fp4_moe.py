# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Low-peak-memory helpers that rearrange NVFP4 MoE weights for FlashInfer."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    FLOAT8_E4M3_MAX,
    swizzled_blockscale_shape,
)

__all__ = [
    "DEFAULT_MAX_TRANSIENT_BYTES",
    "blockscale_storage_for_swizzle",
    "fold_global_scale_into_blockscale_",
    "reorder_w1w3_to_w3w1",
    "swizzle_blockscale_bounded",
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


def _bounce_buffer_bytes(
    nbytes_per_half: list[int], device: torch.device, max_transient_bytes: int
) -> int:
    """Bounce-buffer size in bytes for swapping halves of the given sizes.

    The buffer is never larger than ``max_transient_bytes``, the device's tile
    size, or the largest half (no point allocating more than is moved).
    """
    largest = max(nbytes_per_half, default=0)
    return max(1, min(max_transient_bytes, _tile_bytes(device), largest))


def _swap_halves_(halves: torch.Tensor, buf: torch.Tensor) -> None:
    """Swap ``halves[:, 0]`` and ``halves[:, 1]`` in place through ``buf``.

    ``halves`` is a uint8 [outer, 2, L] view; ``buf`` a uint8 1-D buffer of B
    bytes. When a whole row (L bytes) fits, several rows move per step;
    otherwise each row is cut into pieces of at most B bytes.
    """
    outer, _, row = halves.shape
    cap = buf.numel()
    if row <= cap:
        rows_per_step = cap // row
        for start in range(0, outer, rows_per_step):
            n = min(rows_per_step, outer - start)
            a = halves[start : start + n, 0]
            b = halves[start : start + n, 1]
            tmp = buf[: n * row].view(n, row)
            tmp.copy_(a)
            a.copy_(b)
            b.copy_(tmp)
    else:
        for i in range(outer):
            for start in range(0, row, cap):
                n = min(cap, row - start)
                a = halves[i, 0, start : start + n]
                b = halves[i, 1, start : start + n]
                tmp = buf[:n]
                tmp.copy_(a)
                a.copy_(b)
                b.copy_(tmp)


def reorder_w1w3_to_w3w1(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dim: int = -2,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
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

    Returns:
        ``(weight, scale)``: the same tensor objects, modified in place;
        storage, data pointers, shape, strides and contiguity unchanged.

    Memory and speed: one bounce buffer of ``min(max_transient_bytes, tile,
    largest half)`` bytes is allocated once, before the first write, and reused
    for every chunk of both tensors, so a failed allocation leaves both inputs
    untouched. ``tile`` is 2 MiB on CPU and 16 MiB on CUDA: a buffer that stays
    in cache makes the swap cost about one read and one write of each byte,
    like a memcpy (the per-device measurements are at ``_TILE_BYTES``).

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
            return weight, scale
        buf_bytes = _bounce_buffer_bytes(
            [h.shape[0] * h.shape[2] for h in targets],
            weight.device,
            max_transient_bytes,
        )
        # The only allocation, made before any write: a failure mutates nothing.
        buf = torch.empty(buf_bytes, dtype=torch.uint8, device=weight.device)
        for halves in targets:
            _swap_halves_(halves, buf)
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


def fold_global_scale_into_blockscale_(
    scale: torch.Tensor,
    scale_2: torch.Tensor,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
) -> torch.Tensor:
    """Multiply FP8 block scales by their per-expert global scale, in place.

    Args:
        scale: float8_e4m3fn [E, R, C] block scales, linear layout, contiguous.
        scale_2: float32 global scales in the DEQUANTIZATION direction
            (ModelOpt ``weight_scale_2``): [E] for one per expert, or [E, G]
            for G equal row groups per expert (G = 2 for ``w13`` with separate
            w1 and w3 scales: rows [0, R/2) use ``scale_2[:, 0]``, rows
            [R/2, R) use ``scale_2[:, 1]``).
        max_transient_bytes: cap on what the call allocates (>= 4).

    Returns ``scale`` itself, each element replaced by
    ``fp8(clamp(float(scale) * scale_2, -448, 448))`` (round to nearest
    even); afterwards the global scale of every expert is 1. The float32
    work is done through one reused buffer of at most ``max_transient_bytes``
    (never the 4x-size float32 copy of the whole tensor). ``scale_2`` is not
    modified.
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
    if cap < 4:
        raise ValueError(
            f"max_transient_bytes must be at least 4 (one float32), got {cap}"
        )
    if scale.numel() == 0:
        return scale
    factors = scale_2.reshape(e, groups).float()  # [E, G] (a view when float32)
    segments = scale.view(e, groups, (r // groups) * c)  # [E, G, L]
    seg_len = segments.shape[2]
    n = min(cap // 4, _tile_bytes(scale.device) // 4, scale.numel())
    with torch.no_grad():
        buf = torch.empty(n, dtype=torch.float32, device=scale.device)
        if groups * seg_len <= n:
            per = n // (groups * seg_len)
            for start in range(0, e, per):
                k = min(per, e - start)
                tmp = buf[: k * groups * seg_len].view(k, groups, seg_len)
                tmp.copy_(segments[start : start + k])
                tmp.mul_(factors[start : start + k].unsqueeze(-1))
                tmp.clamp_(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)
                segments[start : start + k].copy_(tmp)
        else:
            for i in range(e):
                for g in range(groups):
                    f = factors[i, g]
                    for start in range(0, seg_len, n):
                        k = min(n, seg_len - start)
                        tmp = buf[:k]
                        tmp.copy_(segments[i, g, start : start + k])
                        tmp.mul_(f)
                        tmp.clamp_(-FLOAT8_E4M3_MAX, FLOAT8_E4M3_MAX)
                        segments[i, g, start : start + k].copy_(tmp)
    return scale


def blockscale_storage_for_swizzle(
    e: int, r: int, c: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """A float8_e4m3fn [E, R, C] tensor (zeros) whose storage already has room
    for its swizzled, padded [E, Rp, Cp] form, so that
    :func:`swizzle_blockscale_bounded` can swizzle it in place even when
    padding is needed. The extra bytes are the padding the kernel needs
    anyway."""
    rp, cp = swizzled_blockscale_shape(r, c)
    flat = torch.zeros(max(e * rp * cp, 1), dtype=torch.float8_e4m3fn, device=device)
    return flat[: e * r * c].view(e, r, c)


def _storage_view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D uint8 view of ``numel`` bytes of ``t``'s storage from its offset."""
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), (numel,))


def swizzle_blockscale_bounded(
    scale: torch.Tensor,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
) -> torch.Tensor:
    """Swizzle block scales [E, R, C] into the 128x4 layout with bounded memory.

    Produces the bytes of
    :func:`~vllm.model_executor.layers.quantization.utils.nvfp4_utils.swizzle_blockscale`
    (rows padded to Rp, a multiple of 128, and columns to Cp, a multiple of 4).

    * In place, when ``scale``'s storage has room for [E, Rp, Cp] from its
      offset: always when no padding is needed, and for tensors made by
      :func:`blockscale_storage_for_swizzle`. Groups of 128 rows are moved
      from the last to the first: a group's swizzled bytes start at or after
      its linear bytes, so only groups already moved are overwritten. Each
      group goes through one reused buffer. Returns a [E, Rp, Cp] view of the
      same storage (``scale`` itself when no padding is needed).
    * Otherwise: the padded result [E, Rp, Cp] is allocated once (it replaces
      ``scale``, which the caller then drops) and filled group by group from
      the source through the buffer; ``scale`` is left unchanged.

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
    if scale.numel() == 0:
        return scale
    groups = rp // 128  # per expert
    per = max(1, min(cap, _tile_bytes(scale.device)) // group_bytes)
    per = min(per, groups)
    padded = (rp, cp) != (r, c)
    room = scale.untyped_storage().nbytes() - scale.storage_offset()
    in_place = room >= e * rp * cp
    with torch.no_grad():
        if in_place:
            flat = _storage_view(scale, e * rp * cp)
            src = flat[: e * r * c].view(e, r, c)
            dst = flat.view(e, groups, group_bytes)
            order = [(i, g) for i in reversed(range(e))
                     for g in reversed(range(0, groups, per))]  # fmt: skip
        else:
            src = scale.view(torch.uint8)
            dst = torch.empty((e, groups, group_bytes), dtype=torch.uint8,
                              device=scale.device)  # fmt: skip
            order = [(i, g) for i in range(e) for g in range(0, groups, per)]
        buf = torch.empty(per * group_bytes, dtype=torch.uint8, device=scale.device)
        for i, start in order:
            k = min(per, groups - start)
            rows = min(r, (start + k) * 128) - start * 128
            pad = buf[: k * group_bytes].view(k * 128, cp)
            if padded:
                pad.zero_()
            # Read the whole chunk before writing any of its destination.
            pad[:rows, :c].copy_(src[i, start * 128 : start * 128 + rows])
            swz = pad.view(k, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
            dst[i, start : start + k].view(k, cp // 4, 32, 4, 4).copy_(swz)
        if in_place and not padded:
            return scale
        return dst.view(e, rp, cp).view(torch.float8_e4m3fn)
