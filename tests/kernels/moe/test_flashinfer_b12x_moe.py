# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer b12x NVFP4 MoE: the kernel (SM12x only) and its CPU emulation.

Every case runs on both backends: ``flashinfer_b12x`` is skipped, with the
reason, where the kernel cannot run (no SM120/121 GPU here); the emulation,
which shares every line of the weight preparation, runs everywhere.
"""

import pytest
import torch

from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    rel_rms_error,
)
from vllm.benchmarks.legacy_moe_prep import split_cat_halves
from vllm.model_executor.layers.fused_moe import (
    FusedMoEQuantConfig,
    MoEActivation,
    fused_experts,
    fused_moe,
    fused_topk,
)
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts import (
    FlashInferB12xEmulatedExperts,
    FlashInferB12xExperts,
    FlashInferB12xW4A16Experts,
    is_flashinfer_b12x_moe_available,
)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    unswizzle_blockscale,
)

_B12X = is_flashinfer_b12x_moe_available()
BACKENDS = [
    pytest.param(
        "flashinfer_b12x",
        marks=pytest.mark.skipif(not _B12X, reason=f"b12x kernel: {_B12X.reason}"),
    ),
    "flashinfer_b12x_emulated",
]

# (m tokens, n = intermediate size I, k = hidden size H)
MNK = [(2, 128, 256), (2, 256, 512), (16, 128, 256), (64, 256, 512)]
NUM_EXPERTS = [8, 16]
TOP_KS = [1, 2, 4]

# Tolerances, as relative RMS error ||out - ref|| / ||ref|| of the [m, k]
# output (derivations below; measured ranges over these cases in brackets).
#
# W4A4 vs the BF16 MoE on the UNQUANTIZED weights. One NVFP4 quantization of
# Gaussian-like data has an SQNR of ~19.6 dB (derived in
# test_nvfp4_utils.test_sqnr_floor_on_random_data), a relative RMS error
# e ~ 0.105. FC1 multiplies two quantized operands (x, w1): sqrt(2) e ~ 0.15;
# the gated product carries the errors of gate and up: ~sqrt(2) * 0.15 ~ 0.21;
# FC2 adds the intermediate's and w2's quantization: sqrt(0.21^2 + 2 e^2)
# ~ 0.25. Tolerance 0.35 [0.20, 0.28].
W4A4_TOL = 0.35
# Weights-only emulation vs the BF16 MoE on the DEQUANTIZED checkpoint
# weights. With the global scales kept as alphas (the default) the prepared
# weights decode to the checkpoint's exactly; what is left is rounding: the
# reference's BF16 weights (e2m1 * block scale * scale_2 rounded to 8
# significant bits, relative error <= 2^-9, RMS ~2^-9 / sqrt(3) ~ 0.0011 per
# weight, ~0.0016 through two GEMMs) and the BF16 intermediate and output
# (<= 2^-9 each, where the two sides round differently). Tolerance 0.01.
WEIGHTS_ONLY_TOL = 0.01
# Negative controls (gate and up swapped) must miss the tolerance by these
# factors. Swapping turns silu(gate) * up into silu(up) * gate: for unit-
# variance pre-activations the outputs differ by 0.58-0.99 relative RMS here:
# 1.7-2.8x the W4A4 tolerance (the W4A4 error itself is a quarter of the
# signal), and far beyond the weights-only tolerance, the tight check.
W4A4_CONTROL_MARGIN = 1.5
WEIGHTS_ONLY_CONTROL_MARGIN = 20.0


def _swap_gate_up(w1: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> [up; gate] on a new tensor (split + cat, not the reorder)."""
    return split_cat_halves(w1, dim=1)


