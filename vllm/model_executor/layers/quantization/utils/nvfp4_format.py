# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NVFP4 format in pure torch: E2M1 codes, packing, quantization, scales.

NVFP4 stores a tensor ``x`` [..., K] as

* E2M1 codes (4 bits: sign in bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6),
  two per byte, element 2i in the low nibble: ``packed`` [..., K/2] uint8;
* one FP8 E4M3 block scale per 16 consecutive elements along K:
  ``block_scale`` [..., K/16] float8_e4m3fn (linear, row-major layout);
* one FP32 global scale per tensor (per expert for MoE weights).

Two directions of global scale are in use; every name here says which:

* quantization direction, ``global_scale = 448 * 6 / amax`` (FlashInfer's
  ``fp4_quantize``, compressed-tensors' ``weight_global_scale``):
  ``x ~= e2m1 * block_scale / global_scale``;
* dequantization direction, ``scale_2 = amax / (448 * 6)`` (ModelOpt's
  ``weight_scale_2`` and ``input_scale``): ``x ~= e2m1 * block_scale * scale_2``.

The 128x4 block-scale swizzle itself is vLLM's ``swizzle_blockscale``
(``nvfp4_utils``); its padded shape and its inverse are here. Pure torch and
the standard library only.
"""

from __future__ import annotations

import torch

__all__ = [
    "broadcast_global_scale",
    "checked_quantization_input",
    "E2M1_VALUES",
    "FLOAT4_E2M1_MAX",
    "FLOAT8_E4M3_MAX",
    "NVFP4_BLOCK_SIZE",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "global_scale_from_compressed_tensors",
    "global_scale_from_modelopt",
    "global_scale_to_compressed_tensors",
    "global_scale_to_modelopt",
    "nvfp4_global_scale",
    "pack_fp4",
    "quantize_nvfp4",
    "swizzled_blockscale_shape",
    "unpack_fp4",
    "unswizzle_blockscale",
]

#: Largest E2M1 magnitude.
FLOAT4_E2M1_MAX = 6.0
#: Largest finite float8_e4m3fn value (448.0).
FLOAT8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: Elements sharing one FP8 block scale, along the last dimension.
NVFP4_BLOCK_SIZE = 16

#: Value of each E2M1 code 0..15. Bit 3 is the sign: 8..15 are the negatives of
#: 0..7, and code 8 is -0.0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    + [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

# Midpoints between consecutive E2M1 magnitudes, and whether a value exactly on
# the midpoint rounds up: ties go to the even code (the one whose mantissa bit,
# bit 0, is clear), which is the upper neighbour at 0.75, 1.75 and 3.5 and the
# lower one at 0.25, 1.25, 2.5 and 5.
_E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round floating ``x`` (already divided by its scales) to the nearest
    E2M1 code, ties to even, saturating at +-6: uint8 codes 0..15 of ``x``'s
    shape. Bit 3 is ``x``'s sign bit (-0.0 and negatives that round to zero
    give 8); NaN encodes as 0 or 8 (NVFP4 has no NaN)."""
    mag = x.abs().float()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _E2M1_MIDPOINTS:
        code += (mag >= midpoint) if tie_up else (mag > midpoint)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(
    codes: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Value of each E2M1 code (uint8, 0..15, one code per element)."""
    table = E2M1_VALUES.to(device=codes.device, dtype=dtype)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., K] (K even) into bytes [..., K/2].

    Element 2i goes to the low nibble, 2i+1 to the high nibble: codes
    [1, 7] (0.5, 6.0) pack to the byte 0x71.
    """
    if codes.shape[-1] % 2 != 0:
        raise ValueError(
            f"codes must have an even last dimension, got {tuple(codes.shape)}"
        )
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes [..., K/2] into uint8 codes [..., K]; inverse of pack_fp4."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def broadcast_global_scale(
    scale: torch.Tensor | float, like: torch.Tensor
) -> torch.Tensor:
    """Broadcast a global scale (scalar, or one per leading index) against
    ``like`` [L, ...]: returns float32 of shape [] or [L, 1, ..., 1]."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=like.device)
    if s.numel() == 1:
        return s.reshape(())
    if s.dim() != 1 or like.dim() < 2 or s.shape[0] != like.shape[0]:
        raise ValueError(
            "global scale must be a scalar or have one entry per leading index "
            f"(shape [{like.shape[0] if like.dim() else 1}]), got shape "
            f"{tuple(s.shape)} for a tensor of shape {tuple(like.shape)}"
        )
    return s.reshape(-1, *([1] * (like.dim() - 1)))


def checked_quantization_input(
    x: torch.Tensor, scale: torch.Tensor | float, scale_name: str
) -> torch.Tensor:
    """The checks of an NVFP4 quantizer's input: ``x`` [..., K] bfloat16,
    float16 or float32 with K a multiple of 16 (TypeError, ValueError), and
    its ``scale`` (named ``scale_name``) finite and positive, a scalar or one
    per leading index (ValueError). Returns the scale as float32 broadcast
    against ``x``'s blocks: [] or [L, 1, ..., 1, 1]."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"x's last dimension must be a multiple of {NVFP4_BLOCK_SIZE}, got "
            f"shape {tuple(x.shape)}"
        )
    s = broadcast_global_scale(scale, x).unsqueeze(-1)
    if not (torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"{scale_name} must be finite and positive, got {scale}")
    return s


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., K] (bfloat16, float16 or float32, K a multiple of
    16) to NVFP4 with a QUANTIZATION-direction ``global_scale``
    (:func:`nvfp4_global_scale`): a scalar, or one per leading index.

    Returns ``(packed, block_scale)``: uint8 [..., K/2] and float8_e4m3fn
    [..., K/16], linear layout, ``block_scale = fp8(global_scale *
    amax(block) / 6)``, codes ``e2m1(x * (global_scale / block_scale))``. A
    block whose scale is zero encodes as zeros; no NaN is produced.
    """
    gs = checked_quantization_input(x, global_scale, "global_scale")
    blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., K/16, 16]
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)  # [..., K/16, 1]
    scale = ((block_amax / FLOAT4_E2M1_MAX) * gs).clamp(max=FLOAT8_E4M3_MAX)
    scale_fp8 = scale.to(torch.float8_e4m3fn)
    scale_f32 = scale_fp8.float()
    safe = torch.where(scale_f32 > 0, scale_f32, torch.ones_like(scale_f32))
    scaled = torch.where(scale_f32 > 0, blocks * (gs / safe), torch.zeros_like(blocks))
    codes = e2m1_encode(scaled.flatten(-2))
    return pack_fp4(codes), scale_fp8.squeeze(-1)


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scale: torch.Tensor,
    global_scale: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode ``packed`` uint8 [..., K/2] with ``block_scale`` float8_e4m3fn
    [..., K/16] (linear) and a QUANTIZATION-direction ``global_scale`` (scalar
    or per leading index) to ``e2m1 * block_scale / global_scale`` [..., K]:
    float32, then cast to ``dtype``."""
    codes = unpack_fp4(packed)
    k = codes.shape[-1]
    if block_scale.shape[-1] * NVFP4_BLOCK_SIZE != k:
        raise ValueError(
            f"block_scale {tuple(block_scale.shape)} does not match packed "
            f"{tuple(packed.shape)}: expected last dimension {k // NVFP4_BLOCK_SIZE}"
        )
    gs = broadcast_global_scale(global_scale, codes).unsqueeze(-1)
    values = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    out = values * block_scale.float().unsqueeze(-1) / gs
    return out.flatten(-2).to(dtype)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """QUANTIZATION-direction global scale ``448 * 6 / amax``, float32, of a
    scalar or per-expert ``amax``; always finite (amax 0 gets 1.0)."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    gs = (FLOAT8_E4M3_MAX * FLOAT4_E2M1_MAX) / a
    gs = gs.clamp(max=torch.finfo(torch.float32).max)
    return torch.where(a > 0, gs, torch.ones_like(gs))


def global_scale_from_modelopt(scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt ``weight_scale_2`` / ``input_scale`` (dequantization) -> 1 / x."""
    return 1.0 / scale_2.float()


