# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The two halves of a fused MoE weight and its scales swapped in place, in
bounded memory and resumably (``[w1; w3]`` <-> ``[w3; w1]``)."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    ChunkProgress,
    allocation_bytes,
    check_cap,
    check_contiguous,
    largest_block_within,
    run_chunks,
    tile_bytes,
    unit_chunks,
)

__all__ = ["swap_halves_"]


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
    """A view (aliasing ``t``, contiguous) as bytes [outer, 2, half_bytes]:
    ``outer`` is the product of the sizes before ``dim``."""
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
    """Bounce-buffer bytes: at most the cap (rounded as the CUDA allocator
    counts), the device's tile and the largest half."""
    largest = max(nbytes_per_half, default=0)
    size = max(1, min(max_transient_bytes, tile_bytes(device), largest))
    if allocation_bytes(size) > max_transient_bytes:
        size = largest_block_within(max_transient_bytes)
    return size


def _swap_chunk(a: torch.Tensor, b: torch.Tensor, tmp: torch.Tensor) -> None:
    """Swap equal-shape ``a`` and ``b`` through ``tmp``: done, or undone
    whichever copy raises, before or after its write."""
    tmp.copy_(a)
    a_holds_b = False
    try:
        a.copy_(b)
        a_holds_b = True  # b may be overwritten from here: a has its bytes
        b.copy_(tmp)
    except BaseException:
        if a_holds_b:
            b.copy_(a)
        a.copy_(tmp)
        raise


def swap_halves_(
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

    Memory: one bounce buffer of ``min(max_transient_bytes, tile, largest
    half)`` bytes (tile: 2 MiB on CPU, 16 MiB on CUDA), allocated once before
    the first write and reused for every chunk of both tensors, so a failed
    allocation leaves both inputs untouched.

    Interruption: an exception (a KeyboardInterrupt included) raised by any
    operation of the call, before or after its write, leaves every chunk
    either swapped or untouched; none of its bytes is left only in the buffer.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a tensor is not contiguous, the tensors are on different
            devices or overlap, ``dim`` is out of range, the size along ``dim``
            is odd or differs between the tensors, or the cap is not positive.
            Nothing is modified when an error is raised.

    """
    check_contiguous("weight", weight)
    check_contiguous("scale", scale)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    check_cap(max_transient_bytes)
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
            run_chunks(0, lambda idx: None, progress)
            return weight, scale
        buf_bytes = _bounce_buffer_bytes(
            [h.shape[0] * h.shape[2] for h in targets],
            weight.device,
            max_transient_bytes,
        )
        # Chunks (row, n rows, start, n bytes) of each [outer, 2, L] halves.
        chunks = [
            (h, c)
            for h in targets
            for c in unit_chunks(h.shape[0], h.shape[2], buf_bytes)
        ]
        # The only allocation, made before any write: a failure mutates nothing.
        buf = torch.empty(buf_bytes, dtype=torch.uint8, device=weight.device)

        def swap(idx: int) -> None:
            halves, (row, rows, start, n) = chunks[idx]
            a = halves[row : row + rows, 0, start : start + n]
            b = halves[row : row + rows, 1, start : start + n]
            _swap_chunk(a, b, buf[: rows * n].view(rows, n))

        run_chunks(len(chunks), swap, progress)
    return weight, scale
