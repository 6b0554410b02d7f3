# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What FlashInfer's b12x W4A4 MoE kernels read, in pure torch: their
activation quantization, operation for operation, and the "MMA layout" view
of 128x4-swizzled block scales (with its inverse), so that a CPU emulation
reads what the kernel reads."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    FLOAT4_E2M1_MAX,
    FLOAT8_E4M3_MAX,
    NVFP4_BLOCK_SIZE,
    checked_quantization_input,
    e2m1_encode,
    pack_fp4,
    swizzled_blockscale_shape,
)

__all__ = [
    "blockscale_mma_layout_view",
    "mma_layout_to_linear",
    "quantize_nvfp4_b12x_activation",
]

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
    d = checked_quantization_input(x, input_scale, "input_scale")
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
    rp, cp = swizzled_blockscale_shape(m, k // NVFP4_BLOCK_SIZE)
    m_tiles, k_tiles = rp // 128, cp // 4
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