def _prepared_layer(tensors, e, topk, k, n, gated, backend, **kwargs):
    layer = make_nvfp4_layer(e, topk, k, n, gated, backend, **kwargs)
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", TOP_KS)
@pytest.mark.parametrize("e", NUM_EXPERTS)
@pytest.mark.parametrize("m,n,k", MNK, ids=lambda v: str(v))
def test_flashinfer_b12x_moe(m, n, k, e, topk, backend):
    torch.manual_seed(7)
    device = "cuda" if backend == "flashinfer_b12x" else "cpu"
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
    assert torch.equal(w3w1, _swap_gate_up(w1))
    expected = quantize_experts_modelopt(_swap_gate_up(w1), w2, gated=True)

    tensors = quantize_experts_modelopt(w1, w2, gated=True)
    layer = _prepared_layer(tensors, e, topk, k, n, True, backend)
    experts = layer.quant_method.experts
    fc2 = experts._fc2_input_scale
    assert fc2 is not None
    assert fc2.shape == (e,) and fc2.dtype == torch.float32
    assert fc2.device == layer.w13_weight.device
    # b12x quantizes the FC2 input dynamically: a static scale of exactly 1.
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
    qc = experts.quant_config
    assert torch.equal(qc.g1_alphas.cpu(), expected["w13_weight_scale_2"][:, 0])
    assert torch.equal(qc.g2_alphas.cpu(), expected["w2_weight_scale_2"])

    out = layer(x.to(device), logits.to(device)).cpu()
    assert out.shape == (m, k) and out.dtype == torch.bfloat16

    ref = fused_moe(x, w1, w2, logits, topk, renormalize=True)
    ref_swapped = fused_moe(x, _swap_gate_up(w1), w2, logits, topk, renormalize=True)
    err = rel_rms_error(out, ref)
    assert err < W4A4_TOL, f"W4A4 vs BF16 reference: {err:.3f}"
    control = rel_rms_error(out, ref_swapped)
    assert control > W4A4_CONTROL_MARGIN * W4A4_TOL, f"gate/up swapped: {control:.3f}"

    if backend == "flashinfer_b12x_emulated":
        # Weights-only: a tight comparison with the dequantized weights.
        wo = _prepared_layer(tensors, e, topk, k, n, True, backend, weights_only=True)
        out_wo = wo(x, logits)
        dw1, dw2 = dequantized_experts(tensors, gated=True)
        ref_q = fused_moe(x, dw1, dw2, logits, topk, renormalize=True)
        ref_q_swapped = fused_moe(x, _swap_gate_up(dw1), dw2, logits, topk, True)
        err = rel_rms_error(out_wo, ref_q)
        assert err < WEIGHTS_ONLY_TOL, f"weights-only vs dequantized: {err:.3f}"
        control = rel_rms_error(out_wo, ref_q_swapped)
        assert control > WEIGHTS_ONLY_CONTROL_MARGIN * WEIGHTS_ONLY_TOL, control


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk", TOP_KS)
@pytest.mark.parametrize("e", NUM_EXPERTS)
@pytest.mark.parametrize("m,n,k", MNK, ids=lambda v: str(v))
def test_flashinfer_b12x_moe_relu2(m, n, k, e, topk, backend):
    # Non-gated experts: w1 is [e, n, k], nothing to reorder. The same 24
    # cases as the gated test (and as upstream).
    device = "cuda" if backend == "flashinfer_b12x" else "cpu"
    seed = m * 1000 + e * 10 + topk
    w1, w2 = bf16_experts(e, n, k, gated=False, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).bfloat16()
    logits = torch.randn(m, e, generator=gen)
    tensors = quantize_experts_modelopt(w1, w2, gated=False)
    layer = _prepared_layer(tensors, e, topk, k, n, False, backend)
    assert layer.activation is MoEActivation.RELU2_NO_MUL
    assert torch.equal(layer.w13_weight.cpu(), tensors["w13_weight"])
    out = layer(x.to(device), logits.to(device)).cpu()
    ref = fused_moe(
        x, w1, w2, logits, topk, True, activation=MoEActivation.RELU2_NO_MUL
    )
    err = rel_rms_error(out, ref)
    assert err < W4A4_TOL, f"W4A4 vs BF16 reference: {err:.3f}"
    # Control: had the preparation swapped the halves of the I rows (a reorder
    # applied to non-gated experts), FC1's channels would no longer match w2's.
    wrong = fused_moe(x, _swap_gate_up(w1), w2, logits, topk, True, "relu2")
    control = rel_rms_error(out, wrong)
    assert control > W4A4_CONTROL_MARGIN * W4A4_TOL, f"halves swapped: {control:.3f}"
    if backend == "flashinfer_b12x_emulated":
        wo = _prepared_layer(tensors, e, topk, k, n, False, backend, weights_only=True)
        out_wo = wo(x, logits)
        dw1, dw2 = dequantized_experts(tensors, gated=False)
        ref_q = fused_moe(x, dw1, dw2, logits, topk, True, "relu2")
        err = rel_rms_error(out_wo, ref_q)
        assert err < WEIGHTS_ONLY_TOL, f"weights-only vs dequantized: {err:.3f}"
        ref_q_wrong = fused_moe(x, _swap_gate_up(dw1), dw2, logits, topk, True,
                                "relu2")  # fmt: skip
        control = rel_rms_error(out_wo, ref_q_wrong)
        assert control > WEIGHTS_ONLY_CONTROL_MARGIN * WEIGHTS_ONLY_TOL, control


