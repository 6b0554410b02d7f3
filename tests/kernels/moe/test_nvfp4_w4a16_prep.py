# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 preparation of a layer in place: the reference's bytes in the
layer's own parameters, in bounded memory (measured), resumable at any torch
call, reloadable; the layer takes the W4A16 config only where it holds."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe, torch_topk
from tests.kernels.moe.nvfp4_w4a16_utils import (
    LAYER_IDS,
    LAYERS,
    MiB,
    expected_packed,
    packed_bytes,
    prepare,
    rand_scale,
    router_inputs,
    w3w1,
    w4a16_layer,
    w4a16_tensors,
)
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    Interrupt,
    RaiseAtCall,
    _load_through_loader,
)
from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    load_nvfp4_experts,
    quantize_experts_modelopt,
    rel_rms_error,
)
from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_alpha,
    w4a16_dequantize,
    w4a16_global_scale,
    w4a16_scale_exponent,
)
from vllm.utils.mem_utils import measure_peak_memory


@pytest.mark.parametrize("place_w3w1", [True, False], ids=["w3w1", "w1w3"])
@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_layer_packed_weights_are_the_reference_in_the_parameters(shape, place_w3w1):
    e, h, i, gated = shape
    t = w4a16_tensors(e, h, i, gated, seed=1)
    layer = w4a16_layer(e, h, i, gated, place_w3w1=place_w3w1)
    _load_through_loader(layer, t)
    ptrs = {n: p.untyped_storage().data_ptr() for n, p in layer.named_parameters()}
    prepare(layer)
    pw = layer.quant_method.experts.prepared
    want = expected_packed(t, gated, i)
    for field, ref in want.items():
        got = getattr(pw, field)
        assert got.dtype == ref.dtype and got.shape == ref.shape, field
        assert torch.equal(bytes_of(got.contiguous()), bytes_of(ref)), field
    # w13 / w2 and their scales are the loaded parameters' own storage.
    for field, name in (
        ("w13", "w13_weight"),
        ("w2", "w2_weight"),
        ("w13_scale", "w13_weight_scale"),
        ("w2_scale", "w2_weight_scale"),
    ):
        assert getattr(pw, field).untyped_storage().data_ptr() == ptrs[name]
    assert layer.weight_prep_state.status is PrepStatus.PREPARED


@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_layer_runs_within_bf16_tolerance_of_the_dequantized_moe(shape):
    # Emulation vs the BF16 MoE on the checkpoint's exact dequantized
    # weights: rounding only (see test_flashinfer_b12x_moe.BF16_ACTIVATIONS_TOL).
    e, h, i, gated = shape
    t = w4a16_tensors(e, h, i, gated, seed=2)
    layer = w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, t)
    x, logits = router_inputs(12, h, e, seed=3)
    out = prepare(layer)(x, logits)
    act = "silu" if gated else "relu2"
    dw1, dw2 = dequantized_experts(t, gated)
    ref = torch_moe(x, dw1, dw2, logits, 2, True, act)
    assert rel_rms_error(out, ref) < 0.01
    # Input scales are not read: loading some changes nothing.
    t2 = dict(
        t,
        w13_input_scale=t["w13_input_scale"] * 7,
        w2_input_scale=t["w2_input_scale"] * 3,
    )
    other = w4a16_layer(e, h, i, gated)
    _load_through_loader(other, t2)
    assert torch.equal(prepare(other)(x, logits), out)


@pytest.mark.parametrize("i", [128, 96], ids=["I128_rotated", "I96_half_swap"])
def test_differing_gate_and_up_scales_go_to_fc2_alpha(i):
    # The layer places w13 as [w3; w1]: I = 128 is undone by the rotation,
    # I = 96 by the half swap, whose [E, 2] global scales must swap too.
    e, h = 4, 256
    w1, w2 = bf16_experts(e, i, h, gated=True, seed=4)
    t = quantize_experts_modelopt(
        w1.float() * 0.02 * h**0.5,
        w2.float() * 0.02 * i**0.5,
        True,
        shared_w13_scale=False,
    )
    s13 = t["w13_weight_scale_2"]
    assert not torch.equal(s13[:, 0], s13[:, 1])
    layer = w4a16_layer(e, h, i, True)
    _load_through_loader(layer, t)
    prepare(layer)
    gen = torch.Generator().manual_seed(5)
    x, logits = (
        torch.randn(16, h, generator=gen).bfloat16(),
        torch.randn(16, e, generator=gen),
    )
    dw1, dw2 = dequantized_experts(t, True)
    ref = torch_moe(x, dw1, dw2, logits, 2, True)
    assert rel_rms_error(layer(x, logits), ref) < 0.01
    # Control: with FC2's alpha left at s_w2 (the ratio dropped) the output
    # misses by the ratio.
    pw = layer.quant_method.experts.prepared
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    pw.w2_global_scale.copy_(w4a16_global_scale(t["w2_weight_scale_2"], x2))
    assert rel_rms_error(layer(x, logits), ref) > 0.05


