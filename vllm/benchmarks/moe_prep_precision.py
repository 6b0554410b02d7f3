# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How exactly a prepared NVFP4 MoE layer holds its checkpoint's weights.

Decodes weights twice: from the checkpoint tensors
(``e2m1 * block_scale * weight_scale_2``, [w1; w3]) and from the prepared
layer exactly as the b12x kernel reads it (codes, block scales through the
MMA-layout view, times the per-expert alpha, [w3; w1]), and counts the FP8
block scales that a fold pushed out of E4M3's normal range. Benchmarks only.

What is decoded (``how``, the main job's ``--precision``):

* ``"sample"`` (default): the first, middle and last expert, and in each of
  their w13 and w2 the first, middle and last tile of 128 rows (of w13 [w3;
  w1] as the kernel holds it, so both halves are in the sample): 2.9 M of a
  Qwen3.6 layer's 805 M weights, 21 M of a Mixtral layer's 1,409 M (the
  report used to decode three whole experts: 528 M for Mixtral).
* ``"full"``: every expert, every row (1,024 rows at a time: bounded memory).

The block-scale range counts always cover every expert (a byte histogram:
cheap).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    dequantize_nvfp4,
    mma_layout_to_linear,
    unswizzle_blockscale,
)

__all__ = [
    "PRECISION_CHOICES",
    "blockscale_range_counts",
    "describe_sample",
    "precision_sample",
    "prepared_weight_precision",
]

#: ``--precision`` values: decode a sample, everything, or nothing.
PRECISION_CHOICES = ("sample", "full", "off")
#: The kernel's scale tile: 128 rows (the MMA layout's m_tile).
TILE_ROWS = 128
#: Full mode decodes this many 128-row tiles of one expert at a time.
_FULL_TILES_PER_STEP = 8