def global_scale_to_modelopt(global_scale: torch.Tensor) -> torch.Tensor:
    """Global scale -> ModelOpt ``weight_scale_2`` / ``input_scale``: 1 / x."""
    return 1.0 / global_scale.float()


def global_scale_from_compressed_tensors(global_scale_ct: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``weight_global_scale`` / ``input_global_scale``
    (already the quantization direction) -> a float32 copy."""
    return global_scale_ct.float().clone()


def global_scale_to_compressed_tensors(global_scale: torch.Tensor) -> torch.Tensor:
    """Global scale -> compressed-tensors' ``weight_global_scale``: a float32 copy."""
    return global_scale.float().clone()


# --- the 128x4 block-scale swizzle's shape and inverse --------------------------


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_blockscale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded (rows, cols) of a swizzled [rows, cols] scale matrix."""
    return _ceil_to(rows, 128), _ceil_to(cols, 4)


def unswizzle_blockscale(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_blockscale`: [Rp, Cp] or [E, Rp, Cp] in the
    128x4 layout -> new contiguous [rows, cols] or [E, rows, cols]."""
    if swizzled.dim() not in (2, 3):
        raise ValueError(
            f"swizzled must be [Rp, Cp] or [E, Rp, Cp], got {tuple(swizzled.shape)}"
        )
    rp, cp = swizzled_blockscale_shape(rows, cols)
    batched = swizzled if swizzled.dim() == 3 else swizzled.unsqueeze(0)
    if tuple(batched.shape[1:]) != (rp, cp):
        raise ValueError(
            f"swizzled shape {tuple(swizzled.shape)} does not hold a "
            f"{rows}x{cols} matrix (expected padded {rp}x{cp})"
        )
    e = batched.shape[0]
    tiles = batched.reshape(e, rp // 128, cp // 4, 32, 4, 4)
    linear = tiles.permute(0, 1, 4, 3, 2, 5).reshape(e, rp, cp)
    out = linear[:, :rows, :cols].contiguous()
    return out if swizzled.dim() == 3 else out.squeeze(0)
