# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How exactly a prepared NVFP4 MoE layer holds its checkpoint's weights.

Decodes weights twice: from the checkpoint tensors
(``e2m1 * block_scale * weight_scale_2``, [w1; w3]) and from the prepared
layer exactly as the b12x kernel reads it (codes, block scales through the
MMA-layout view, times the per-expert alphas, [w3; w1]), and counts the FP8
block scales out of E4M3's normal range over every expert; for W4A16
(:func:`w4a16_precision`) the packed layout decoded as the kernel reads it.
Benchmarks only. What ``how`` (``--precision``) decodes:

* ``"sample"`` (default): the first, middle and last expert, and in each of
  their w13 ([w3; w1], both halves) and w2 the blocks of 128 rows x 1,024
  columns at the first, middle and last row tile and column span: at most 9
  blocks per tensor and expert.
* ``"full"``: every expert, every row (1,024 rows at a time: bounded memory).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.quantization.utils.flashinfer_b12x_w4a4_format import (
    mma_layout_to_linear,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_alpha,
    w4a16_dequantize,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    dequantize_nvfp4,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    w13_rows,
)

__all__ = [
    "PRECISION_CHOICES",
    "blockscale_range_counts",
    "describe_sample",
    "precision_sample",
    "prepared_weight_precision",
    "w4a16_precision",
]

#: ``--precision`` values: decode a sample, everything, or nothing.
PRECISION_CHOICES = ("sample", "full", "off")
#: The kernel's scale tile: 128 rows (the MMA layout's m_tile).
TILE_ROWS = 128
#: The sample's column span: 1,024 values (64 scale blocks, 16 of the MMA
#: layout's k_tiles).
SPAN_COLS = 1024
#: Full mode decodes this many 128-row tiles of one expert at a time.
_FULL_TILES_PER_STEP = 8


