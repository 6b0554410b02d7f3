# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer b12x NVFP4 MoE experts through vLLM's modular-kernel interface:
the kernel (SM120/SM121 only) and its CPU emulation.

The experts are built and called as vLLM's NVFP4 oracle and modular kernel
build and call them (``FlashInferB12xExperts(moe_config, quant_config)``,
``process_weights_after_loading(layer)``, ``apply`` with the kernel's 15
arguments: flashinfer_b12x_utils.apply_experts), on a layer holding the
checkpoint's tensors. Every case runs on both backends:
``flashinfer_b12x`` is skipped, with the reason, where the kernel cannot run;
the emulation, which shares every line of the weight preparation, runs
everywhere. The reference is moe_reference.py's pure-torch MoE: upstream's
``torch_moe`` builds vLLM's activation ops, which need a ``VllmConfig``, and
on a CPU machine that needs triton-cpu.
"""

import pytest
import torch

from tests.kernels.moe import moe_reference
from tests.kernels.moe.flashinfer_b12x_utils import (
    NVFP4ExpertsLayer,
    apply_experts,
    b12x_quant_config,
    bf16_experts,
    dequantized_experts,
    quantize_experts_modelopt,
)
from tests.kernels.moe.moe_reference import rel_rms_error, torch_topk
from tests.kernels.moe.utils import make_dummy_moe_config
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
    flashinfer_w4a16_prepared_call,
    is_flashinfer_b12x_moe_available,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_emulated import (
    FlashInferB12xEmulatedExperts,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    unswizzle_blockscale,
)

_B12X = is_flashinfer_b12x_moe_available()
BACKENDS = [
    pytest.param(
        FlashInferB12xExperts,
        marks=pytest.mark.skipif(
            not _B12X, reason=f"b12x kernel, SM120/SM121 only: {_B12X.reason}"
        ),
        id="flashinfer_b12x",
    ),
    pytest.param(FlashInferB12xEmulatedExperts, id="emulated"),
]
_W4A16 = flashinfer_w4a16_prepared_call() if _B12X else _B12X
W4A16_BACKENDS = [
    pytest.param(
        FlashInferB12xExperts,
        marks=pytest.mark.skipif(
            not _W4A16, reason=f"b12x W4A16 kernel, SM120/SM121 only: {_W4A16.reason}"
        ),
        id="flashinfer_b12x",
    ),
    pytest.param(FlashInferB12xEmulatedExperts, id="emulated"),
]

# (m tokens, n = intermediate size I, k = hidden size H), as upstream's test
MNK_FACTORS = [(2, 128, 256), (2, 256, 512), (16, 128, 256), (64, 256, 512)]
NUM_EXPERTS = [8, 16]
TOP_KS = [1, 2, 4]
W4A16_MNK = [(2, 128, 256), (16, 256, 512)]


def _mnk_ids(cases: list[tuple[int, int, int]]) -> list[str]:
    return ["m{}_n{}_k{}".format(*mnk) for mnk in cases]


# Tolerances, as relative RMS error ||out - ref|| / ||ref|| of the [m, k]
# output (derivations below; measured ranges over these cases in brackets).
#
# W4A4 vs the BF16 MoE on the UNQUANTIZED weights. One NVFP4 quantization of
# Gaussian-like data has an SQNR of ~19.6 dB (derived in
# test_nvfp4_format.test_sqnr_floor_on_random_data), a relative RMS error
# e ~ 0.105. FC1 multiplies two quantized operands (x, w1): sqrt(2) e ~ 0.15;
# the gated product carries the errors of gate and up: ~sqrt(2) * 0.15 ~ 0.21;
# FC2 adds the intermediate's and w2's quantization: sqrt(0.21^2 + 2 e^2)
# ~ 0.25. Tolerance 0.35 [0.20, 0.28].
W4A4_TOL = 0.35
# BF16-activation emulation vs the BF16 MoE on the DEQUANTIZED checkpoint
# weights. With the global scales kept as alphas (the default) the prepared
# weights decode to the checkpoint's exactly; what is left is rounding: the
# reference's BF16 weights (e2m1 * block scale * scale_2 rounded to 8
# significant bits, relative error <= 2^-9, RMS ~2^-9 / sqrt(3) ~ 0.0011 per
# weight, ~0.0016 through two GEMMs) and the BF16 intermediate and output
# (<= 2^-9 each, where the two sides round differently). Tolerance 0.01.
BF16_ACTIVATIONS_TOL = 0.01
# W4A16 vs the BF16 MoE on the checkpoint's exact dequantized weights: the
# packed layout decodes to the checkpoint's weights exactly (the factor 2^x
# and 2^119 / 2^x cancel; no scale of real-magnitude weights is flushed), so
# only BF16 rounding is left, as for BF16_ACTIVATIONS_TOL.
W4A16_TOL = BF16_ACTIVATIONS_TOL
# Negative controls (gate and up swapped) must miss the tolerance by these
# factors. Swapping turns silu(gate) * up into silu(up) * gate: for unit-
# variance pre-activations the outputs differ by 0.58-0.99 relative RMS here:
# 1.7-2.8x the W4A4 tolerance (the W4A4 error itself is a quarter of the
# signal), and far beyond the BF16-activation tolerance, the tight check.
W4A4_CONTROL_MARGIN = 1.5
BF16_ACTIVATIONS_CONTROL_MARGIN = 20.0


def _swap_halves(w1: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> [up; gate] (or the two halves of I rows) on a new tensor."""
    half = w1.shape[1] // 2
    return torch.cat([w1[:, half:], w1[:, :half]], dim=1)


