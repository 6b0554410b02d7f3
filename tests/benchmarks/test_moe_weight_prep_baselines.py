# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The bounded preparation against what the benchmark measures it by: real
model presets and their synthetic layers, the legacy steps and fold, and the
precision report."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe
from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    fold_reference,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    rel_rms_error,
    split_cat_halves,
    whole_tensor_preparation,
)
from tests.kernels.utils import DEVICES, bytes_of
from vllm.benchmarks.moe_weight_prep.baselines import (
    legacy_fold,
    legacy_preparation_steps,
)
from vllm.benchmarks.moe_weight_prep.precision import prepared_weight_precision
from vllm.benchmarks.moe_weight_prep.presets import get_preset
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

MIB = 1 << 20
BACKEND = "flashinfer_b12x_emulated"  # same preparation as flashinfer_b12x


def test_separate_w1_w3_global_scales_are_exact():
    # Up (w3) weights 4x larger than gate (w1): their global scales differ 4x.
    e, h, i, topk = 4, 256, 128, 2
    w1, w2 = bf16_experts(e, i, h, gated=True, seed=31)
    w1[:, i:] *= 4
    tensors = quantize_experts_modelopt(w1, w2, gated=True, shared_w13_scale=False)
    s2 = tensors["w13_weight_scale_2"]
    ratio = s2[:, 1] / s2[:, 0]
    assert ((ratio > 3) & (ratio < 5)).all(), ratio
    layer = make_nvfp4_layer(e, topk, h, i, True, BACKEND, bf16_activations=True)
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(32, h, generator=gen).bfloat16()
    logits = torch.randn(32, e, generator=gen)
    dw1, dw2 = dequantized_experts(tensors, gated=True)
    ref = torch_moe(x, dw1, dw2, logits, topk, renormalize=True)
    out = layer(x, logits)
    # Tolerance: the BF16-activation tolerance of test_flashinfer_b12x_moe (0.01):
    # the up/gate ratio rides on w2_alpha, no block scale is rewritten.
    assert rel_rms_error(out, ref) < 0.01
    # ...and the block scales are the loaded ones, reordered and swizzled.
    want = swizzle_blockscale(split_cat_halves(tensors["w13_weight_scale"], -2))
    assert torch.equal(bytes_of(layer.w13_weight_scale.data), bytes_of(want))
    # The benchmark's precision report sees the same: exact up to float32
    # rounding of the alphas (the fold would be ~1e-2 here).
    report = prepared_weight_precision(layer, tensors, "full")
    assert report["rel_rms"] < 1e-6, report
    # Control: folding both halves with w1's scale (dropping w3's, as the
    # legacy fold did) misses by far.
    dropped = dict(tensors)
    dropped["w13_weight_scale_2"] = s2[:, :1].expand(e, 2).contiguous()
    dw1_dropped, _ = dequantized_experts(dropped, gated=True)
    ref_dropped = torch_moe(x, dw1_dropped, dw2, logits, topk, renormalize=True)
    assert rel_rms_error(out, ref_dropped) > 0.5
    # ...and the legacy fold's scale bytes do differ from the exact ones.
    legacy = legacy_fold(tensors["w13_weight_scale"], s2)
    exact = fold_reference(tensors["w13_weight_scale"], s2)
    assert not torch.equal(bytes_of(legacy), bytes_of(exact))


def _prep_peak(layer, device) -> int:
    with measure_peak_memory(device) as mem:
        layer.quant_method.process_weights_after_loading(layer)
    return mem.peak_bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cap", [64 * MIB, 4 * MIB], ids=["64MiB", "4MiB"])
@pytest.mark.parametrize("model", ["qwen3.6-35b-a3b", "nemotron-3-nano-30b-a3b"])
def test_whole_preparation_of_a_real_layer_stays_within_cap(model, cap, device):
    # Qwen3.6-35B-A3B: gated, no padding. Nemotron-3-Nano: relu2, I = 1856
    # rows, so its w13 block scales need padding to 1920 rows.
    preset = get_preset(model)
    tensors = synthetic_layer_tensors(preset, 1, torch.device(device), seed=0)
    layer = make_nvfp4_layer(
        preset.num_experts,
        preset.top_k,
        preset.hidden_size,
        preset.intermediate_size,
        preset.is_gated,
        BACKEND,
        device=device,
        max_transient_bytes=cap,
    )
    load_nvfp4_experts(layer, tensors)
    peak = _prep_peak(layer, device)
    assert 0 < peak <= cap, f"{peak / MIB:.1f} MiB > {cap / MIB:.0f} MiB"
    # ...and it produced the right bytes, not only a small peak.
    want = whole_tensor_preparation(tensors, preset.is_gated)
    kernel = layer.quant_method.experts.prepared
    for key in ("w1_alpha", "w2_alpha"):
        assert torch.equal(getattr(kernel, key).cpu(), want.pop(key)), key
    for name, expected in want.items():
        got = getattr(layer, name).detach().cpu().contiguous()
        assert torch.equal(bytes_of(got), bytes_of(expected)), name

    # Control: the legacy pipeline on the same layer needs a full copy of w13
    # (288 MiB for Qwen3.6) and 4x-size float32 temporaries of the scales.
    legacy = {k: v.clone() for k, v in tensors.items()}
    peaks = {}
    for name, step in legacy_preparation_steps(legacy, gated=preset.is_gated):
        with measure_peak_memory(device) as mem:
            step()
        peaks[name] = mem.peak_bytes
    w13_scale_bytes = tensors["w13_weight_scale"].numel()
    if preset.is_gated:
        assert peaks["reorder"] >= tensors["w13_weight"].numel() + w13_scale_bytes
    assert peaks["fold"] >= 4 * w13_scale_bytes
    assert max(peaks.values()) > 4 * cap
