# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NVFP4 reference: E2M1 codes, packing, quantization, scale layouts.

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

Kernel layouts, with their inverses, in pure torch (a CPU emulation reads
what the kernel reads): the 128x4 block-scale swizzle and its "MMA layout"
view (b12x W4A4), and the packed W4A16 layout (``w4a16_*``).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "E2M1_VALUES",
    "FLOAT4_E2M1_MAX",
    "FLOAT8_E4M3_MAX",
    "NVFP4_BLOCK_SIZE",
    "blockscale_mma_layout_view",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "global_scale_from_compressed_tensors",
    "global_scale_from_modelopt",
    "global_scale_to_compressed_tensors",
    "global_scale_to_modelopt",
    "mma_layout_to_linear",
    "nvfp4_global_scale",
    "pack_fp4",
    "quantize_nvfp4",
    "quantize_nvfp4_b12x_activation",
    "swizzle_blockscale",
    "swizzled_blockscale_shape",
    "unpack_fp4",
    "unswizzle_blockscale",
    "w4a16_alpha",
    "w4a16_blockscale_inverse_table",
    "w4a16_blockscale_table",
    "w4a16_blockscale_values",
    "w4a16_dequantize",
    "w4a16_global_scale",
    "w4a16_pack_blockscale",
    "w4a16_pack_weight",
    "w4a16_scale_exponent",
    "w4a16_unpack_blockscale",
    "w4a16_unpack_weight",
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


def _per_leading(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
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
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"x's last dimension must be a multiple of {NVFP4_BLOCK_SIZE}, got "
            f"shape {tuple(x.shape)}"
        )
    gs = _per_leading(global_scale, x).unsqueeze(-1)
    if not (torch.isfinite(gs).all() and (gs > 0).all()):
        raise ValueError(
            f"global_scale must be finite and positive, got {global_scale}"
        )
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
    gs = _per_leading(global_scale, codes).unsqueeze(-1)
    values = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    out = values * block_scale.float().unsqueeze(-1) / gs
    return out.flatten(-2).to(dtype)


#: float32(1/6): the fast path's ``rcp(FLOAT4_E2M1_MAX)``.
_RCP_E2M1_MAX = 1.0 / FLOAT4_E2M1_MAX
#: Smallest normal float32: ``.ftz`` instructions read and write anything
#: smaller as zero.
_F32_TINY = torch.finfo(torch.float32).tiny


def _rcp_ftz(x: torch.Tensor) -> torch.Tensor:
    """float32 ``1 / x`` with subnormal inputs and results flushed to zero, as
    PTX's ``rcp.approx.ftz.f32`` (modelled correctly rounded; the hardware's
    approximation is within one ulp)."""
    x = torch.where(x.abs() < _F32_TINY, torch.zeros_like(x), x)
    r = 1.0 / x
    return torch.where(r.abs() < _F32_TINY, torch.zeros_like(r), r)


