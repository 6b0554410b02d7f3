# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job's precision report: what "sample" decodes (and says it
decodes), that "full" decodes everything, and that both measure the
prepared layer against its checkpoint (0 where the preparation is exact)."""

import pytest
import torch

from vllm.benchmarks.moe_weight_prep.precision import (
    SPAN_COLS,
    TILE_ROWS,
    precision_sample,
    prepared_weight_precision,
)
from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors

# Awkward shapes: 2I = 640 rows (5 tiles) gated; H = 3136 columns (4 spans
# of 1024, the last one 64 wide); I = 192 (2 tiles, the last one partial)
# relu2; 5 experts (the middle one is 2).
GATED = MoEModelPreset("gated", "test/gated", 1, 3136, 5, 2, 320, "silu")
RELU2 = MoEModelPreset("relu2", "test/relu2", 1, 256, 5, 2, 192, "relu2")


def _prepared(preset, mode):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    tensors = synthetic_layer_tensors(preset, 1, torch.device("cpu"), seed=0)
    layer = FusedMoE(
        num_experts=preset.num_experts,
        top_k=preset.top_k,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        activation=preset.activation,
        quant_config=ModelOptNvFp4Config.for_mode(),
        moe_backend="flashinfer_b12x_emulated",
        place_w3w1_at_load=False,
        experts_kwargs={"global_scale_mode": mode},
    )
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).copy_(value)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, tensors


def _values(preset, sample) -> int:
    rows = {"w13": preset.w13_rows(), "w2": preset.hidden_size}
    k = {"w13": preset.hidden_size, "w2": preset.intermediate_size}
    per_expert = sum(
        sum(min(TILE_ROWS, rows[p] - t * TILE_ROWS) for t in sample["tiles"][p])
        * sum(min(SPAN_COLS, k[p] - j * SPAN_COLS) for j in sample["spans"][p])
        for p in rows
    )
    return per_expert * len(sample["experts"])


def test_the_sample_is_first_middle_last_of_experts_and_tiles():
    rows, cols = {"w13": 640, "w2": 256}, {"w13": 3136, "w2": 320}
    s = precision_sample("sample", 5, rows, cols)
    assert s == {
        "how": "sample",
        "experts": [0, 2, 4],
        "tiles": {"w13": [0, 2, 4], "w2": [0, 1]},
        "spans": {"w13": [0, 2, 3], "w2": [0]},
    }
    full = precision_sample("full", 5, {"w13": 640, "w2": 200}, cols)
    assert full["experts"] == [0, 1, 2, 3, 4]
    assert full["tiles"] == {"w13": [0, 1, 2, 3, 4], "w2": [0, 1]}
    assert full["spans"] == {"w13": [0, 1, 2, 3], "w2": [0]}
    assert precision_sample("off", 5, rows, cols)["experts"] == []
    assert precision_sample("sample", 1, {"w13": 128}, {"w13": 64})["experts"] == [0]
    with pytest.raises(ValueError, match="precision must be one of"):
        precision_sample("some", 5, rows, cols)


@pytest.mark.parametrize("preset", [GATED, RELU2], ids=lambda p: p.name)
@pytest.mark.parametrize("how", ["sample", "full"])
def test_alpha_is_exact_and_fold_is_not(preset, how):
    layer, tensors = _prepared(preset, "alpha")
    alpha = prepared_weight_precision(layer, tensors, how)
    # Shared gate/up global scales (synthetic layers, as ModelOpt exports):
    # the kernel decodes the checkpoint's weights exactly.
    assert alpha["rel_rms"] == 0.0
    assert alpha["decoded_values"] == _values(preset, alpha["sample"])
    # Alpha mode leaves the block scales as loaded: the same counts, the
    # swizzle's zero padding (relu2: 192 rows padded to 256) not among them.
    for t in ("w13", "w2"):
        assert alpha[t] == alpha[f"{t}_checkpoint"]
    layer, tensors = _prepared(preset, "fold")
    fold = prepared_weight_precision(layer, tensors, how)
    # Control: the fold re-rounds every block scale (std 0.02: about 0.1).
    assert fold["rel_rms"] > 0.02
    # Block-scale counts cover every expert whatever was decoded.
    h16 = preset.hidden_size // 16
    assert fold["w13"]["total"] == preset.num_experts * preset.w13_rows() * h16


def test_sample_and_full_agree_on_the_fold_error():
    layer, tensors = _prepared(GATED, "fold")
    sample = prepared_weight_precision(layer, tensors, "sample")
    full = prepared_weight_precision(layer, tensors, "full")
    assert full["decoded_values"] == GATED.num_experts * (640 * 3136 + 3136 * 320)
    assert sample["decoded_values"] < full["decoded_values"] // 2
    assert 0.8 < sample["rel_rms"] / full["rel_rms"] < 1.25


def _corrupt(layer, expert, row, cols):
    # Wrong codes at columns [c0, c1) of one row of the kernel's w13.
    with torch.no_grad():
        layer.w13_weight.data[expert, row, cols[0] // 2 : cols[1] // 2] ^= 0x77


# (expert, kernel row, columns) -> whether the sample holds them: expert 2 is
# sampled, 1 not; row 300 is in row tile 2 (sampled), row 200 in tile 1 (not);
# columns 3072.. are the last, partial span (sampled), 1024.. span 1 (not).
CORRUPTIONS = {
    "sampled block": ((2, 300, (3072, 3136)), True),
    "first block": ((0, 0, (0, 64)), True),
    "unsampled expert": ((1, 300, (3072, 3136)), False),
    "unsampled row tile": ((2, 200, (0, 1024)), False),
    "unsampled column span": ((2, 300, (1024, 2048)), False),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_sample_sees_its_blocks_and_full_sees_everything(case):
    # The sample decodes what it says it does; "full" decodes everything.
    where, sampled = CORRUPTIONS[case]
    layer, tensors = _prepared(GATED, "alpha")
    _corrupt(layer, *where)
    sample = prepared_weight_precision(layer, tensors, "sample")["rel_rms"]
    assert (sample > 0) == sampled
    assert prepared_weight_precision(layer, tensors, "full")["rel_rms"] > 0


def test_both_halves_of_w13_are_compared():
    # Gate and up swapped back (the checkpoint's [w1; w3] where the kernel
    # wants [w3; w1]): far off, in the sample too.
    layer, tensors = _prepared(GATED, "alpha")
    with torch.no_grad():
        w = layer.w13_weight.data
        w.copy_(torch.cat([w[:, 320:], w[:, :320]], dim=1))
    assert prepared_weight_precision(layer, tensors, "sample")["rel_rms"] > 0.5


def test_off_is_refused():
    layer, tensors = _prepared(RELU2, "alpha")
    with pytest.raises(ValueError, match="decodes nothing"):
        prepared_weight_precision(layer, tensors, "off")
