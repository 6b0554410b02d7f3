# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A4 at the checkpoint's calibrated activation scales, at a real layer's
size (E=8, H=2048, I=512) and magnitudes (expert weights std 0.005-0.05,
inputs std 0.03-2).

The producer's W4A4 function (``torch_moe`` with each GEMM input
NVFP4-quantized at its calibrated per-expert scale, as ModelOpt and
compressed-tensors define it: block scale ``e4m3(amax / (6 * scale))``,
codes ``e2m1(x / (block_scale * scale))``, the tree's ``quantize_nvfp4``) is
the target. The prepared layer
runs the b12x emulation, whose activation quantization is the kernel's
(``quantize_nvfp4_b12x_activation``). Errors are relative RMS against the
BF16-activation function of the same NVFP4 weights. Acceptance: the layer's
error is within 1.1x of the producer's own W4A4 error at every input
magnitude. Negative controls: the activation scales of 1 the kernel was
given before (FC2's input loses its block scales to FP8 subnormals and
zeros at small magnitudes), the quantization-direction FC2 scale upstream
passed before it filled it with 1 (every block scale underflows), and gate
and up swapped.
"""

import dataclasses
import types

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe, torch_topk
from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    rel_rms_error,
    split_cat_halves,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_b12x_w4a4_format import (
    quantize_nvfp4_b12x_activation,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    _b12x_activation_scales,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    FLOAT4_E2M1_MAX,
    FLOAT8_E4M3_MAX,
    dequantize_nvfp4,
    quantize_nvfp4,
)

E, H, I, TOPK, T = 8, 2048, 512, 2, 64  # noqa: E741
#: Calibration tokens (more than evaluated: the calibrated amax covers the
#: evaluation batch, as a real calibration set's does).
T_CAL = 256
INPUT_STDS = [0.03, 0.1, 0.3, 1.0, 2.0]
#: The layer's error may exceed the producer's own W4A4 error by at most
#: this factor [measured 0.99-1.02: the kernel's reciprocal order against the
#: producer's division moves a value on a rounding boundary, rarely].
ACCEPT = 1.1


def _layer_tensors(weight_std: float, seed: int):
    w1, w2 = bf16_experts(E, I, H, True, seed)
    # bf16_experts gives std 1/sqrt(K); rescale to the asked weight std.
    w1 = (w1.float() * (weight_std * H**0.5)).bfloat16()
    w2 = (w2.float() * (weight_std * I**0.5)).bfloat16()
    tensors = quantize_experts_modelopt(w1, w2, gated=True)
    dw1, dw2 = dequantized_experts(tensors, gated=True)
    return tensors, dw1, dw2


def _inputs(std: float, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, generator=gen) * std).bfloat16()
    return x, torch.randn(n, E, generator=gen)


def _calibrated_scales(dw1, dw2, x, logits):
    """Per-expert input scales (amax / (448 * 6)) of FC1 and FC2 on the
    calibration batch, as a calibrating quantizer records them."""
    weights, ids = torch_topk(logits, TOPK, renormalize=True)
    a1 = torch.zeros(E)
    a2 = torch.zeros(E)
    for e in range(E):
        tok = (ids == e).any(dim=1)
        if not tok.any():
            continue
        xe = x[tok].float()
        h = xe @ dw1[e].float().t()
        gate, up = h.chunk(2, dim=-1)
        mid = (torch.nn.functional.silu(gate) * up).bfloat16().float()
        a1[e], a2[e] = xe.abs().max(), mid.abs().max()
    scale = FLOAT8_E4M3_MAX * FLOAT4_E2M1_MAX
    return a1 / scale, a2 / scale


def _producer_w4a4(a1: torch.Tensor, a2: torch.Tensor):
    """The producer's activation quantization at per-expert input scales
    ``a1`` / ``a2`` [E] (dequantization direction), for ``torch_moe``."""

    def quant_inputs(a, expert, gemm):
        g = 1.0 / (a1 if gemm == 1 else a2)[expert]
        packed, block_scale = quantize_nvfp4(a, g)
        return dequantize_nvfp4(packed, block_scale, g)

    return quant_inputs


def _run(tensors, a1, a2, x, logits, mode="alpha"):
    layer = make_nvfp4_layer(
        E, TOPK, H, I, True, "flashinfer_b12x_emulated", global_scale_mode=mode
    )
    load_nvfp4_experts(
        layer,
        {
            **tensors,
            "w13_input_scale": a1.view(E, 1).expand(E, 2),
            "w2_input_scale": a2,
        },
    )
    layer.quant_method.process_weights_after_loading(layer)
    return layer, layer(x, logits)


@pytest.fixture(scope="module")
def experts():
    return _layer_tensors(0.02, seed=11)


@pytest.fixture(scope="module")
def case(experts):
    """Per input std: the calibrated scales, an evaluation batch, the BF16
    function and the producer's W4A4 function on it."""
    cache = {}

    def get(std):
        if std not in cache:
            _, dw1, dw2 = experts
            a1, a2 = _calibrated_scales(dw1, dw2, *_inputs(std, T_CAL, seed=1))
            x, logits = _inputs(std, T, seed=2)
            ref = torch_moe(x, dw1, dw2, logits, TOPK, True)
            producer = torch_moe(
                x, dw1, dw2, logits, TOPK, True, quant_inputs=_producer_w4a4(a1, a2)
            )
            cache[std] = a1, a2, x, logits, ref, producer
        return cache[std]

    return get