def quantize_nvfp4_b12x_activation(
    x: torch.Tensor,
    input_scale: torch.Tensor | float,
    *,
    fast_math: bool = True,
    scales_are_reciprocal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations ``x`` [..., K] to NVFP4 as FlashInfer 0.7.4's b12x
    W4A4 MoE kernels do, operation for operation in float32.

    Read from FlashInfer 0.7.4: ``flashinfer/cute_dsl/fp4_common.py``,
    ``quantize_block_fp4_fast`` (``fast_math=True``, the default) and
    ``quantize_block_fp4``, as called for FC1's input (``input_global_scale
    [expert]``, or ``w1_alpha[expert]``) and FC2's (``fc2_input_scale
    [expert]``, ``moe_static_kernel.py``: ``quantize_q1_sC_to_sA_sSFA``; the
    micro and dynamic kernels call the same). Per 16-element block, ``m = max
    |x|``, API scale ``d`` (inverted first when ``scales_are_reciprocal``)::

        fast:    g = rcp(d); s = g * (m * rcp(6)); inv = rcp(e4m3(s)) * g
        precise: s = m / (6 * d);                  inv = 1 / (e4m3(s) * d)
        block scale = e4m3(min(s, 448)) (round to nearest even, saturating)
        codes = e2m1(x * inv)          (round to nearest even, saturating at 6)

    ``d`` is the DEQUANTIZATION-direction scale (ModelOpt's ``input_scale``);
    a block whose scale rounds to 0 gets codes 0. ``rcp`` is modelled
    correctly rounded with subnormals flushed (``rcp.approx.ftz.f32``); the
    GPU's is within one ulp, so values within an ulp of a rounding boundary
    may round the other way there. NaN inputs are not modelled.

    Args:
        x: bfloat16, float16 or float32, K a multiple of 16 (the kernels read
            BF16: round first to model them).
        input_scale: ``d``: a scalar, or one per leading index (per expert).
        fast_math: the kernels' ``fast_math``.
        scales_are_reciprocal: their ``input_scales_are_reciprocal``
            (``input_scale`` holds ``1 / d``).

    Returns:
        ``(packed, block_scale)``: uint8 [..., K/2] and float8_e4m3fn
        [..., K/16], linear layout; the MMA's operand is about ``x / d``.

    Raises:
        TypeError: ``x`` of another dtype.
        ValueError: K not a multiple of 16; ``input_scale`` not finite and
            positive, or of a shape that does not broadcast per leading index.
    """
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK_SIZE != 0:
        raise ValueError(
            f"x's last dimension must be a multiple of {NVFP4_BLOCK_SIZE}, got "
            f"shape {tuple(x.shape)}"
        )
    d = _per_leading(input_scale, x).unsqueeze(-1)
    if not (torch.isfinite(d).all() and (d > 0).all()):
        raise ValueError(f"input_scale must be finite and positive, got {input_scale}")
    if scales_are_reciprocal:
        d = _rcp_ftz(d) if fast_math else 1.0 / d
    blocks = x.float().unflatten(-1, (-1, NVFP4_BLOCK_SIZE))  # [..., K/16, 16]
    block_max = blocks.abs().amax(dim=-1, keepdim=True)  # [..., K/16, 1]
    if fast_math:
        g = _rcp_ftz(d)
        scale = g * (block_max * _RCP_E2M1_MAX)
    else:
        scale = block_max / (FLOAT4_E2M1_MAX * d)
    scale_fp8 = torch.fmin(scale, torch.tensor(FLOAT8_E4M3_MAX)).to(torch.float8_e4m3fn)
    qs = scale_fp8.float()
    if fast_math:
        inv = _rcp_ftz(qs) * g
    else:
        inv = 1.0 / torch.where(qs > 0, qs * d, torch.ones_like(qs))
    inv = torch.where((qs > 0) & (d > 0), inv, torch.zeros_like(inv))
    codes = e2m1_encode((blocks * inv).flatten(-2))
    # A zero block scale stores all-zero bytes (no sign bits either).
    codes = torch.where(
        (inv > 0).expand_as(blocks).flatten(-2), codes, torch.zeros_like(codes)
    )
    return pack_fp4(codes), scale_fp8.squeeze(-1)


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


# --- the 128x4 block-scale swizzle --------------------------------------------


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def swizzled_blockscale_shape(rows: int, cols: int) -> tuple[int, int]:
    """Padded (rows, cols) of a swizzled [rows, cols] scale matrix."""
    return _ceil_to(rows, 128), _ceil_to(cols, 4)


def swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """Rearrange block scales [R, C] or [E, R, C] into the 128x4 layout.

    Rows are padded with zeros to a multiple of 128 and columns to a multiple
    of 4; each group is viewed as (R/128, 4, 32, C/4, 4), i.e. row
    ``r = m_tile * 128 + inner_m * 32 + outer_m`` and column
    ``c = k_tile * 4 + inner_k``, and stored in the order
    (m_tile, k_tile, outer_m, inner_m, inner_k): each 128x4 tile becomes 512
    contiguous bytes, row ``outer_m`` of the tile holding the 16 scales
    (inner_m, inner_k).

    Returns a new contiguous tensor of shape [Rp, Cp] or [E, Rp, Cp] (the
    same dtype), whose bytes are the swizzled layout.
    """
    if scale.dim() not in (2, 3):
        raise ValueError(
            f"scale must be [R, C] or [E, R, C], got shape {tuple(scale.shape)}"
        )
    batched = scale if scale.dim() == 3 else scale.unsqueeze(0)
    e, r, c = batched.shape
    rp, cp = swizzled_blockscale_shape(r, c)
    if (rp, cp) != (r, c):
        padded = batched.new_zeros((e, rp, cp))
        padded[:, :r, :c] = batched
    else:
        padded = batched
    tiles = padded.view(e, rp // 128, 4, 32, cp // 4, 4)
    out = tiles.permute(0, 1, 4, 3, 2, 5).contiguous().view(e, rp, cp)
    return out if scale.dim() == 3 else out.squeeze(0)


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


def blockscale_mma_layout_view(
    swizzled: torch.Tensor, m: int, k: int, num_groups: int
) -> torch.Tensor:
    """The MMA-layout view of swizzled block scales that the b12x kernel takes.

    ``swizzled``: contiguous, ``num_groups`` (E) groups, e.g. [E, Rp, Cp] from
    :func:`swizzle_blockscale`, of an unpadded m x k weight (k unpacked).
    Returns a view (no copy) of logical shape (32, 4, m_tiles, 4, k_tiles, E),
        indexed (outer_m, inner_m, m_tile, inner_k, k_tile, group), over the
        storage (E, m_tiles, k_tiles, 32, 4, 4): the bytes of the 128x4
        swizzle. The scale of row ``r``, scale column ``c`` of group ``g`` is
        at ``[r % 32, (r % 128) // 32, r // 128, c % 4, c // 4, g]``.
    """
    if not swizzled.is_contiguous():
        raise ValueError("swizzled must be contiguous to be viewed in MMA layout")
    m_tiles = _ceil_to(m, 128) // 128
    k_tiles = _ceil_to(k // NVFP4_BLOCK_SIZE, 4) // 4
    expected = num_groups * m_tiles * k_tiles * 512
    if swizzled.numel() != expected:
        raise ValueError(
            f"swizzled has {swizzled.numel()} elements; {num_groups} groups of a "
            f"{m}x{k // NVFP4_BLOCK_SIZE} scale matrix need {expected}"
        )
    storage = swizzled.view(num_groups, m_tiles, k_tiles, 32, 4, 4)
    return storage.permute(3, 4, 1, 5, 2, 0)


def mma_layout_to_linear(mma: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """An MMA-layout view (:func:`blockscale_mma_layout_view`) read back into
    new, contiguous linear block scales [E, m, k/16]."""
    cols = k // NVFP4_BLOCK_SIZE
    r = torch.arange(m, device=mma.device).view(m, 1)
    c = torch.arange(cols, device=mma.device).view(1, cols)
    linear = mma[r % 32, (r % 128) // 32, r // 128, c % 4, c // 4, :]  # [m, cols, E]
    return linear.permute(2, 0, 1).contiguous()


# --- FlashInfer 0.7.4's W4A16 runtime layout (b12x, quant_mode="w4a16") -------
#
# Per expert, a weight [N, K] (N output rows, K the reduction) becomes:
#
# * codes: int32 [K/16, (N/64) * 128], tiles of 16 (k) x 64 (n) codes, tile
#   (kt, nt) at words [kt, nt*128 : nt*128+128]. With n = nt*64 + warp*16 +
#   c*8 + col and k = kt*16 + ab*8 + tr*2 + h, word col*16 + tr*4 + warp of
#   the tile holds, nibble by nibble (slot 0 lowest), the codes
#   (h, c, ab) = (0,0,0) (0,0,1) (0,1,0) (0,1,1) (1,0,0) ... (1,1,1):
#
#       slot:  0      1       2      3       4        5        6        7
#       k:     2tr    2tr+8   2tr    2tr+8   2tr+1    2tr+9    2tr+1    2tr+9
#       n:     col1   col1    col2   col2    col1     col1     col2     col2
#       (col1 = warp*16 + col, col2 = col1 + 8, in tile coordinates)
#
# * block scales: [K/16, N] bytes, transposed, each 64 columns permuted
#   (an 8x8 transpose, then [0, 2, 1, 3] within each 4: output column
#   p <- row _W4A16_SCALE_ROWS[p]) and re-encoded: the E4M3 value v times
#   2^x (x: :func:`w4a16_scale_exponent`) times 2^7 as an FP16 number, whose
#   bits 14..7 are the byte; values under 2 (v * 2^x < 2^-6) become 0.
# * global scale: the dequantization-direction scale_2 times 2^119 / 2^x.
#
# ``rotate`` = r takes output row j from input row (j + r) % N: with r = I a
# [w3; w1] (up; gate) w13 becomes the kernel's [w1; w3] (gate; up).

#: Rows (output channels) and K elements of one W4A16 tile.
W4A16_TILE_N = 64
W4A16_TILE_K = 16
#: 2^119 = 2^(126 - 7): the kernel reads E2M1 codes placed in BF16 bits
#: (exponent bias difference 126) and block scales carried times 2^7.
W4A16_GLOBAL_SCALE_FACTOR = 2.0**119


def _w4a16_scale_rows() -> list[int]:
    rows = []
    for p in range(W4A16_TILE_N):
        q = 4 * (p // 4) + (0, 2, 1, 3)[p % 4]  # [0, 2, 1, 3] within each 4
        rows.append(8 * (q % 8) + q // 8)  # the 8x8 transpose
    return rows


#: Output column p of each 64 of a packed W4A16 block-scale row comes from
#: input row _W4A16_SCALE_ROWS[p] of those 64; row r went to column
#: _W4A16_SCALE_COLS[r] (the inverse).
_W4A16_SCALE_ROWS = _w4a16_scale_rows()
_W4A16_SCALE_COLS = [_W4A16_SCALE_ROWS.index(r) for r in range(W4A16_TILE_N)]


def _check_w4a16_rows(name: str, n: int, rotate: int) -> None:
    if n % W4A16_TILE_N != 0:
        raise ValueError(
            f"{name}: W4A16 needs the rows (N = {n}) to be a multiple of {W4A16_TILE_N}"
        )
    if not 0 <= rotate < max(n, 1):
        raise ValueError(f"{name}: rotate must be in [0, {n}), got {rotate}")


def w4a16_pack_weight(weight: torch.Tensor, rotate: int = 0) -> torch.Tensor:
    """Packed FP4 weights uint8 [E, N, K/2] -> W4A16 codes int32
    [E, K/16, (N/64) * 128] (see the layout above); a new tensor.

    N must be a multiple of 64 and K of 16. Output row j is input row
    (j + rotate) % N."""
    e, n, half_k = weight.shape
    k = 2 * half_k
    _check_w4a16_rows("weight", n, rotate)
    if k % W4A16_TILE_K != 0:
        raise ValueError(f"weight: W4A16 needs K = {k} to be a multiple of 16")
    codes = unpack_fp4(weight)  # [E, N, K]
    if rotate:
        codes = torch.roll(codes, -rotate, dims=1)
    kt, nt = k // W4A16_TILE_K, n // W4A16_TILE_N
    # [e, nt, warp, c, col, kt, ab, tr, h] -> [e, kt, nt, col, tr, warp, h, c, ab]
    tiles = codes.view(e, nt, 4, 2, 8, kt, 2, 4, 2).permute(0, 5, 1, 4, 7, 2, 8, 3, 6)
    return pack_fp4(tiles.reshape(e, kt, -1)).view(torch.int32)


def w4a16_unpack_weight(packed: torch.Tensor, rotate: int = 0) -> torch.Tensor:
    """Inverse of :func:`w4a16_pack_weight`: int32 [E, K/16, (N/64) * 128]
    -> uint8 [E, N, K/2]; a new tensor."""
    e, kt, words = packed.shape
    nt = words // 128
    n = nt * W4A16_TILE_N
    _check_w4a16_rows("packed", n, rotate)
    codes = unpack_fp4(packed.contiguous().view(torch.uint8))
    rows = codes.view(e, kt, nt, 8, 4, 4, 2, 2, 2).permute(0, 2, 5, 7, 3, 1, 8, 4, 6)
    rows = rows.reshape(e, n, kt * W4A16_TILE_K)
    if rotate:
        rows = torch.roll(rows, rotate, dims=1)
    return pack_fp4(rows)


def w4a16_scale_exponent(scale: torch.Tensor) -> int:
    """x of the power-of-two factor 2^x FlashInfer applies to one weight's
    block scales (all experts): the largest x with max * 2^x <= 448, or 0
    when the largest scale is 0 or 448. Read on the raw bytes (E4M3 order is
    byte order for non-negative scales), as FlashInfer does."""
    if scale.numel() == 0:
        return 0
    top = scale.reshape(-1).view(torch.uint8).max().view(torch.float8_e4m3fn)
    mx = float(top.float()) * 2**7
    if 0.0 < mx < FLOAT8_E4M3_MAX * 2**7:
        return int(math.floor(math.log2((FLOAT8_E4M3_MAX * 2**7) / mx)))
    return 0


def w4a16_blockscale_table(exponent: int, device=None) -> torch.Tensor:
    """uint8 [256]: the packed byte of each E4M3 block-scale byte for factor
    2^exponent: FP16 bits 14..7 of v * 2^exponent * 2^7, 0 under 2."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    x = v * 2.0**exponent * 2**7
    x = torch.where(x < 2, torch.zeros_like(x), x)
    bits = x.to(torch.float16).view(torch.int16) >> 7
    return (bits & 0xFF).to(torch.uint8).to(device)


def w4a16_blockscale_inverse_table(exponent: int, device=None) -> torch.Tensor:
    """uint8 [256]: the E4M3 byte each packed block-scale byte decodes to for
    factor 2^exponent (inverse of :func:`w4a16_blockscale_table` on the
    bytes it produces; a flushed scale, byte 0, decodes to 0)."""
    packed = torch.arange(256, dtype=torch.uint8)
    v = w4a16_blockscale_values(packed) / (2.0**exponent * 2**7)
    return v.to(torch.float8_e4m3fn).view(torch.uint8).to(device)


def w4a16_blockscale_values(packed_scale: torch.Tensor) -> torch.Tensor:
    """float32 of the packed scale bytes as the kernel multiplies them: the
    FP16 number whose bits 14..7 are the byte (v * 2^x * 2^7, or 0)."""
    bits = packed_scale.view(torch.uint8).to(torch.int16) << 7
    return bits.view(torch.float16).float()


def w4a16_pack_blockscale(
    scale: torch.Tensor, exponent: int, rotate: int = 0
) -> torch.Tensor:
    """Linear E4M3 block scales [E, N, K/16] -> the W4A16 packed scales
    float8_e4m3fn-typed bytes [E, K/16, N] (see the layout above); new."""
    e, n, c = scale.shape
    _check_w4a16_rows("scale", n, rotate)
    b = scale.view(torch.uint8)
    if rotate:
        b = torch.roll(b, -rotate, dims=1)
    rows = torch.tensor(_W4A16_SCALE_ROWS, device=scale.device)
    t = b.transpose(1, 2).reshape(e, c, n // W4A16_TILE_N, W4A16_TILE_N)[..., rows]
    table = w4a16_blockscale_table(exponent, scale.device)
    return table[t.long()].reshape(e, c, n).view(torch.float8_e4m3fn)


def w4a16_unpack_blockscale(
    packed_scale: torch.Tensor, exponent: int, rotate: int = 0
) -> torch.Tensor:
    """Inverse of :func:`w4a16_pack_blockscale` up to the flush (a flushed
    scale comes back 0): [E, K/16, N] -> float8_e4m3fn [E, N, K/16]; new."""
    e, c, n = packed_scale.shape
    _check_w4a16_rows("packed_scale", n, rotate)
    table = w4a16_blockscale_inverse_table(exponent, packed_scale.device)
    b = table[packed_scale.view(torch.uint8).long()]
    cols = torch.tensor(_W4A16_SCALE_COLS, device=b.device)
    b = b.reshape(e, c, n // W4A16_TILE_N, W4A16_TILE_N)[..., cols]
    b = b.reshape(e, c, n).transpose(1, 2)
    if rotate:
        b = torch.roll(b, rotate, dims=1)
    return b.contiguous().view(torch.float8_e4m3fn)


def w4a16_global_scale(
    global_scale: torch.Tensor, exponent: int, source_format: str = "modelopt"
) -> torch.Tensor:
    """The kernel's per-expert global scale, float32: ``scale_2 * 2^119 /
    2^exponent``. ``source_format="modelopt"`` takes ``weight_scale_2``
    (dequantization direction); ``"compressed_tensors"`` takes
    ``weight_global_scale`` (quantization direction) and inverts it."""
    if source_format == "compressed_tensors":
        g = 1.0 / global_scale.float()
    elif source_format == "modelopt":
        g = global_scale.float()
    else:
        raise ValueError(
            "source_format must be 'modelopt' or 'compressed_tensors', got "
            f"{source_format!r}"
        )
    return g * W4A16_GLOBAL_SCALE_FACTOR / 2.0**exponent


def w4a16_dequantize(packed: torch.Tensor, packed_scale: torch.Tensor) -> torch.Tensor:
    """The weights the kernel multiplies, before its per-expert alpha
    (:func:`w4a16_alpha`), read from the packed layout alone: float32
    [E, N, K] (rows in the packed order), e2m1 * block scale value (a flushed
    scale is 0; the others are v * 2^x * 2^7)."""
    codes = unpack_fp4(w4a16_unpack_weight(packed))  # [E, N, K]
    cols = torch.tensor(_W4A16_SCALE_COLS, device=packed.device)
    e, c, n = packed_scale.shape
    s = packed_scale.view(torch.uint8).reshape(e, c, n // W4A16_TILE_N, -1)
    s = w4a16_blockscale_values(s[..., cols].reshape(e, c, n)).transpose(1, 2)
    w = e2m1_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK_SIZE)) * s.unsqueeze(-1)
    return w.flatten(-2)


def w4a16_alpha(packed_global: torch.Tensor) -> torch.Tensor:
    """The multiplier of a GEMM's output on :func:`w4a16_dequantize`'s
    weights: ``packed_global * 2^-126`` (= scale_2 * 2^-7 / 2^x), float32."""
    return packed_global.float() * 2.0**-126