def _shift_exponent(t, name, x):
    """``t`` with ``name``'s block scales divided by 2^x and its global
    scale multiplied by 2^x: the same weights, FlashInfer's exponent x
    larger (exact: every scale stays a normal E4M3 number)."""
    out = dict(t)
    s = t[f"{name}_weight_scale"].float()
    assert s[s > 0].min() / 2**x >= 2**-6
    out[f"{name}_weight_scale"] = (s / 2**x).to(torch.float8_e4m3fn)
    out[f"{name}_weight_scale_2"] = t[f"{name}_weight_scale_2"] * 2**x
    return out


@pytest.mark.parametrize("shifted", ["w13", "w2"])
def test_w13_and_w2_with_different_scale_exponents(shifted):
    # Each weight has its own power-of-two factor 2^x (the checkpoints of
    # the other tests share x = 0). Packing w2's scales with w13's x = 4
    # overflows FP16 (448 * 2^4 * 2^7 > 65504); its alpha with w13's x is
    # off by 2^4.
    e, h, i = 4, 256, 128
    t = _shift_exponent(w4a16_tensors(e, h, i, True, seed=8), shifted, 4)
    x13 = w4a16_scale_exponent(t["w13_weight_scale"])
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    assert (x13, x2) == ((4, 0) if shifted == "w13" else (0, 4))
    layer = w4a16_layer(e, h, i, True)
    _load_through_loader(layer, t)
    loaded = {n: bytes_of(p.detach()).clone() for n, p in layer.named_parameters()}
    x, logits = router_inputs(12, h, e, seed=9)
    out = prepare(layer)(x, logits)
    assert torch.isfinite(out.float()).all()
    dw1, dw2 = dequantized_experts(t, True)
    assert rel_rms_error(out, torch_moe(x, dw1, dw2, logits, 2, True)) < 0.01
    pw = layer.quant_method.experts.prepared
    want = w4a16_global_scale(t["w2_weight_scale_2"], x2)
    assert torch.equal(pw.w2_global_scale, want)
    # The restore unpacks each weight's scales with its own exponent too.
    layer.quant_method.restore_load_layout(layer)
    for n, p in layer.named_parameters():
        assert torch.equal(bytes_of(p.detach()), loaded[n]), n


def test_emulation_rounds_fc1_and_the_activation_to_bf16():
    # The kernel keeps FC1's output and the activation in BF16; the
    # emulation must too. The reference here, from the packed weights, does
    # both roundings; the control without FC1's rounding differs in most of
    # the 12 x 256 outputs, the emulation in almost none (op order only).
    e, h, i = 4, 256, 128
    t = w4a16_tensors(e, h, i, True, seed=10)
    layer = w4a16_layer(e, h, i, True)
    _load_through_loader(layer, t)
    x, logits = router_inputs(12, h, e, seed=11)
    out = prepare(layer)(x, logits)
    pw = layer.quant_method.experts.prepared
    weights, ids = torch_topk(logits, 2, renormalize=True)

    def reference(round_fc1: bool) -> torch.Tensor:
        a1, a2 = w4a16_alpha(pw.w13_global_scale), w4a16_alpha(pw.w2_global_scale)
        w13 = w4a16_dequantize(pw.w13, pw.w13_scale)  # [E, 2I, H], [gate; up]
        w2 = w4a16_dequantize(pw.w2, pw.w2_scale)  # [E, H, I]
        y = torch.zeros(12, h)
        for tok in range(12):
            for j in range(2):
                ex = int(ids[tok, j])
                fc1 = (x[tok].float() @ w13[ex].t()) * a1[ex]
                if round_fc1:
                    fc1 = fc1.bfloat16().float()
                gate, up = fc1[:i], fc1[i:]
                act = (torch.nn.functional.silu(gate) * up).bfloat16().float()
                y[tok] += (act @ w2[ex].t()) * (weights[tok, j] * a2[ex])
        return y.bfloat16()

    differ = (out != reference(True)).float().mean().item()
    control = (out != reference(False)).float().mean().item()
    assert differ < 0.05, differ
    assert control > 0.3, control