@pytest.mark.parametrize("std", INPUT_STDS)
def test_calibrated_scales_compute_the_producers_w4a4_function(experts, case, std):
    tensors, dw1, dw2 = experts
    a1, a2, x, logits, ref, producer = case(std)
    producer_err = rel_rms_error(producer, ref)
    layer, out = _run(tensors, a1, a2, x, logits)
    err = rel_rms_error(out, ref)
    assert err <= ACCEPT * producer_err, (err, producer_err)
    # Closer to the producer's function than that is to the BF16 one
    # [measured 0.035-0.053 against 0.163-0.165: the kernel's reciprocal
    # order moves about 2% of the block scales by one E4M3 step].
    assert rel_rms_error(out, producer) < 0.5 * producer_err
    # The kernel gets the calibrated scales per expert, in the
    # dequantization direction, and w2_alpha carries FC2's.
    kernel = layer.quant_method.experts.prepared
    torch.testing.assert_close(kernel.fc1_input_scale, a1, rtol=2**-23, atol=0)
    torch.testing.assert_close(kernel.fc2_input_scale, a2, rtol=2**-23, atol=0)
    if std >= 1.0:
        # Negative control: gate and up swapped. (Below, FC1's outputs are
        # so small that SiLU is linear and SiLU(gate) * up symmetric.)
        swapped = torch_moe(x, split_cat_halves(dw1, 1), dw2, logits, TOPK, True)
        assert rel_rms_error(out, swapped) > 3 * producer_err


@pytest.mark.parametrize("std", [0.03, 0.1])
def test_scales_of_one_miss_at_small_magnitudes(experts, case, std):
    # What the kernel was given before (and upstream gives it): FC1 and FC2
    # input scales of 1; FC2's inputs (SwiGLU outputs ~1e-4 here) get block
    # scales amax / 6 deep in FP8's subnormals, or 0.
    tensors = experts[0]
    _, _, x, logits, ref, producer = case(std)
    ones = torch.ones(E)
    _, out = _run(tensors, ones, ones, x, logits)
    assert rel_rms_error(out, ref) > 1.5 * rel_rms_error(producer, ref)


@pytest.mark.parametrize("std", [0.03, 0.3, 2.0])
def test_upstreams_calibrated_call_loses_fc2s_input(experts, case, std):
    # Upstream's call before its fill(1.0): fc2_input_scale = a2_gscale =
    # 1 / input_scale, the quantization direction, and w2_alpha without it.
    # The kernel reads the dequantization direction: the block scales
    # m / (6 * a2_gscale) underflow to 0 and FC2's input is lost (codes 0;
    # upstream's comment, "saturates at max FP4", describes a kernel that
    # multiplies by the scale).
    a1, a2, x, logits, ref, _ = case(std)
    layer, _ = _run(experts[0], a1, a2, x[:1], logits[:1])
    experts_ = layer.quant_method.experts
    t = experts_.prepared
    experts_.prepared = dataclasses.replace(
        t, fc2_input_scale=1.0 / a2, w2_alpha=t.w2_alpha / t.fc2_input_scale
    )
    assert rel_rms_error(layer(x, logits), ref) > 0.9


def test_fold_mode_keeps_upstreams_call(experts, case):
    # "fold": upstream's contract, bit for bit: no FC1 input scale (w1_alpha
    # = 1 serves as both), FC2 input scales of 1, both alphas 1.
    a1, a2, x, logits, _, _ = case(0.3)
    layer, _ = _run(experts[0], a1, a2, x[:8], logits[:8], mode="fold")
    kernel = layer.quant_method.experts.prepared
    assert kernel.fc1_input_scale is None
    for t in (kernel.fc2_input_scale, kernel.w1_alpha, kernel.w2_alpha):
        assert torch.equal(t, torch.ones(E))


