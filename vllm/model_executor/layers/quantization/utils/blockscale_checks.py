# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Validation of NVFP4 MoE scales: the FP8 block scales' tensor form and
values, and a layer's float32 global and input scales."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ALLOCATION_GRANULE,
    DEFAULT_MAX_TRANSIENT_BYTES,
    check_cap,
    check_contiguous,
    largest_block_within,
    tile_bytes,
)

__all__ = [
    "check_blockscale_tensor",
    "check_blockscale_values",
    "check_global_scales",
]


def check_blockscale_tensor(name: str, scale: object) -> torch.Tensor:
    t = check_contiguous(name, scale)
    if t.dtype != torch.float8_e4m3fn or t.dim() != 3:
        raise ValueError(
            f"{name} must be a float8_e4m3fn [E, R, C] tensor, got "
            f"{t.dtype} of shape {tuple(t.shape)}"
        )
    return t


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
    cap = check_cap(max_transient_bytes)
    # Fast path, one pass and no temporaries: as int8, valid scales are
    # 0..126 (0x00..0x7E) and -128 (0x80, -0.0); NaN is 127 or -1 and the
    # negatives are -127..-1. All in 0..126 is the common case.
    lo, hi = torch.aminmax(flat.view(torch.int8))
    if int(lo) >= 0 and int(hi) <= 126:
        return
    del lo, hi
    # Per chunk: two bool masks, plus two small blocks (the any() flag, the
    # nonzero() position; on CPU, the compared scalar), each block counted
    # as the CUDA allocator rounds it (512 bytes).
    mask = largest_block_within(max(1, (cap - 2 * ALLOCATION_GRANULE) // 2))
    step = max(1, min(mask, tile_bytes(scale.device) // 2))
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


def check_global_scales(
    layer: torch.nn.Module,
    first_expert: int,
    suffixes: tuple[str, ...] = ("weight_scale_2",),
) -> None:
    """ValueError naming the parameter, expert and shard of a global scale
    (``{w13,w2}_{suffix}`` for each of ``suffixes``) that is not finite and
    positive (scales set in memory, not loaded)."""
    first = "w3" if getattr(layer, "w13_loaded_as_w3w1", False) else "w1"
    shards = {"w13": (first, "w1" if first == "w3" else "w3"), "w2": ("w2",)}
    for prefix in ("w13", "w2"):
        for suffix in suffixes:
            name = f"{prefix}_{suffix}"
            t = getattr(layer, name, None)
            if t is None:
                continue
            values = t.detach().float().reshape(t.shape[0], -1)  # [E, G], tiny
            bad = ~(torch.isfinite(values) & (values > 0))
            if bool(bad.any()):
                e, g = (int(i) for i in bad.nonzero()[0])
                shard = shards[prefix][g] if values.shape[1] > 1 else prefix
                raise ValueError(
                    f"{name} of expert {first_expert + e} ({shard}) is "
                    f"{values[e, g].item()}: global and input scales must be "
                    "finite and positive"
                )