def _spread(n: int) -> list[int]:
    """First, middle and last of ``range(n)`` (fewer when n < 3)."""
    return sorted({0, n // 2, n - 1})


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def precision_sample(
    how: str, num_experts: int, rows: dict[str, int], cols: dict[str, int]
) -> dict:
    """What ``how`` decodes for ``num_experts`` (local) experts whose tensors
    (by prefix) have ``rows[p]`` rows of ``cols[p]`` values:
    ``{"how", "experts": [e...], "tiles": {p: [t...]}, "spans": {p: [j...]}}``:
    row tile t is rows [128 t, 128 (t + 1)), column span j is columns
    [1024 j, 1024 (j + 1)), each cut at the tensor's end. ValueError for an
    unknown ``how`` ("off" decodes nothing)."""
    if how not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {how!r}")
    tiles = {p: _ceil_div(r, TILE_ROWS) for p, r in rows.items()}
    spans = {p: _ceil_div(c, SPAN_COLS) for p, c in cols.items()}
    if how == "off":
        return {
            "how": how,
            "experts": [],
            "tiles": {p: [] for p in rows},
            "spans": {p: [] for p in cols},
        }
    if how == "full":
        return {
            "how": how,
            "experts": list(range(num_experts)),
            "tiles": {p: list(range(n)) for p, n in tiles.items()},
            "spans": {p: list(range(n)) for p, n in spans.items()},
        }
    return {
        "how": how,
        "experts": _spread(num_experts),
        "tiles": {p: _spread(n) for p, n in tiles.items()},
        "spans": {p: _spread(n) for p, n in spans.items()},
    }


def describe_sample(
    sample: dict, num_experts: int, rows: dict[str, int], cols: dict[str, int]
) -> str:
    """One phrase saying what was decoded, for the report."""
    if sample["how"] == "full":
        return f"all {num_experts} experts, every row of w13 and w2"
    experts = ", ".join(map(str, sample["experts"]))
    parts = []
    for p in sample["tiles"]:
        tiles, spans = sample["tiles"][p], sample["spans"][p]
        parts.append(
            f"{p} row tiles {', '.join(map(str, tiles))} of "
            f"{_ceil_div(rows[p], TILE_ROWS)} x column spans "
            f"{', '.join(map(str, spans))} of {_ceil_div(cols[p], SPAN_COLS)}"
        )
    return (
        f"experts {experts} of {num_experts}; blocks of 128 rows x 1024 columns: "
        + "; ".join(parts)
    )


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


def _checkpoint_rows(
    tensors: dict, prefix: str, e: int, rows: torch.Tensor, c0: int, c1: int
) -> torch.Tensor:
    """Rows ``rows``, columns [c0, c1) of expert ``e``'s weight decoded from
    the checkpoint tensors ([w1; w3] for gated w13; one global scale per row
    group): float32 [len(rows), c1 - c0]."""
    weight = tensors[f"{prefix}_weight"]
    rows = rows.to(weight.device)
    packed = weight[e, :, c0 // 2 : c1 // 2].index_select(0, rows).cpu()
    block = tensors[f"{prefix}_weight_scale"][e, :, c0 // 16 : c1 // 16]
    scale = block.index_select(0, rows).cpu()
    scale_2 = tensors[f"{prefix}_weight_scale_2"].cpu().reshape(weight.shape[0], -1)[e]
    group = (rows.cpu() // (weight.shape[1] // scale_2.numel())).long()
    return dequantize_nvfp4(packed, scale, 1.0) * scale_2[group].unsqueeze(1)


def _up_gate_ratio(layer, e: int) -> float:
    """s_up / s_gate of expert ``e`` (1.0 unless gated with differing global
    scales): the factor the kernel's FC2 alpha carries for FC1's up rows."""
    if not layer.moe_config.is_act_and_mul:
        return 1.0
    from vllm.model_executor.layers.fused_moe.weight_prep_guard import get_prep_state

    s2 = layer.w13_weight_scale_2[e].cpu()  # columns as loaded
    up = 0 if get_prep_state(layer).load_w3w1 else 1
    return float(s2[up] / s2[1 - up])


def _prepared_rows(
    layer, prefix: str, e: int, t0: int, t1: int, c0: int, c1: int
) -> torch.Tensor:
    """Rows of 128-row tiles [t0, t1), columns [c0, c1) (c0 a multiple of 64)
    of expert ``e``'s weight as the kernel applies it (codes, scales through
    the MMA-layout view, alpha): float32. The up/gate ratio that FC2's alpha
    carries is moved back onto FC1's up rows, so that the result compares
    weight by weight with the checkpoint's."""
    moe = layer.moe_config
    experts = layer.quant_method.experts
    # The weights' own factors: the kernel's w2_alpha also carries FC2's
    # input scale, which belongs to the activation.
    w1_alpha, w2_alpha = experts.weights.alphas(layer)
    ratio = _up_gate_ratio(layer, e)
    if prefix == "w13":
        packed, mma, alpha = layer.w13_weight, experts.w1_sf_mma, w1_alpha
        m = w13_rows(moe)
    else:
        packed, mma, alpha = layer.w2_weight, experts.w2_sf_mma, w2_alpha
        m = moe.hidden_dim
    r0, r1 = t0 * TILE_ROWS, min(t1 * TILE_ROWS, m)
    # The view's m_tile and k_tile axes sliced to these rows and columns
    # (a k_tile is 4 blocks of 16): row r, column c of the slice is row
    # r0 + r, column c0 + c of the expert.
    tiles = mma[:, :, t0:t1, :, c0 // 64 : _ceil_div(c1, 64), e : e + 1].cpu()
    scales = mma_layout_to_linear(tiles, r1 - r0, c1 - c0)[0]
    codes = packed[e, r0:r1, c0 // 2 : c1 // 2].cpu()
    w = dequantize_nvfp4(codes, scales, 1.0) * alpha[e].cpu()
    if prefix == "w2":
        return w / ratio
    if moe.is_act_and_mul:
        up_end = moe.intermediate_size_per_partition  # [w3; w1]: up rows first
        w[: max(0, min(up_end, r1) - r0)] *= ratio
    return w


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
    is exact), ``sample`` (what was decoded) and ``described`` (in words),
    ``decoded_values``, and per tensor the block-scale range counts of the
    prepared scales and of the checkpoint's (``*_checkpoint``), over all
    experts.
    """
    if how == "off":
        raise ValueError("precision 'off' decodes nothing: nothing to compare")
    moe = layer.moe_config
    rows = {"w13": w13_rows(moe), "w2": moe.hidden_dim}
    cols = {"w13": moe.hidden_dim, "w2": moe.intermediate_size_per_partition}
    local = layer.w13_weight.shape[0]
    sample = precision_sample(how, local, rows, cols)
    half = w13_rows(moe) // 2
    err = ref = 0.0
    decoded = 0
    for e in sample["experts"]:
        for prefix in ("w13", "w2"):
            # Full mode: whole rows, a few tiles at a time; the sample: each
            # (tile, span) block on its own.
            row_step = _FULL_TILES_PER_STEP if how == "full" else 1
            col_step = len(sample["spans"][prefix]) if how == "full" else 1
            for t0, t1 in _tile_runs(sample["tiles"][prefix], row_step):
                for j0, j1 in _tile_runs(sample["spans"][prefix], col_step):
                    c0 = j0 * SPAN_COLS
                    c1 = min(j1 * SPAN_COLS, cols[prefix])
                    got = _prepared_rows(layer, prefix, e, t0, t1, c0, c1)
                    kernel_rows = torch.arange(
                        t0 * TILE_ROWS, t0 * TILE_ROWS + len(got)
                    )
                    if prefix == "w13" and moe.is_act_and_mul:
                        # The kernel's [w3; w1]: its row p is checkpoint row
                        # p + I (w3) or p - I (w1).
                        kernel_rows = (kernel_rows + half) % w13_rows(moe)
                    want = _checkpoint_rows(tensors, prefix, e, kernel_rows, c0, c1)
                    err += float((got - want).square().sum())
                    ref += float(want.square().sum())
                    decoded += want.numel()
    out: dict = {
        "sample": sample,
        "described": describe_sample(sample, local, rows, cols),
        "decoded_values": decoded,
        "rel_rms": (err / ref) ** 0.5 if ref else 0.0,
    }
    for prefix in ("w13", "w2"):
        out[prefix] = _prepared_range_counts(
            layer, prefix, rows[prefix], cols[prefix] // 16
        )
        out[f"{prefix}_checkpoint"] = blockscale_range_counts(
            tensors[f"{prefix}_weight_scale"]
        )
    return out


def _prepared_range_counts(layer, prefix: str, rows: int, cols: int) -> dict:
    """:func:`blockscale_range_counts` of a prepared (swizzled, maybe padded)
    scale, without unswizzling it: the counts do not depend on the layout,
    and the padding, all zero bytes, is taken off the zero count."""
    prepared = getattr(layer, f"{prefix}_weight_scale").detach()
    counts = blockscale_range_counts(prepared)
    padding = counts["total"] - prepared.shape[0] * rows * cols
    counts["total"] -= padding
    counts["zero"] -= padding
    return counts


def w4a16_precision(packed: dict, tensors: dict, experts: list[int]) -> dict:
    """The packed weights decoded as the kernel reads them (codes times
    block scale values, times the per-expert alpha) against the checkpoint's
    own decode (``e2m1 * block_scale * scale_2``), for ``experts``.

    Where an expert's gate and up global scales differ, the kernel's one FC1
    alpha is the gate's and FC2's carries up / gate (``silu(g) * u`` is
    linear in u): the decode moves that ratio back onto the up rows.

    Returns ``rel_rms`` (0.0: exact) and ``flushed``: block scales nonzero in
    the checkpoint that the W4A16 re-encoding flushed to 0 (under 2^-6 after
    the power-of-two factor), with ``total`` block scales, over ``experts``.
    """
    err = ref = 0.0
    flushed = total = 0
    n = tensors["w13_weight"].shape[0]
    s13 = tensors["w13_weight_scale_2"].cpu().float().reshape(n, -1)
    for e in experts:
        ratio = float(s13[e, -1] / s13[e, 0])  # up / gate; 1 when not gated
        for prefix in ("w13", "w2"):
            packed_w = packed[prefix][e : e + 1].cpu()
            packed_s = packed[f"{prefix}_scale"][e : e + 1].cpu()
            alpha = w4a16_alpha(packed[f"{prefix}_global_scale"][e].cpu())
            got = w4a16_dequantize(packed_w, packed_s)[0] * alpha
            if prefix == "w2":
                got /= ratio
            elif s13.shape[1] == 2:
                got[got.shape[0] // 2 :] *= ratio
            w = tensors[f"{prefix}_weight"][e].cpu()
            s = tensors[f"{prefix}_weight_scale"][e].cpu()
            s2 = tensors[f"{prefix}_weight_scale_2"].cpu()
            s2 = s2.reshape(tensors[f"{prefix}_weight"].shape[0], -1)[e]
            groups = s2.numel()
            rows = w.shape[0] // groups
            want = torch.cat(
                [
                    dequantize_nvfp4(
                        w[g * rows : (g + 1) * rows], s[g * rows : (g + 1) * rows], 1.0
                    )
                    * s2[g]
                    for g in range(groups)
                ]
            )
            err += float((got - want).square().sum())
            ref += float(want.square().sum())
            nonzero = s.view(torch.uint8) & 0x7F != 0
            zero_now = packed_s.view(torch.uint8) == 0
            flushed += int(zero_now.sum()) - int((~nonzero).sum())
            total += s.numel()
    return {
        "experts": experts,
        "rel_rms": (err / ref) ** 0.5 if ref else 0.0,
        "flushed": flushed,
        "total": total,
    }