def _config(e, topk, k, n, activation):
    def make(act):
        return make_dummy_moe_config(
            num_experts=e,
            experts_per_token=topk,
            hidden_dim=k,
            intermediate_size=n,
            activation=act,
        )

    try:
        return make(activation)
    except NotImplementedError:
        # FusedMoEConfig refuses a non-gated activation off CUDA, XPU and
        # ROCm, where the FusedMoE layer cannot run one. The experts do not
        # depend on the platform: the config those build, the gated one with
        # the layer's activation (nothing else in it depends on it).
        config = make(MoEActivation.SILU)
        config.activation = activation
        return config


def _prepared(cls, tensors, e, topk, k, n, activation, device, **kwargs):
    """(layer, experts): the experts built from the oracle's quant config and
    prepared on the layer of the checkpoint's ``tensors``."""
    layer = NVFP4ExpertsLayer(tensors, activation).to(device)
    weight_only = kwargs.pop("weight_only", False)
    experts = cls(
        _config(e, topk, k, n, activation),
        b12x_quant_config(layer, weight_only),
        **kwargs,
    )
    experts.process_weights_after_loading(layer)
    return layer, experts


def _run(experts, layer, x, logits, topk, activation):
    weights, ids = torch_topk(logits, topk, renormalize=True)
    device = layer.w13_weight.device
    out = apply_experts(
        experts,
        layer,
        x.to(device),
        weights.to(device),
        ids.to(device),
        activation,
        global_num_experts=logits.shape[1],
    )
    return out.cpu()