def test_experts_take_upstreams_keyword_names():
    moe = FusedMoEConfig(8, 2, 256, 128, MoEActivation.SILU)
    qc = FusedMoEQuantConfig()
    for cls in (FlashInferB12xExperts, FlashInferB12xEmulatedExperts):
        experts = cls(moe_config=moe, quant_config=qc)
        assert experts.moe_config is moe and experts.quant_config is qc
        assert experts.w1_sf_mma is None and experts.w2_sf_mma is None


def test_create_weights_takes_upstreams_arguments():
    layer = make_nvfp4_layer(8, 2, 256, 128, True, "flashinfer_b12x_emulated")
    method = layer.quant_method
    target = torch.nn.Module()
    marker = object()
    method.create_weights(
        target,
        num_experts=8,
        hidden_size=256,
        intermediate_size_per_partition=128,
        params_dtype=torch.bfloat16,
        weight_loader=marker,
    )
    params = dict(target.named_parameters())
    assert params["w13_weight"].shape == (8, 256, 128)
    assert params["w2_weight_scale"].shape == (8, 256, 8)
    assert all(p.weight_loader is marker for p in params.values())
    # Sizes that disagree with the layer's FusedMoEConfig are refused.
    with pytest.raises(ValueError, match=r"\(8, 256, 64\).*\(8, 256, 128\)"):
        method.create_weights(torch.nn.Module(), 8, 256, 64, torch.bfloat16)


@pytest.mark.parametrize("config_has_fc2_scale", [True, False])
def test_fc2_input_scale_is_the_configs_own_tensor_filled_with_one(
    config_has_fc2_scale,
):
    # As upstream: when the quant config carries an FC2 input global scale,
    # the kernel gets that very tensor, set to 1 (b12x quantizes the FC2
    # input dynamically); otherwise a new [E] tensor of ones.
    e, n, k = 8, 128, 256
    w1, w2 = bf16_experts(e, n, k, gated=True, seed=3)
    tensors = quantize_experts_modelopt(w1, w2, gated=True)
    layer = make_nvfp4_layer(e, 2, k, n, True, "flashinfer_b12x_emulated")
    experts = layer.quant_method.experts
    given = torch.full((e,), 3.5) if config_has_fc2_scale else None
    experts.quant_config.a2_gscale = given
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    fc2 = experts._fc2_input_scale
    assert (fc2 is given) == config_has_fc2_scale
    assert torch.equal(fc2, torch.ones(e))
    # The quant config keeps the swizzled scales; the kernel's MMA views are
    # the experts' own.
    assert experts.quant_config.w1_scale is layer.w13_weight_scale
    assert experts.w1_sf_mma.data_ptr() == layer.w13_weight_scale.data_ptr()
    assert experts.w1_sf_mma.dim() == 6


def test_apply_refuses_before_fc2_input_scale_is_set():
    moe = FusedMoEConfig(8, 2, 256, 128, MoEActivation.SILU)
    experts = FlashInferB12xEmulatedExperts(moe, FusedMoEQuantConfig())
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="_fc2_input_scale is unset"):
        experts.apply(x, None, None, torch.ones(2, 2), ids)
    kernel_experts = FlashInferB12xExperts(moe, FusedMoEQuantConfig())
    with pytest.raises(RuntimeError, match="_fc2_input_scale is unset"):
        kernel_experts.apply(x, None, None, torch.ones(2, 2), ids)