def _spread(n: int) -> list[int]:
    """First, middle and last of ``range(n)`` (fewer when n < 3)."""
    return sorted({0, n // 2, n - 1})


def precision_sample(how: str, num_experts: int, rows: dict[str, int]) -> dict:
    """What ``how`` decodes: ``{"how", "experts": [e...], "tiles": {"w13":
    [t...], "w2": [t...]}}`` for ``num_experts`` (local) experts whose
    tensors have ``rows[prefix]`` rows; tile t is rows [128 t, 128 (t + 1)).
    ValueError for an unknown ``how`` ("off" decodes nothing)."""
    if how not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {how!r}")
    tiles = {p: -(-r // TILE_ROWS) for p, r in rows.items()}
    if how == "off":
        return {"how": how, "experts": [], "tiles": {p: [] for p in rows}}
    if how == "full":
        return {"how": how, "experts": list(range(num_experts)),
                "tiles": {p: list(range(n)) for p, n in tiles.items()}}  # fmt: skip
    return {"how": how, "experts": _spread(num_experts),
            "tiles": {p: _spread(n) for p, n in tiles.items()}}  # fmt: skip


def describe_sample(sample: dict, num_experts: int, rows: dict[str, int]) -> str:
    """One phrase saying what was decoded, for the report."""
    if sample["how"] == "full":
        return f"all {num_experts} experts, every row of w13 and w2"
    experts = ", ".join(map(str, sample["experts"]))
    parts = []
    for prefix, tiles in sample["tiles"].items():
        total = -(-rows[prefix] // TILE_ROWS)
        parts.append(f"{prefix} tiles {', '.join(map(str, tiles))} of {total}")
    return f"experts {experts} of {num_experts}; 128-row tiles: " + ", ".join(parts)


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


def _checkpoint_rows(tensors: dict, prefix: str, e: int, rows: torch.Tensor):
    """Rows ``rows`` of expert ``e``'s weight decoded from the checkpoint
    tensors ([w1; w3] for gated w13; one global scale per row group):
    float32 [len(rows), K]."""
    weight = tensors[f"{prefix}_weight"]
    rows = rows.to(weight.device)
    packed = weight[e].index_select(0, rows).cpu()
    scale = tensors[f"{prefix}_weight_scale"][e].index_select(0, rows).cpu()
    scale_2 = tensors[f"{prefix}_weight_scale_2"].cpu().reshape(weight.shape[0], -1)[e]
    group = (rows.cpu() // (weight.shape[1] // scale_2.numel())).long()
    return dequantize_nvfp4(packed, scale, 1.0) * scale_2[group].unsqueeze(1)


def _prepared_rows(layer, prefix: str, e: int, t0: int, t1: int) -> torch.Tensor:
    """Rows of 128-row tiles [t0, t1) of expert ``e``'s weight as the kernel
    reads it (codes, scales through the MMA-layout view, alpha): float32."""
    moe = layer.moe_config
    experts = layer.quant_method.experts
    qc = experts.quant_config
    if prefix == "w13":
        packed, mma, alpha = layer.w13_weight, experts.w1_sf_mma, qc.g1_alphas
        m, k = moe.w13_rows, moe.hidden_dim
    else:
        packed, mma, alpha = layer.w2_weight, experts.w2_sf_mma, qc.g2_alphas
        m, k = moe.hidden_dim, moe.intermediate_size_per_partition
    r0, r1 = t0 * TILE_ROWS, min(t1 * TILE_ROWS, m)
    # The view's m_tile axis sliced to these tiles: row r of the slice is
    # row r0 + r of the expert.
    tiles = mma[:, :, t0:t1, :, :, e : e + 1].cpu()
    scales = mma_layout_to_linear(tiles, r1 - r0, k)[0]
    return dequantize_nvfp4(packed[e, r0:r1].cpu(), scales, 1.0) * alpha[e].cpu()


def _tile_runs(tiles: list[int], step: int) -> list[tuple[int, int]]:
    """Consecutive tiles grouped into [t0, t1) runs of at most ``step``."""
    runs: list[tuple[int, int]] = []
    for t in tiles:
        if runs and runs[-1][1] == t and t - runs[-1][0] < step:
            runs[-1] = (runs[-1][0], t + 1)
        else:
            runs.append((t, t + 1))
    return runs


def prepared_weight_precision(layer, tensors: dict, how: str = "sample") -> dict:
    """Compare a prepared layer with the checkpoint tensors it was loaded from.

    Decodes what :func:`precision_sample` picks for ``how`` ("sample" or
    "full"). Returns ``rel_rms``: ||prepared - checkpoint|| / ||checkpoint||
    over the decoded weights (w13 and w2 together; 0.0 when the preparation
    is exact), ``sample`` (what was decoded), ``decoded_values``, and per
    tensor the block-scale range counts of the prepared scales and of the
    checkpoint's (``*_checkpoint``), over all experts.
    """
    if how == "off":
        raise ValueError("precision 'off' decodes nothing: nothing to compare")
    moe = layer.moe_config
    rows = {"w13": moe.w13_rows, "w2": moe.hidden_dim}
    local = layer.w13_weight.shape[0]
    sample = precision_sample(how, local, rows)
    half = moe.w13_rows // 2
    err = ref = 0.0
    decoded = 0
    for e in sample["experts"]:
        for prefix in ("w13", "w2"):
            for t0, t1 in _tile_runs(sample["tiles"][prefix], _FULL_TILES_PER_STEP):
                got = _prepared_rows(layer, prefix, e, t0, t1)
                kernel_rows = torch.arange(t0 * TILE_ROWS, t0 * TILE_ROWS + len(got))
                if prefix == "w13" and moe.is_act_and_mul:
                    # The kernel's [w3; w1]: its row p is checkpoint row p +- I.
                    kernel_rows = (kernel_rows + half) % moe.w13_rows
                want = _checkpoint_rows(tensors, prefix, e, kernel_rows)
                err += float((got - want).square().sum())
                ref += float(want.square().sum())
                decoded += want.numel()
    out: dict = {
        "sample": sample,
        "described": describe_sample(sample, local, rows),
        "decoded_values": decoded,
        "rel_rms": (err / ref) ** 0.5 if ref else 0.0,
    }
    shapes = {
        "w13": (moe.w13_rows, moe.hidden_dim // 16),
        "w2": (moe.hidden_dim, moe.intermediate_size_per_partition // 16),
    }
    for prefix, (nrows, cols) in shapes.items():
        prepared = getattr(layer, f"{prefix}_weight_scale").detach().cpu()
        linear = unswizzle_blockscale(prepared, nrows, cols)
        out[prefix] = blockscale_range_counts(linear)
        out[f"{prefix}_checkpoint"] = blockscale_range_counts(
            tensors[f"{prefix}_weight_scale"]
        )
    return out
