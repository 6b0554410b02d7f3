# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checkpoint's function survives the fork's preparation through
upstream's own ModelOpt and compressed-tensors W4A4 methods, also when gate
and up carry different global scales, which unmodified 0.33.0 does not.

The prepared layer is computed by the fork's ``FlashInferB12xEmulatedExperts``
(the real experts' preparation and views, ``apply`` in torch; built from the
method's ``moe_config`` and ``moe_quant_config``, bound to the prepared
layer, ``bf16_activations=True``) and compared with the BF16
reference MoE (tests/kernels/moe/moe_reference.py) on the checkpoint's
dequantized weights, each half of w13 with its own global scale. Tolerance: 0.01
relative RMS (the reference rounds the weights to BF16, 2^-9 relative, and
both round the intermediate to BF16). Negative control: the reference with
gate and up exchanged misses it many times over.

Unmodified 0.33.0 (in a subprocess, the same checkpoints): the function its
prepared bytes encode (codes x unswizzled block scales x the alphas its
kernel is given), against the same reference. Its fold re-rounds every
block scale to FP8, and its methods use gate's global scale for up too
(they warn "Accuracy may be affected"); the errors that leaves are
recorded as measurements, beside the fork's fold mode (its bytes are
unmodified 0.33.0's when gate and up share a scale).
"""

import pytest
import torch
from upstream_reports import function_errors, prepared_function_errors

from upstream_env import UPSTREAM_VERSION
from upstream_layers import (
    CHECKPOINT_FORMATS,
    REL_RMS_TOLERANCE,
    SMALL,
    UP_GATE_RATIO,
    prepare_layer,
)

SCALES = {"equal": None, "differing": UP_GATE_RATIO}
FOLD_ENV = "VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE"


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("checkpoint_format", CHECKPOINT_FORMATS)
def test_prepared_layer_computes_the_checkpoints_function(
    one_rank_b12x_vllm,
    monkeypatch,
    unmodified_small_reports,
    upstream_measurements,
    checkpoint_format,
    scales,
):
    ratio = SCALES[scales]
    layer, experts, _ = prepare_layer(SMALL, checkpoint_format, up_gate_ratio=ratio)
    if scales == "differing":
        r = experts.w13_scale_2[:, 1] / experts.w13_scale_2[:, 0]
        assert r.min() < 0.8 and r.max() > 1.25, r
    method = type(layer.quant_method).__name__
    alpha = function_errors(layer, experts, SMALL)
    decoded = prepared_function_errors(layer, experts, SMALL)
    # The fork's fold mode (each shard's own scale folded, as FP8) on the
    # same checkpoint: a second layer, its own name.
    monkeypatch.setenv(FOLD_ENV, "fold")
    folded, _, _ = prepare_layer(
        SMALL,
        checkpoint_format,
        up_gate_ratio=ratio,
        prefix="model.layers.1.mlp.experts",
    )
    fold = function_errors(folded, experts, SMALL)
    unmodified = unmodified_small_reports[scales][checkpoint_format]["function"]
    upstream_measurements(
        f"function rel RMS vs BF16 reference, {method}, {SMALL.id}, gate/up "
        f"global scales {scales}: fork alpha / fork fold (emulated) / "
        f"unmodified {UPSTREAM_VERSION} (its prepared bytes)",
        f"{alpha['rel_rms']:.4f} / {fold['rel_rms']:.4f} / {unmodified['rel_rms']:.4f}",
    )
    assert alpha["rel_rms"] <= REL_RMS_TOLERANCE
    assert alpha["rel_rms_gate_up_swapped"] > 10 * REL_RMS_TOLERANCE
    # The fork's bytes decoded outside the experts encode the same function
    # (the alphas as the real kernel is given them).
    assert decoded["rel_rms"] <= REL_RMS_TOLERANCE
    assert unmodified["rel_rms_gate_up_swapped"] > 10 * REL_RMS_TOLERANCE
    # A fold re-rounds every block scale to FP8 (up to 2^-4 relative): the
    # function moves by several times the tolerance (a finding, not a bound).
    assert fold["rel_rms"] > 2 * REL_RMS_TOLERANCE
    if scales == "equal":
        # Fold mode holds unmodified 0.33.0's bytes (test_fork_nvfp4_moe_
        # prep): the same function, by the two ways of computing it.
        assert abs(fold["rel_rms"] - unmodified["rel_rms"]) <= 0.1 * fold["rel_rms"]
    else:
        # Upstream folds gate's scale into up's blocks too: up is off by
        # s_gate / s_up, far beyond the fold's rounding.
        assert unmodified["rel_rms"] > 3 * fold["rel_rms"]
        assert unmodified["rel_rms"] > 10 * REL_RMS_TOLERANCE


def test_differing_scales_are_carried_by_w2_alpha(one_rank_b12x_vllm):
    # ModelOpt: both per-shard scales kept, up/gate in FC2's alpha, exactly.
    layer, experts, _ = prepare_layer(SMALL, "modelopt", up_gate_ratio=UP_GATE_RATIO)
    prepared = layer.quant_method.moe_kernel.fused_experts.prepared
    s_gate, s_up = experts.w13_scale_2[:, 0], experts.w13_scale_2[:, 1]
    assert torch.equal(layer.w13_weight_scale_2, experts.w13_scale_2)
    assert torch.equal(prepared.w1_alpha, s_gate)
    # w2_alpha also carries FC2's input scale (the activation's).
    fc2 = prepared.fc2_input_scale
    assert torch.equal(prepared.w2_alpha, experts.w2_scale_2 * (s_up / s_gate) * fc2)
    # Control: gate's scale for both (unmodified 0.33.0's) is not what it has.
    assert not torch.equal(prepared.w2_alpha, experts.w2_scale_2 * fc2)
