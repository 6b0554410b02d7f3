# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job's precision report: what "sample" decodes (and says it
decodes), that "full" decodes everything, and that both measure the
prepared layer against its checkpoint (0 where the preparation is exact)."""

import pytest
import torch

from vllm.benchmarks.moe_model_presets import MoEModelPreset
from vllm.benchmarks.moe_prep_precision import (
    TILE_ROWS,
    precision_sample,
    prepared_weight_precision,
)
from vllm.benchmarks.moe_synthetic_weights import synthetic_layer_tensors

# Awkward shapes: 2I = 640 rows (5 tiles) gated; I = 192 (2 tiles, the last
# one partial) relu2; 5 experts (the middle one is 2).
GATED = MoEModelPreset("gated", "test/gated", 1, 256, 5, 2, 320, "silu")
RELU2 = MoEModelPreset("relu2", "test/relu2", 1, 256, 5, 2, 192, "relu2")


def _prepared(preset, mode):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    tensors = synthetic_layer_tensors(preset, 1, torch.device("cpu"), seed=0)
    layer = FusedMoE(
        num_experts=preset.num_experts, top_k=preset.top_k,
        hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        activation=preset.activation, quant_config=ModelOptNvFp4Config(),
        moe_backend="flashinfer_b12x_emulated", place_w3w1_at_load=False,
        experts_kwargs={"global_scale_mode": mode},
    )  # fmt: skip
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).copy_(value)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, tensors


def _values(preset, sample) -> int:
    rows = {"w13": preset.w13_rows(), "w2": preset.hidden_size}
    k = {"w13": preset.hidden_size, "w2": preset.intermediate_size}
    per_expert = sum(
        sum(min(TILE_ROWS, rows[p] - t * TILE_ROWS) for t in sample["tiles"][p]) * k[p]
        for p in rows
    )
    return per_expert * len(sample["experts"])


def test_the_sample_is_first_middle_last_of_experts_and_tiles():
    s = precision_sample("sample", 5, {"w13": 640, "w2": 256})
    assert s == {"how": "sample", "experts": [0, 2, 4],
                 "tiles": {"w13": [0, 2, 4], "w2": [0, 1]}}  # fmt: skip
    full = precision_sample("full", 5, {"w13": 640, "w2": 200})
    assert full["experts"] == [0, 1, 2, 3, 4]
    assert full["tiles"] == {"w13": [0, 1, 2, 3, 4], "w2": [0, 1]}
    assert precision_sample("off", 5, {"w13": 640})["experts"] == []
    assert precision_sample("sample", 1, {"w13": 128})["experts"] == [0]
    with pytest.raises(ValueError, match="precision must be one of"):
        precision_sample("some", 5, {"w13": 640})


@pytest.mark.parametrize("preset", [GATED, RELU2], ids=lambda p: p.name)
@pytest.mark.parametrize("how", ["sample", "full"])
def test_alpha_is_exact_and_fold_is_not(preset, how):
    layer, tensors = _prepared(preset, "alpha")
    alpha = prepared_weight_precision(layer, tensors, how)
    # Shared gate/up global scales (synthetic layers, as ModelOpt exports):
    # the kernel decodes the checkpoint's weights exactly.
    assert alpha["rel_rms"] == 0.0
    assert alpha["decoded_values"] == _values(preset, alpha["sample"])
    layer, tensors = _prepared(preset, "fold")
    fold = prepared_weight_precision(layer, tensors, how)
    # Control: the fold re-rounds every block scale (std 0.02: about 0.1).
    assert fold["rel_rms"] > 0.02
    # Block-scale counts cover every expert whatever was decoded.
    assert fold["w13"]["total"] == preset.num_experts * preset.w13_rows() * 16


def test_sample_and_full_agree_on_the_fold_error():
    layer, tensors = _prepared(GATED, "fold")
    sample = prepared_weight_precision(layer, tensors, "sample")
    full = prepared_weight_precision(layer, tensors, "full")
    assert full["decoded_values"] == GATED.num_experts * (640 * 256 + 256 * 320)
    assert sample["decoded_values"] < full["decoded_values"] // 2
    assert 0.8 < sample["rel_rms"] / full["rel_rms"] < 1.25


def _corrupt(layer, expert, row):
    with torch.no_grad():
        layer.w13_weight.data[expert, row].bitwise_xor_(0x77)


def test_sample_sees_its_tiles_and_full_sees_everything():
    # A wrong byte in a sampled tile (expert 2, tile 2 of the kernel's w13,
    # row 300) is seen by the sample; one outside it (expert 1) only by
    # "full": the sample decodes what it says, "full" decodes every row.
    layer, tensors = _prepared(GATED, "alpha")
    _corrupt(layer, 2, 300)
    assert prepared_weight_precision(layer, tensors, "sample")["rel_rms"] > 0
    layer, tensors = _prepared(GATED, "alpha")
    _corrupt(layer, 1, 300)
    assert prepared_weight_precision(layer, tensors, "sample")["rel_rms"] == 0.0
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