def test_layer_refuses_before_preparation():
    layer = make_nvfp4_layer(8, 2, 256, 128, True, "flashinfer_b12x_emulated")
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 8))


@pytest.mark.skipif(bool(_B12X), reason="the b12x kernel can run here")
def test_kernel_backend_names_its_requirement():
    with pytest.raises(ValueError, match="flashinfer_b12x.*cannot run here"):
        make_nvfp4_layer(8, 2, 256, 128, True, "flashinfer_b12x")
    assert not is_flashinfer_b12x_moe_available()
    assert _B12X.reason


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown NVFP4 MoE backend"):
        make_nvfp4_layer(8, 2, 256, 128, True, "triton")


# --- routing, activations and the reference ------------------------------------


def test_fused_topk():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    x = torch.zeros(2, 8)
    weights, ids = fused_topk(x, logits, 2, renormalize=False)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [2, 3]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    weights, _ = fused_topk(x, logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights[0, 0] / weights[0, 1], torch.e * torch.ones(()))
    with pytest.raises(ValueError, match="topk must be in"):
        fused_topk(x, logits, 5, True)
    with pytest.raises(ValueError, match="gating_output must be"):
        fused_topk(x, logits[:1], 2, True)


def test_activations():
    gate = torch.tensor([[-2.0, 0.0, 1.0]])
    up = torch.tensor([[10.0, 20.0, 30.0]])
    out = MoEActivation.SILU.apply(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, gate * torch.sigmoid(gate) * up)
    # Control: the wrong order gives a different answer.
    assert not torch.allclose(out, up * torch.sigmoid(up) * gate)
    x = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0])
    assert MoEActivation.RELU2_NO_MUL.apply(x).tolist() == [0, 0, 0, 0.25, 9.0]
    assert MoEActivation.from_str("relu2") is MoEActivation.RELU2_NO_MUL
    assert MoEActivation.SILU.fc1_rows(64) == 128
    assert MoEActivation.RELU2_NO_MUL.fc1_rows(64) == 64
    with pytest.raises(ValueError, match="unknown MoE activation"):
        MoEActivation.from_str("gelu")


@pytest.mark.parametrize("activation", list(MoEActivation), ids=lambda a: a.value)
def test_reference_matches_naive_per_token_loop(activation):
    gen = torch.Generator().manual_seed(21)
    t, e, h, i, k = 5, 4, 32, 16, 2
    gated = activation.is_gated
    w1 = torch.randn(e, 2 * i if gated else i, h, generator=gen).bfloat16()
    w2 = torch.randn(e, h, i, generator=gen).bfloat16()
    x = torch.randn(t, h, generator=gen).bfloat16()
    weights, ids = fused_topk(x, torch.randn(t, e, generator=gen), k, True)
    out = fused_experts(x, w1, w2, weights, ids, activation)
    for tok in range(t):
        acc = torch.zeros(h)
        for slot in range(k):
            ex = ids[tok, slot].item()
            hmid = w1[ex].float() @ x[tok].float()
            if gated:
                hmid = torch.nn.functional.silu(hmid[:i]) * hmid[i:]
            else:
                hmid = torch.relu(hmid) ** 2
            hmid = hmid.bfloat16().float()
            acc += weights[tok, slot] * (w2[ex].float() @ hmid)
        torch.testing.assert_close(out[tok], acc.bfloat16(), rtol=1.6e-2, atol=1e-2)


def test_reference_rejects_inconsistent_shapes():
    w1 = torch.zeros(4, 10, 32)
    w2 = torch.zeros(4, 32, 8)
    with pytest.raises(ValueError, match="needs 16"):
        fused_experts(torch.zeros(2, 32), w1, w2, torch.ones(2, 1),
                      torch.zeros(2, 1, dtype=torch.int32))  # fmt: skip