def _device(cls) -> str:
    return "cuda" if cls is FlashInferB12xExperts else "cpu"


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize("topk", TOP_KS, ids=lambda v: f"top{v}")
@pytest.mark.parametrize("e", NUM_EXPERTS, ids=lambda v: f"E{v}")
@pytest.mark.parametrize("m,n,k", MNK_FACTORS, ids=_mnk_ids(MNK_FACTORS))
def test_flashinfer_b12x_moe(m, n, k, e, topk, cls):
    torch.manual_seed(7)
    silu = MoEActivation.SILU
    w1, w2 = bf16_experts(e, n, k, gated=True, seed=m * 1000 + e * 10 + topk)
    x = torch.randn(m, k).bfloat16()  # unit variance, not damped
    logits = torch.randn(m, e)

    # What the kernel must end up holding: the production reorder applied to a
    # CLONE of the BF16 [gate; up] weights, then quantized. The original must
    # be untouched: the reference below uses it again.
    w1_before = w1.clone()
    w3w1 = w1.clone()
    reorder_w1w3_to_w3w1(w3w1, torch.zeros(e, 2 * n, 1), dim=-2)
    assert torch.equal(w1, w1_before)
    assert torch.equal(w3w1, _swap_halves(w1))
    expected = quantize_experts_modelopt(_swap_halves(w1), w2, gated=True)

    tensors = quantize_experts_modelopt(w1, w2, gated=True)
    layer, experts = _prepared(cls, tensors, e, topk, k, n, silu, _device(cls))
    # b12x quantizes the FC2 input dynamically: a static scale of exactly 1.
    fc2 = experts.prepared.fc2_input_scale
    assert fc2.shape == (e,) and fc2.dtype == torch.float32
    assert torch.equal(fc2.cpu(), torch.ones(e))

    # The prepared layout, byte for byte: [w3; w1] codes, swizzled scales
    # that unswizzle to the checkpoint's block scales in the expected order
    # (untouched: the global scales are the kernel's alphas).
    assert torch.equal(layer.w13_weight.cpu(), expected["w13_weight"])
    assert torch.equal(layer.w2_weight.cpu(), expected["w2_weight"])
    for name, rows, cols in (("w13", 2 * n, k // 16), ("w2", k, n // 16)):
        got = unswizzle_blockscale(
            getattr(layer, f"{name}_weight_scale").cpu(), rows, cols
        )
        want = expected[f"{name}_weight_scale"]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    # The quant config holds the layer's parameters; the kernel's alphas are
    # the gate's global scale and w2's (gate and up share one here).
    assert experts.quant_config.w1_scale is layer.w13_weight_scale
    assert experts.w1_sf_mma.data_ptr() == layer.w13_weight_scale.data_ptr()
    s13 = expected["w13_weight_scale_2"]
    assert torch.equal(experts.prepared.w1_alpha.cpu(), s13[:, 0])
    assert torch.equal(experts.prepared.w2_alpha.cpu(), expected["w2_weight_scale_2"])

    out = _run(experts, layer, x, logits, topk, silu)
    assert out.shape == (m, k) and out.dtype == torch.bfloat16
    ref = moe_reference.torch_moe(x, w1, w2, logits, topk, renormalize=True)
    ref_swapped = moe_reference.torch_moe(
        x, _swap_halves(w1), w2, logits, topk, renormalize=True
    )
    err = rel_rms_error(out, ref)
    assert err < W4A4_TOL, f"W4A4 vs BF16 reference: {err:.3f}"
    control = rel_rms_error(out, ref_swapped)
    assert control > W4A4_CONTROL_MARGIN * W4A4_TOL, f"gate/up swapped: {control:.3f}"

    if cls is FlashInferB12xEmulatedExperts:
        # BF16 activations: a tight comparison with the dequantized weights.
        wo_layer, wo = _prepared(
            cls, tensors, e, topk, k, n, silu, "cpu", bf16_activations=True
        )
        out_wo = _run(wo, wo_layer, x, logits, topk, silu)
        dw1, dw2 = dequantized_experts(tensors, gated=True)
        ref_q = moe_reference.torch_moe(x, dw1, dw2, logits, topk, renormalize=True)
        ref_q_swapped = moe_reference.torch_moe(
            x, _swap_halves(dw1), dw2, logits, topk, True
        )
        err = rel_rms_error(out_wo, ref_q)
        assert err < BF16_ACTIVATIONS_TOL, f"BF16 activations vs dequantized: {err:.3f}"
        control = rel_rms_error(out_wo, ref_q_swapped)
        assert control > BF16_ACTIVATIONS_CONTROL_MARGIN * BF16_ACTIVATIONS_TOL, control


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize("topk", TOP_KS, ids=lambda v: f"top{v}")
@pytest.mark.parametrize("e", NUM_EXPERTS, ids=lambda v: f"E{v}")
@pytest.mark.parametrize("m,n,k", MNK_FACTORS, ids=_mnk_ids(MNK_FACTORS))
def test_flashinfer_b12x_moe_relu2(m, n, k, e, topk, cls):
    # Non-gated experts: w1 is [e, n, k], nothing to reorder. The same 24
    # cases as the gated test.
    relu2 = MoEActivation.RELU2_NO_MUL
    seed = m * 1000 + e * 10 + topk
    w1, w2 = bf16_experts(e, n, k, gated=False, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).bfloat16()
    logits = torch.randn(m, e, generator=gen)
    tensors = quantize_experts_modelopt(w1, w2, gated=False)
    layer, experts = _prepared(cls, tensors, e, topk, k, n, relu2, _device(cls))
    assert torch.equal(layer.w13_weight.cpu(), tensors["w13_weight"])
    out = _run(experts, layer, x, logits, topk, relu2)
    ref = moe_reference.torch_moe(x, w1, w2, logits, topk, True, activation="relu2")
    err = rel_rms_error(out, ref)
    assert err < W4A4_TOL, f"W4A4 vs BF16 reference: {err:.3f}"
    # Control: had the preparation swapped the halves of the I rows (a reorder
    # applied to non-gated experts), FC1's channels would no longer match w2's.
    wrong = moe_reference.torch_moe(
        x, _swap_halves(w1), w2, logits, topk, True, "relu2"
    )
    control = rel_rms_error(out, wrong)
    assert control > W4A4_CONTROL_MARGIN * W4A4_TOL, f"halves swapped: {control:.3f}"
    if cls is FlashInferB12xEmulatedExperts:
        wo_layer, wo = _prepared(
            cls, tensors, e, topk, k, n, relu2, "cpu", bf16_activations=True
        )
        out_wo = _run(wo, wo_layer, x, logits, topk, relu2)
        dw1, dw2 = dequantized_experts(tensors, gated=False)
        ref_q = moe_reference.torch_moe(x, dw1, dw2, logits, topk, True, "relu2")
        err = rel_rms_error(out_wo, ref_q)
        assert err < BF16_ACTIVATIONS_TOL, f"BF16 activations vs dequantized: {err:.3f}"
        ref_q_wrong = moe_reference.torch_moe(
            x, _swap_halves(dw1), dw2, logits, topk, True, "relu2"
        )
        control = rel_rms_error(out_wo, ref_q_wrong)
        assert control > BF16_ACTIVATIONS_CONTROL_MARGIN * BF16_ACTIVATIONS_TOL, control


@pytest.mark.parametrize("cls", W4A16_BACKENDS)
@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
@pytest.mark.parametrize("e,topk", [(8, 2), (16, 4)], ids=["E8_top2", "E16_top4"])
@pytest.mark.parametrize("m,n,k", W4A16_MNK, ids=_mnk_ids(W4A16_MNK))
def test_flashinfer_b12x_w4a16_moe(m, n, k, e, topk, gated, cls):
    # W4A16 (weight-only NVFP4, BF16 activations): the same class, selected by
    # the oracle's W4A16 quant config, in FlashInfer's packed layout.
    act = MoEActivation.SILU if gated else MoEActivation.RELU2_NO_MUL
    seed = m * 1000 + e * 10 + topk
    w1, w2 = bf16_experts(e, n, k, gated=gated, seed=seed)
    # Real checkpoint magnitudes (std 0.02), unit-variance FC outputs anyway
    # (the activations are scaled up instead of the weights down).
    w1, w2 = w1.float() * 0.02 * k**0.5, w2.float() * 0.02 * n**0.5
    tensors = quantize_experts_modelopt(w1, w2, gated=gated)
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, k, generator=gen) / (0.02 * k**0.5)).bfloat16()
    logits = torch.randn(m, e, generator=gen)
    layer, experts = _prepared(
        cls, tensors, e, topk, k, n, act, _device(cls), weight_only=True
    )
    assert experts.weight_only and experts.prepared.w13.dtype == torch.int32
    out = _run(experts, layer, x, logits, topk, act)
    assert out.shape == (m, k) and out.dtype == torch.bfloat16
    name = "silu" if gated else "relu2"
    dw1, dw2 = dequantized_experts(tensors, gated=gated)
    ref = moe_reference.torch_moe(x, dw1, dw2, logits, topk, True, name)
    err = rel_rms_error(out, ref)
    assert err < W4A16_TOL, f"W4A16 vs dequantized: {err:.4f}"
    wrong = moe_reference.torch_moe(x, _swap_halves(dw1), dw2, logits, topk, True, name)
    control = rel_rms_error(out, wrong)
    assert control > BF16_ACTIVATIONS_CONTROL_MARGIN * W4A16_TOL, control


@pytest.mark.parametrize("cls", [FlashInferB12xExperts, FlashInferB12xEmulatedExperts])
def test_experts_take_upstreams_arguments_and_refuse_before_preparation(cls):
    silu = MoEActivation.SILU
    e, n, k = 8, 128, 256
    w1, w2 = bf16_experts(e, n, k, gated=True, seed=3)
    layer = NVFP4ExpertsLayer(quantize_experts_modelopt(w1, w2, gated=True), silu)
    moe, qc = _config(e, 2, k, n, silu), b12x_quant_config(layer, False)
    experts = cls(moe_config=moe, quant_config=qc)
    assert experts.moe_config is moe and experts.quant_config is qc
    assert experts.w1_sf_mma is None and experts.w2_sf_mma is None
    assert experts.expects_unquantized_inputs
    assert experts.workspace_shapes(4, 2 * n, k, 2, e, e, None, silu)[2] == (4, k)
    x = torch.zeros(2, k, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="before process_weights_after_loading"):
        _run(experts, layer, x, torch.zeros(2, e), 2, silu)