def test_prepared_twice_is_a_no_op_and_forward_refuses_before():
    e, h, i, gated = LAYERS[0]
    layer = w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, w4a16_tensors(e, h, i, gated, seed=6))
    x = torch.zeros(2, h, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(x, torch.zeros(2, e))
    before = packed_bytes(prepare(layer))
    with RaiseAtCall() as counter:
        prepare(layer)
    # No preparation step ran again: no torch op wrote into a parameter
    # (the conversion and the kernel's views are rebuilt: tiny tensors).
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    assert not counter.written & params, counter.names
    assert all(
        torch.equal(a, b)
        for a, b in zip(before.values(), packed_bytes(layer).values(), strict=True)
    )


@pytest.mark.parametrize(
    "shape", [(2, 128, 64, True), (2, 192, 96, True)], ids=["I64", "I96_halves"]
)
def test_interrupted_layer_preparation_resumes_to_the_same_bytes(shape):
    e, h, i, gated = shape
    t = w4a16_tensors(e, h, i, gated, seed=7)
    cap = 24 << 10  # several chunks per step

    def fresh():
        layer = w4a16_layer(e, h, i, gated, cap=cap)
        load_nvfp4_experts(layer, w3w1(t, i))  # the layer places [w3; w1]
        return layer

    want = packed_bytes(prepare(fresh()))
    layer = fresh()
    with RaiseAtCall() as counter:
        prepare(layer)
    # Every call of the smaller layer; every 5th (and the last ones) of the
    # one with the half swap (its calls are the same steps, more of them).
    step = 1 if i == 64 else 5
    for k in [*range(1, counter.calls + 1, step), counter.calls]:
        layer = fresh()
        with pytest.raises(Interrupt), RaiseAtCall(k):
            prepare(layer)
        prepare(layer)
        got = packed_bytes(layer)
        assert all(torch.equal(got[f], want[f]) for f in want), k


@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_reload_into_prepared_layer_equals_fresh_layer(shape):
    e, h, i, gated = shape
    old, new = (
        w4a16_tensors(e, h, i, gated, seed=8),
        w4a16_tensors(e, h, i, gated, seed=9),
    )
    cap = 64 << 10
    layer = w4a16_layer(e, h, i, gated, cap=cap)
    _load_through_loader(layer, old)
    prepare(layer)
    storages = {n: p.untyped_storage().data_ptr() for n, p in layer.named_parameters()}
    with measure_peak_memory("cpu") as mem:
        _load_through_loader(layer, new)
        prepare(layer)
    assert mem.peak_bytes <= cap
    for n, p in layer.named_parameters():
        assert p.untyped_storage().data_ptr() == storages[n], n
    fresh = w4a16_layer(e, h, i, gated, cap=cap)
    _load_through_loader(fresh, new)
    prepare(fresh)
    got, want = packed_bytes(layer), packed_bytes(fresh)
    assert all(torch.equal(got[f], want[f]) for f in want)


def test_restore_gives_the_loaded_bytes_back():
    e, h, i, gated = LAYERS[0]
    t = w4a16_tensors(e, h, i, gated, seed=10)
    layer = w4a16_layer(e, h, i, gated, cap=64 << 10)
    _load_through_loader(layer, t)
    loaded = {n: bytes_of(p.detach()).clone() for n, p in layer.named_parameters()}
    prepare(layer)
    layer.quant_method.restore_load_layout(layer)
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    assert layer.quant_method.experts.prepared is None
    for n, p in layer.named_parameters():
        # no scale of these checkpoint-magnitude weights is flushed
        assert torch.equal(bytes_of(p.detach()), loaded[n]), n


def test_qwen36_layer_peak_at_the_default_cap():
    # The Qwen3.6-35B-A3B layer (H = 2048, I = 512) with 2 of its 256
    # experts: the default cap chunks one expert at a time (1.5 MiB of planes
    # for the 1 MiB w13 expert, less for the others), so the peak does not
    # grow with E: at most 2 MiB (FlashInfer: 481 MiB public, 96.6 MiB in
    # place, for the whole layer).
    e, h, i = 2, 2048, 512
    layer = w4a16_layer(e, h, i, True)
    load_nvfp4_experts(layer, w4a16_tensors(e, h, i, True, seed=11, std=0.02))
    with measure_peak_memory("cpu") as mem:
        prepare(layer)
    assert mem.peak_bytes <= 2 * MiB, mem.peak_bytes


def test_deepseek_v3_expert_within_a_4_mib_cap():
    # DeepSeek-V3's routed expert (H = 7168, I = 2048): w13 is 14 MiB, w2
    # 7 MiB; under a 4 MiB cap every step goes strip by strip and through the
    # cycle-following, and gives the reference's bytes.
    e, h, i = 1, 7168, 2048
    gen = torch.Generator().manual_seed(12)
    t = {
        "w13_weight": torch.randint(
            0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=gen
        ),
        "w13_weight_scale": rand_scale(e, 2 * i, h, seed=13, top=0x7E),
        "w13_weight_scale_2": torch.full((e, 2), 2.0**-12),
        "w2_weight": torch.randint(
            0, 256, (e, h, i // 2), dtype=torch.uint8, generator=gen
        ),
        "w2_weight_scale": rand_scale(e, h, i, seed=14, top=0x7E),
        "w2_weight_scale_2": torch.full((e,), 2.0**-11),
    }
    layer = w4a16_layer(e, h, i, True, cap=4 * MiB, place_w3w1=False)
    load_nvfp4_experts(layer, t)
    with measure_peak_memory("cpu") as mem:
        prepare(layer)
    assert mem.peak_bytes <= 4 * MiB, mem.peak_bytes
    want = expected_packed(t, True, i)
    got = packed_bytes(layer)
    for field, ref in want.items():
        assert torch.equal(got[field], bytes_of(ref)), field


def test_w4a16_layer_takes_the_alpha_mode_only():
    # W4A4's experts options: "alpha" (what W4A16 does) is accepted, "fold"
    # refused with the reason; a geometry the layout cannot hold is named.
    w4a16_layer(2, 128, 64, True, cap=None)
    with pytest.raises(ValueError, match="global_scale_mode must be 'alpha'"):
        w4a16_layer(
            2, 128, 64, True, top_k=1, experts_kwargs={"global_scale_mode": "fold"}
        )
    with pytest.raises(
        ValueError, match="hidden size must be a positive multiple of 64"
    ):
        w4a16_layer(2, 96, 64, True, top_k=1)


@pytest.mark.parametrize(
    "name, index, shard",
    [
        ("w13_weight_scale_2", (1, 1), "w1"),  # loaded as [w3; w1]: column 1 is w1
        ("w2_weight_scale_2", (0,), "w2"),
    ],
)
def test_bad_global_scale_is_refused_before_any_write(name, index, shard):
    e, h, i, gated = LAYERS[0]
    layer = w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, w4a16_tensors(e, h, i, gated, seed=6))
    # Control: a W4A16 layer reads no input scales, so a bad one is ignored.
    control = w4a16_layer(e, h, i, gated)
    _load_through_loader(control, w4a16_tensors(e, h, i, gated, seed=6))
    control.w13_input_scale.data.fill_(float("nan"))
    prepare(control)
    getattr(layer, name).data[index] = float("nan")
    before = {n: bytes_of(p).clone() for n, p in layer.named_parameters()}
    with pytest.raises(
        ValueError,
        match=rf"{name} of expert {index[0]} \({shard}\) "
        "is nan",
    ):
        prepare(layer)
    for n, p in layer.named_parameters():
        assert torch.equal(bytes_of(p), before[n]), n


def test_the_w4a16_gate_adds_the_prepared_call_to_the_b12x_gate(monkeypatch):
    # On a b12x device the W4A16 mode is supported only where FlashInfer runs
    # prepared weights (no copying fallback); off one, the b12x reason.
    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe as m
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        Support,
    )
    from vllm.model_executor.layers.fused_moe.modular_kernel import (
        FusedMoEActivationFormat,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kNvfp4Dynamic,
        kNvfp4Static,
    )

    cls = m.FlashInferB12xExperts
    moe = w4a16_layer(2, 128, 64, True).moe_config

    def supported(activation_key):
        return cls.is_supported_config(
            cls, moe, kNvfp4Static, activation_key, FusedMoEActivationFormat.Standard
        )

    monkeypatch.setattr(cls, "_supports_current_device", staticmethod(lambda: True))
    monkeypatch.setattr(
        m, "flashinfer_w4a16_prepared_call", lambda: Support.no("no _prepared_weights")
    )
    assert supported(None) == (False, "no _prepared_weights")
    assert supported(kNvfp4Dynamic) == (True, None)  # W4A4 does not need it
    monkeypatch.setattr(m, "flashinfer_w4a16_prepared_call", Support.yes)
    assert supported(None) == (True, None)
    monkeypatch.setattr(cls, "_supports_current_device", staticmethod(lambda: False))
    monkeypatch.setattr(
        m, "is_flashinfer_b12x_moe_available", lambda: Support.no("not SM12x")
    )
    ok, reason = supported(None)
    assert not ok and reason.endswith("not SM12x")
