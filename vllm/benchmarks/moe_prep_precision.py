# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How exactly a prepared NVFP4 MoE layer holds its checkpoint's weights.

Decodes sampled experts twice: from the checkpoint tensors
(``e2m1 * block_scale * weight_scale_2``, [w1; w3]) and from the prepared
layer exactly as the b12x kernel reads it (codes, block scales through the
MMA-layout view, times the per-expert alphas, [w3; w1]), and counts the FP8
block scales that a fold pushed out of E4M3's normal range. Benchmarks only.
"""

from __future__ import annotations

import torch

from vllm.benchmarks.legacy_moe_prep import split_cat_halves
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    dequantize_nvfp4,
    mma_layout_to_linear,
    unswizzle_blockscale,
)

__all__ = ["blockscale_range_counts", "prepared_weight_precision"]


def blockscale_range_counts(scale: torch.Tensor) -> dict[str, int]:
    """Counts of float8_e4m3fn block scales (linear layout, no padding) that
    are subnormal (nonzero, below 2^-6: 1-3 significant bits), saturated
    (+-448) or zero."""
    b = scale.contiguous().view(torch.uint8).reshape(-1)
    # One pass: how often each byte occurs; the sign bit (0x80) is folded
    # away by adding the two halves of the histogram.
    hist = torch.bincount(b, minlength=256).view(2, 128).sum(0).tolist()
    return {
        "total": b.numel(),
        "subnormal": sum(hist[0x01:0x08]),
        "saturated": hist[0x7E],
        "zero": hist[0x00],
    }


def _checkpoint_weight(tensors: dict, prefix: str, e: int) -> torch.Tensor:
    """Expert ``e``'s [rows, K] float32 weight decoded from checkpoint tensors
    ([w1; w3] for gated w13; one global scale per row group)."""
    packed = tensors[f"{prefix}_weight"][e].cpu()
    scale = tensors[f"{prefix}_weight_scale"][e].cpu()
    scale_2 = (
        tensors[f"{prefix}_weight_scale_2"]
        .cpu()
        .reshape(tensors[f"{prefix}_weight"].shape[0], -1)[e]
    )
    rows = packed.shape[0] // scale_2.numel()
    parts = [
        dequantize_nvfp4(packed[g * rows : (g + 1) * rows],
                         scale[g * rows : (g + 1) * rows], 1.0) * scale_2[g]
        for g in range(scale_2.numel())
    ]  # fmt: skip
    return torch.cat(parts)


def _up_gate_ratio(layer, e: int) -> float:
    """s_up / s_gate of expert ``e`` (1.0 unless gated with differing global
    scales): the factor the kernel's FC2 alpha carries for FC1's up rows."""
    if not layer.moe_config.is_act_and_mul:
        return 1.0
    s2 = layer.w13_weight_scale_2[e].cpu()  # prepared: [up, gate]
    return float(s2[0] / s2[1])


def _prepared_weight(layer, prefix: str, e: int) -> torch.Tensor:
    """Expert ``e``'s [rows, K] float32 weight as the kernel applies it: its
    codes and scales times the alpha of its GEMM; the up/gate ratio that
    FC2's alpha carries is moved back onto FC1's up rows, so that the
    result is comparable weight by weight with the checkpoint's."""
    moe = layer.moe_config
    experts = layer.quant_method.experts
    qc = experts.quant_config
    ratio = _up_gate_ratio(layer, e)
    if prefix == "w13":
        packed, mma, alpha = layer.w13_weight, experts.w1_sf_mma, qc.g1_alphas
        m, k = moe.w13_rows, moe.hidden_dim
    else:
        packed, mma, alpha = layer.w2_weight, experts.w2_sf_mma, qc.g2_alphas
        m, k = moe.hidden_dim, moe.intermediate_size_per_partition
    scales = mma_layout_to_linear(mma[..., e : e + 1].cpu(), m, k)[0]
    w = dequantize_nvfp4(packed[e].cpu(), scales, 1.0) * alpha[e].cpu()
    if prefix == "w2":
        return w / ratio
    if moe.is_act_and_mul:
        w[: moe.intermediate_size_per_partition] *= ratio  # [w3; w1]: up rows
    return w


def prepared_weight_precision(layer, tensors: dict, experts: list[int]) -> dict:
    """Compare a prepared layer with the checkpoint tensors it was loaded from.

    Returns ``rel_rms``: ||prepared - checkpoint|| / ||checkpoint|| over the
    decoded weights of ``experts`` (w13 and w2 together; 0.0 when the
    preparation is exact), and per tensor the block-scale range counts of the
    prepared scales and of the checkpoint's (``*_checkpoint``), over all
    experts.
    """
    moe = layer.moe_config
    err = ref = 0.0
    for e in experts:
        for prefix in ("w13", "w2"):
            want = _checkpoint_weight(tensors, prefix, e)
            if prefix == "w13" and moe.is_act_and_mul:
                want = split_cat_halves(want, 0)  # the kernel's [w3; w1]
            got = _prepared_weight(layer, prefix, e)
            err += float((got - want).square().sum())
            ref += float(want.square().sum())
    out: dict = {"experts": experts, "rel_rms": (err / ref) ** 0.5 if ref else 0.0}
    shapes = {
        "w13": (moe.w13_rows, moe.hidden_dim // 16),
        "w2": (moe.hidden_dim, moe.intermediate_size_per_partition // 16),
    }
    for prefix, (rows, cols) in shapes.items():
        prepared = getattr(layer, f"{prefix}_weight_scale").detach().cpu()
        linear = unswizzle_blockscale(prepared, rows, cols)
        out[prefix] = blockscale_range_counts(linear)
        out[f"{prefix}_checkpoint"] = blockscale_range_counts(
            tensors[f"{prefix}_weight_scale"]
        )
    return out
