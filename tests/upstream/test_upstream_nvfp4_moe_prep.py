# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own NVFP4 MoE weight preparation for FLASHINFER_B12X, run on
CPU: the ModelOpt and the compressed-tensors W4A4 methods'
``process_weights_after_loading``, unstubbed but for the CPU stand-ins
(upstream_layers.py says what is real).

At a small shape, in this process, against the installed fork (the
branch's experts, default "alpha" mode): the prepared layer holds the
checkpoint's codes as [w3; w1] and its FP8 block scales byte for byte (only
reordered and swizzled), the global scales as loaded ([E, 2] for w13) and
the kernel's alphas exact. At the Qwen3.6-35B-A3B layer shape, against
unmodified 0.33.0 in a subprocess: its fold (effective scales within E4M3's
rounding, every alpha 1) and the preparation's peak transient CPU memory,
the control later tests compare the fork against."""

import pytest
from upstream_reports import prepare_and_report

from upstream_env import UPSTREAM_VERSION
from upstream_layers import (
    CHECKPOINT_FORMATS,
    E4M3_RELATIVE_ROUNDING,
    QWEN36_35B_A3B,
    SMALL,
)

MIB = 1 << 20
# Unmodified 0.33.0 at the Qwen3.6 layer measured 304 MiB; a preparation
# that keeps no full-size copy stays far below this. The bound only says
# that the control measures the whole-tensor preparation at all.
UNMODIFIED_PEAK_FLOOR = 100 * MIB


#: The fork's compressed-tensors global scales are 1 / (1 / s) in float32
#: (the method inverts the stored inverse): one rounding each way.
FLOAT32_ROUND_TRIP = 2.0**-22


def _check_b12x_preparation(report: dict, shape, *, fork: bool) -> None:
    """What both preparations must leave (codes, layout, views, controls),
    and what each does with the global scales: the fork keeps them as the
    kernel's alphas and every block scale as loaded; unmodified 0.33.0
    folds them into the block scales (re-rounded) and passes alphas of 1."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    assert report["backend"] == "FLASHINFER_B12X"
    assert report["experts_class"] == "FlashInferB12xExperts"
    # A permutation of the bytes: exact, and the order must be [up; gate].
    assert report["w13_codes"] == "w3_w1"
    assert report["w2_codes_unchanged"]
    # The same measure tells gate/up swapped and a dropped global scale
    # apart by a wide margin (random block scales; global scales <= 1e-2).
    assert report["w13_scale_rel_err_gate_up_swapped"] > 10 * E4M3_RELATIVE_ROUNDING
    assert report["w13_scale_rel_err_no_global_scale"] > 50
    if fork:
        # The checkpoint's calibrated FC2 input scales, per expert, in the
        # direction the kernel reads (through upstream's 1 / a2_gscale).
        fc2, ckpt = report["fc2_input_scale"], report["w2_input_scale"]
        assert len(fc2) == e
        tol = 2 * FLOAT32_ROUND_TRIP
        assert all(abs(a - b) <= tol * b for a, b in zip(fc2, ckpt, strict=True))
        assert ckpt != [1.0] * e  # the control: not what 0.33.0 passes
        assert report["w2_alpha_carries_fc2_input_scale"]
    else:
        assert report["fc2_input_scale"] == [1.0] * e
    # FlashInfer's MMA-layout view: (32, 4, m_tiles, 4, k_tiles, E).
    assert report["w1_sf_mma_shape"] == [32, 4, 2 * i // 128, 4, h // 64, e]
    assert report["w2_sf_mma_shape"] == [32, 4, h // 128, 4, i // 64, e]
    assert report["sf_mma_views_alias_layer_scales"]
    if fork:
        assert report["global_scale_mode"] == "alpha"
        # Only reordered and swizzled: the checkpoint's FP8 bytes exactly.
        assert report["w13_scale_bytes"] == "checkpoint"
        assert report["w2_scale_bytes"] == "checkpoint"
        exact = report["checkpoint_format"] == "modelopt"
        bound = 0.0 if exact else FLOAT32_ROUND_TRIP
        assert report["w13_scale_rel_err"] <= bound
        assert report["w2_scale_rel_err"] <= bound
        # g1_alphas: the per-shard [E, 2] scales, as loaded; the kernel's
        # alphas: gate's, and w2's times up/gate (1 here: they are equal).
        assert report["global_scales_as_loaded"]
        assert len(report["g1_alphas"]) == 2 * e
        assert report["kernel_alphas_exact"]
    else:
        assert report["global_scale_mode"] is None
        assert report["w13_scale_bytes"] == "rewritten"
        assert report["w13_scale_rel_err"] <= E4M3_RELATIVE_ROUNDING
        assert report["w2_scale_rel_err"] <= E4M3_RELATIVE_ROUNDING
        assert report["g1_alphas"] == [1.0] * e
        assert report["g2_alphas"] == [1.0] * e
        assert not report["global_scales_as_loaded"]


@pytest.mark.parametrize("checkpoint_format", CHECKPOINT_FORMATS)
@pytest.mark.parametrize("shape", [SMALL], ids=lambda s: s.id)
def test_installed_b12x_preparation_on_cpu(
    one_rank_b12x_vllm, shape, checkpoint_format
):
    report = prepare_and_report(shape, checkpoint_format)
    method = {
        "modelopt": "ModelOptNvFp4FusedMoE",
        "compressed-tensors": "CompressedTensorsW4A4Nvfp4MoEMethod",
    }[checkpoint_format]
    assert report["method"] == method
    _check_b12x_preparation(report, shape, fork=True)


@pytest.mark.slow
def test_unmodified_qwen36_layer_preparation_peak(
    unmodified_qwen36_reports, upstream_measurements
):
    reports = list(unmodified_qwen36_reports.values())
    for report in reports:
        _check_b12x_preparation(report, QWEN36_35B_A3B, fork=False)
        upstream_measurements(
            f"unmodified {UPSTREAM_VERSION} {report['method']} FLASHINFER_B12X "
            "preparation, "
            f"{QWEN36_35B_A3B.name} layer ({QWEN36_35B_A3B.id}), peak transient",
            f"{report['peak_bytes'] / MIB:.1f} MiB",
        )
    for report in reports:
        assert report["peak_bytes"] > UNMODIFIED_PEAK_FLOOR, report["method"]
