# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weight-only NVFP4 (W4A16) checkpoints through upstream's own config
classes reach the fork's in-place W4A16 preparation for FLASHINFER_B12X.

ModelOpt ``quant_algo: W4A16_NVFP4`` (``ModelOptNvFp4Config.from_config``),
ModelOpt ``MIXED_PRECISION`` naming the experts W4A16_NVFP4
(``ModelOptMixedPrecisionConfig.from_config``) and compressed-tensors
NVFP4A16 (``input_activations: null``, ``CompressedTensorsConfig.from_config``)
all build upstream's NVFP4 MoE methods with ``use_a16``; the fork's oracle
gives them the W4A16 quant config, and its experts pack the layer into
FlashInfer's W4A16 layout in the parameters' own storage: the bytes of the
fork's reference packing (flashinfer_w4a16_layout.w4a16_pack_weight /
w4a16_pack_blockscale, tested on their own in the slice), and the
function of the checkpoint within 0.01 relative RMS (emulated experts),
gate/up swapped as the control. At the Qwen3.6 layer (slow): the peak.
"""

import pytest
import torch
from upstream_reports import checkpoint_global_scales, function_errors

from upstream_layers import (
    QWEN36_35B_A3B,
    REL_RMS_TOLERANCE,
    SMALL,
    UP_GATE_RATIO,
    W4A16_CONFIGS,
    checkpoint_format_of,
    prepare_layer,
)

MIB = 1 << 20
FORK_PEAK_BOUND = 2 * MIB
SHAPES = [SMALL]


def _check_w4a16_layer(layer, experts, config: str) -> None:
    from vllm.model_executor.layers.quantization.utils import (
        flashinfer_w4a16_layout as ref,
    )

    method = layer.quant_method
    fused = method.moe_kernel.fused_experts
    assert method.nvfp4_backend.name == "FLASHINFER_B12X"
    assert method.use_a16
    assert method.moe_quant_config.use_nvfp4_w4a16
    assert fused.weight_only and type(fused.prepared).__name__ == "W4A16PackedWeights"
    pw = fused.prepared
    # In place: the kernel's tensors are views of the layer's parameters.
    assert pw.w13.untyped_storage().data_ptr() == (
        layer.w13_weight.untyped_storage().data_ptr()
    )
    x13 = ref.w4a16_scale_exponent(experts.w13_scale)
    x2 = ref.w4a16_scale_exponent(experts.w2_scale)
    g13, g2 = checkpoint_global_scales(experts, checkpoint_format_of(config))
    s_gate, s_up = g13[:, 0], g13[:, 1]
    want = {
        "w13": ref.w4a16_pack_weight(experts.w13),
        "w13_scale": ref.w4a16_pack_blockscale(experts.w13_scale, x13),
        "w2": ref.w4a16_pack_weight(experts.w2),
        "w2_scale": ref.w4a16_pack_blockscale(experts.w2_scale, x2),
        "w13_global_scale": ref.w4a16_global_scale(s_gate, x13),
        "w2_global_scale": ref.w4a16_global_scale(g2 * (s_up / s_gate), x2),
    }
    for key, value in want.items():
        got = getattr(pw, key)
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(
            got.contiguous().view(torch.uint8), value.view(torch.uint8)
        ), key


@pytest.mark.parametrize("ratio", [None, UP_GATE_RATIO], ids=["equal", "differing"])
@pytest.mark.parametrize("config", W4A16_CONFIGS)
def test_w4a16_checkpoint_prepares_in_place_to_the_reference(
    one_rank_b12x_vllm, upstream_measurements, config, ratio
):
    layer, experts, _ = prepare_layer(SMALL, config, up_gate_ratio=ratio)
    _check_w4a16_layer(layer, experts, config)
    errors = function_errors(layer, experts, SMALL)
    scales = "equal" if ratio is None else "differing"
    upstream_measurements(
        f"W4A16 function rel RMS vs BF16 reference, {config} "
        f"({type(layer.quant_method).__name__}), {SMALL.id}, gate/up scales {scales}",
        f"{errors['rel_rms']:.4f} (gate/up swapped: "
        f"{errors['rel_rms_gate_up_swapped']:.3f})",
    )
    assert errors["rel_rms"] <= REL_RMS_TOLERANCE
    assert errors["rel_rms_gate_up_swapped"] > 10 * REL_RMS_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("config", ["modelopt-w4a16", "compressed-tensors-w4a16"])
def test_qwen36_w4a16_layer_peak(one_rank_b12x_vllm, upstream_measurements, config):
    shape = QWEN36_35B_A3B
    layer, experts, measured = prepare_layer(shape, config, measure=True)
    where = f"{type(layer.quant_method).__name__} {config} FLASHINFER_B12X W4A16"
    upstream_measurements(
        f"fork {where} preparation, {shape.name} layer ({shape.id}), "
        "peak transient / time",
        f"{measured['peak_bytes'] / MIB:.3f} MiB / {measured['prep_seconds']:.2f} s",
    )
    assert measured["peak_bytes"] <= FORK_PEAK_BOUND
    _check_w4a16_layer(layer, experts, config)