@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
def test_weights_only_emulation_is_exact_when_the_fold_is_exact(gated):
    # With global scales of 1 the fold changes nothing, so the only difference
    # between the emulation (reading [w3; w1], swizzled MMA-layout scales) and
    # the BF16 reference on the dequantized checkpoint weights would be a
    # layout error: they must agree to the bit.
    e, n, k, topk = 8, 128, 256, 2
    w1, w2 = bf16_experts(e, n, k, gated=gated, seed=41)
    tensors = quantize_experts_modelopt(w1, w2, gated=gated)
    for name in ("w13_weight_scale_2", "w2_weight_scale_2"):
        tensors[name] = torch.ones_like(tensors[name])
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(16, k, generator=gen).bfloat16()
    logits = torch.randn(16, e, generator=gen)
    layer = _prepared_layer(tensors, e, topk, k, n, gated, "flashinfer_b12x_emulated",
                            weights_only=True)  # fmt: skip
    out = layer(x, logits)
    act = "silu" if gated else "relu2"
    dw1, dw2 = dequantized_experts(tensors, gated=gated)
    ref = fused_moe(x, dw1, dw2, logits, topk, True, act)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # Control: the same comparison with gate and up (or the two halves of the
    # I rows) swapped is nowhere near.
    wrong = fused_moe(x, _swap_gate_up(dw1), dw2, logits, topk, True, act)
    assert rel_rms_error(out, wrong) > 0.5


# --- W4A16: FlashInfer's packed layout, BF16 activations -------------------------

_W4A16_KERNEL = FlashInferB12xW4A16Experts.is_supported_device(
    torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
)
W4A16_BACKENDS = [
    pytest.param(
        "flashinfer_b12x",
        marks=pytest.mark.skipif(
            not _W4A16_KERNEL, reason=f"b12x W4A16 kernel: {_W4A16_KERNEL.reason}"
        ),
    ),
    "flashinfer_b12x_emulated",
]
# W4A16 vs the BF16 MoE on the checkpoint's exact dequantized weights: the
# packed layout decodes to the checkpoint's weights exactly (the factor 2^x
# and 2^119 / 2^x cancel; no scale of real-magnitude weights is flushed), so
# only BF16 rounding is left, as for WEIGHTS_ONLY_TOL above; the kernel adds
# its accumulation order (FP32). Negative control: gate and up swapped.
W4A16_TOL = WEIGHTS_ONLY_TOL


@pytest.mark.parametrize("backend", W4A16_BACKENDS)
@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
@pytest.mark.parametrize("e,topk", [(8, 2), (16, 4)])
@pytest.mark.parametrize("m,n,k", [(2, 128, 256), (16, 256, 512)], ids=str)
def test_flashinfer_b12x_w4a16_moe(m, n, k, e, topk, gated, backend):
    device = "cuda" if backend == "flashinfer_b12x" else "cpu"
    seed = m * 1000 + e * 10 + topk
    w1, w2 = bf16_experts(e, n, k, gated=gated, seed=seed)
    # Real checkpoint magnitudes (std 0.02), unit-variance FC outputs anyway
    # (the activations are scaled up instead of the weights down).
    w1, w2 = w1.float() * 0.02 * k**0.5, w2.float() * 0.02 * n**0.5
    tensors = quantize_experts_modelopt(w1, w2, gated=gated)
    gen = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(m, k, generator=gen) / (0.02 * k**0.5)).bfloat16()
    logits = torch.randn(m, e, generator=gen)
    layer = FusedMoE(
        num_experts=e, top_k=topk, hidden_size=k, intermediate_size=n,
        activation="silu" if gated else "relu2",
        quant_config=ModelOptNvFp4Config(quant_mode="w4a16"), moe_backend=backend,
        device=device, place_w3w1_at_load=False,
    )  # fmt: skip
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    experts = layer.quant_method.experts
    assert isinstance(experts, FlashInferB12xW4A16Experts)
    assert experts.packed_weights.w13.dtype == torch.int32
    out = layer(x.to(device), logits.to(device)).cpu()
    assert out.shape == (m, k) and out.dtype == torch.bfloat16
    act = "silu" if gated else "relu2"
    dw1, dw2 = dequantized_experts(tensors, gated=gated)
    ref = fused_moe(x, dw1, dw2, logits, topk, True, act)
    err = rel_rms_error(out, ref)
    assert err < W4A16_TOL, f"W4A16 vs dequantized: {err:.4f}"
    wrong = fused_moe(x, _swap_gate_up(dw1), dw2, logits, topk, True, act)
    control = rel_rms_error(out, wrong)
    assert control > WEIGHTS_ONLY_CONTROL_MARGIN * W4A16_TOL, control