def test_fc2s_input_is_the_bf16_activation_quantized_as_the_kernel_does(experts, case):
    # The kernel writes the activation to shared memory in BF16 (sC) and
    # quantizes that with fc2_input_scale. The reference, per route from the
    # checkpoint's codes and block scales and the kernel's alphas, in the
    # kernel's order of operations, uses the kernel's quantizer on the
    # BF16-rounded activation: the layer equals it; the control without the
    # rounding differs in most outputs (a code moves where a value sits near
    # an E2M1 boundary).
    tensors = experts[0]
    a1, a2, x, logits, _, _ = case(0.3)
    n = 8
    x, logits = x[:n], logits[:n]
    layer, out = _run(tensors, a1, a2, x, logits)
    k = layer.quant_method.experts.prepared
    w13 = dequantize_nvfp4(tensors["w13_weight"], tensors["w13_weight_scale"], 1.0)
    w2 = dequantize_nvfp4(tensors["w2_weight"], tensors["w2_weight_scale"], 1.0)
    weights, ids = torch_topk(logits, TOPK, renormalize=True)

    def operand(a, d):
        return dequantize_nvfp4(*quantize_nvfp4_b12x_activation(a, d), 1.0)

    def reference(round_act: bool) -> torch.Tensor:
        y = torch.zeros(n, H)
        for tok in range(n):
            for j in range(TOPK):
                e = int(ids[tok, j])
                d1, d2 = k.fc1_input_scale[e], k.fc2_input_scale[e]
                fc1 = (operand(x[tok : tok + 1], d1) @ w13[e].t()) * (
                    k.w1_alpha[e] * d1
                )
                gate, up = fc1.chunk(2, dim=-1)  # checkpoint order [w1; w3]
                act = torch.nn.functional.silu(gate) * up
                act = act.bfloat16() if round_act else act
                fc2 = (operand(act, d2) @ w2[e].t()) * k.w2_alpha[e]
                y[tok] += fc2[0] * weights[tok, j]
        return y.bfloat16()

    assert torch.equal(out, reference(True))
    control = (out != reference(False)).float().mean().item()
    assert control > 0.3, control  # [measured 0.92]


def _scale_layer(expert_map=None, enable_eplb=False):
    parallel = types.SimpleNamespace(enable_eplb=enable_eplb)
    moe = types.SimpleNamespace(moe_parallel_config=parallel)
    return types.SimpleNamespace(moe_config=moe, expert_map=expert_map)


def test_activation_scales_stay_per_expert():
    # [E, 2] FC1 scales (w1, w3): the larger per expert; FC2's as they are.
    a13 = torch.tensor([[1.0, 2.0], [4.0, 3.0], [0.5, 0.5]])
    a2 = torch.tensor([7.0, 8.0, 9.0])
    fc1, fc2 = _b12x_activation_scales(_scale_layer(), a13, a2, 3)
    assert torch.equal(fc1, torch.tensor([2.0, 4.0, 0.5]))
    assert torch.equal(fc2, a2)
    assert fc1.dtype == fc2.dtype == torch.float32


def test_activation_scales_for_all_experts_are_narrowed_by_the_expert_map():
    # Four global experts' scales on a rank holding experts 3 and 1, as local
    # 0 and 1.
    expert_map = torch.tensor([-1, 1, -1, 0], dtype=torch.int32)
    a13 = torch.tensor([[1.0, 1.0], [2.0, 2.5], [3.0, 3.0], [4.0, 3.5]])
    a2 = torch.tensor([10.0, 20.0, 30.0, 40.0])
    fc1, fc2 = _b12x_activation_scales(_scale_layer(expert_map), a13, a2, 2)
    assert torch.equal(fc1, torch.tensor([4.0, 2.5]))
    assert torch.equal(fc2, torch.tensor([40.0, 20.0]))


def test_activation_scales_of_another_size_are_refused():
    a13, a2 = torch.ones(5, 2), torch.ones(5)
    with pytest.raises(ValueError, match="w13_input_scale has 5 experts"):
        _b12x_activation_scales(_scale_layer(), a13, a2, 3)
    # An expert map that holds another number of experts than the layer.
    expert_map = torch.tensor([0, 1, 2, -1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match="expert map"):
        _b12x_activation_scales(_scale_layer(expert_map), a13, a2, 2)


def test_activation_scales_under_eplb_take_the_shared_max():
    # One max shared by all experts, all-reduced over the EP group upstream
    # (amax_for_moe_activation_quant); this tree has no EPLB and says so.
    with pytest.raises(NotImplementedError, match="load balancing"):
        _b12x_activation_scales(
            _scale_layer(enable_eplb=True), torch.ones(2, 2), torch.ones(2), 2
        )
