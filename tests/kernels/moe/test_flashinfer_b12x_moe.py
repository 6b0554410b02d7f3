# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's definitions in vLLM's tests/kernels/moe/test_flashinfer_b12x_moe.py."""

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.moe.utils import make_dummy_moe_config
from tests.kernels.quantization.nvfp4_utils import convert_swizzled_to_linear
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
    NvFp4MoeBackend,
    backend_to_kernel_cls,
    convert_to_nvfp4_moe_kernel_format,
    make_nvfp4_moe_kernel,
    make_nvfp4_moe_quant_config,
)
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # noqa: E501
    compressed_tensors_moe_w4a4_nvfp4 as ct_nvfp4_moe,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
    break_fp4_bytes,
    ref_nvfp4_quant,
    ref_nvfp4_quant_dequant,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kNvfp4Dynamic,
    kNvfp4Static,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed

# The kernel cases; the preparation cases run anywhere FlashInfer imports.
requires_b12x = pytest.mark.skipif(
    not current_platform.is_device_capability_family(120),
    reason="FlashInfer B12x MoE requires SM120 (RTX Pro 6000 / DGX Spark).",
)

# Dimensions chosen to satisfy FP4 alignment requirements (k multiple of 256,
# n multiple of 128) while keeping tests fast.
MNK_FACTORS = [
    (2, 128, 256),
    (2, 256, 512),
    (16, 128, 256),
    (64, 256, 512),
]


# A layer of real magnitudes on CPU: the b12x launch stood in by its arithmetic
# in torch (_TorchB12xMoEWrapper), the rest of the experts' path vLLM's own.
CPU_E = 8  # experts
CPU_TOPK = 2
CPU_M = 32  # tokens
CPU_I = 256  # intermediate size
CPU_H = 512  # hidden size

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """E2M1 values [N, K] -> codes uint8 [N, K/2], element 2i in the low nibble."""
    codes = torch.searchsorted(torch.tensor(E2M1), values.abs().contiguous())
    codes = (codes | (values < 0).long() << 3).to(torch.uint8)
    return codes[:, 0::2] | codes[:, 1::2] << 4


def _quantize_modelopt(w: torch.Tensor):
    """ModelOpt NVFP4 of [E, N, K]: codes [E, N, K/2], linear FP8 block scales
    [E, N, K/16] and the per-expert scale_2 = amax / (6 * 448)."""
    scale_2 = w.abs().amax(dim=(1, 2)).float() / (6 * 448)
    codes, scales = zip(
        *(ref_nvfp4_quant(x.float(), 1 / s, 16) for x, s in zip(w, scale_2))
    )
    return (
        torch.stack([_pack_fp4(c) for c in codes]),
        torch.stack(scales).to(torch.float8_e4m3fn),
        scale_2,
    )


def _decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Codes [N, K/2] and linear block scales [N, K/16] -> [N, K] float32."""
    n, k = codes.shape[0], codes.shape[1] * 2
    values = break_fp4_bytes(codes, torch.float32).view(n, k // 16, 16)
    return (values * scales.float().unsqueeze(-1)).view(n, k)


def _routed(x, topk_ids, topk_weights, expert_fn):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, expert_fn(e, x[rows]) * topk_weights[rows, slots, None])
    return out


class _TorchB12xMoEWrapper:
    """FlashInfer's B12xMoEWrapper (W4A4, gated SiLU) as its kernels compute, in
    torch: each routed row's input quantized to NVFP4 with the expert's
    ``input_global_scale`` as divisor (``w1_alpha`` without one), FC1 times
    ``w1_alpha * input_global_scale`` (``w1_alpha`` without), silu(gate) * up
    on the [up; gate] rows rounded to BF16, FC2's input quantized with
    ``fc2_input_scale``, FC2 times ``w2_alpha`` and the routing weight."""

    def __init__(self, num_experts, top_k, hidden_size, intermediate_size, **kw):
        assert kw.get("activation", "silu") == "silu"

    def run(
        self,
        x,
        w1_weight,
        w1_weight_sf,
        w2_weight,
        w2_weight_sf,
        token_selected_experts,
        token_final_scales,
        *,
        w1_alpha,
        w2_alpha,
        fc2_input_scale=None,
        input_global_scale=None,
    ):
        from flashinfer.cute_dsl.utils import convert_sf_from_mma_layout

        def linear_scales(w, sf):
            e, n, k = w.shape[0], w.shape[1], w.shape[2] * 2
            sf = convert_sf_from_mma_layout(sf, m=n, k=k, num_groups=e).view(e, -1)
            return [convert_swizzled_to_linear(s, n, k, 16) for s in sf]

        s1, s2 = (
            linear_scales(w1_weight, w1_weight_sf),
            linear_scales(w2_weight, w2_weight_sf),
        )
        gs1 = w1_alpha if input_global_scale is None else input_global_scale
        mul1 = w1_alpha if input_global_scale is None else w1_alpha * gs1
        i = w1_weight.shape[1] // 2

        def expert(e, rows):
            xq = ref_nvfp4_quant_dequant(rows.float(), 1 / gs1[e], 16) / gs1[e]
            up, gate = (xq @ _decode(w1_weight[e], s1[e]).T * mul1[e]).split(i, -1)
            h = (torch.nn.functional.silu(gate) * up).bfloat16().float()
            hq = ref_nvfp4_quant_dequant(h, 1 / fc2_input_scale[e], 16)
            return (
                hq / fc2_input_scale[e] @ _decode(w2_weight[e], s2[e]).T * w2_alpha[e]
            )

        ids = token_selected_experts.long()
        return _routed(x, ids, token_final_scales, expert).to(x.dtype)


def _checkpoint_layer():
    """A ModelOpt NVFP4 MoE checkpoint of real magnitudes (weight std 0.005 to
    0.04 across experts, activation scales from a calibration batch) and its
    function in a BF16 model: gate and up decoded with their scales, each
    expert's inputs quantized with its calibrated input scale."""
    set_random_seed(0)
    e, i, h = CPU_E, CPU_I, CPU_H
    std = torch.logspace(-2.3, -1.4, e).view(e, 1, 1)
    w13 = torch.randn(e, 2 * i, h) * std
    w2 = torch.randn(e, h, i) * std
    x_cal = torch.randn(4 * CPU_M, h) * torch.logspace(-1, 0.5, h)
    a13 = x_cal.abs().amax() * torch.linspace(0.7, 1.0, e) / (6 * 448)
    gate, up = (x_cal @ w13.transpose(1, 2)).split(i, -1)
    a2 = (torch.nn.functional.silu(gate) * up).abs().amax(dim=(1, 2)) / (6 * 448)
    (c13, s13, g13), (c2, s2, g2) = _quantize_modelopt(w13), _quantize_modelopt(w2)

    def function(x, topk_ids, topk_weights):
        def expert(e, rows):
            xq = ref_nvfp4_quant_dequant(rows.float(), 1 / a13[e], 16)
            gate, up = (xq @ _decode(c13[e], s13[e]).T * g13[e]).split(i, -1)
            h = (torch.nn.functional.silu(gate) * up).bfloat16().float()
            hq = ref_nvfp4_quant_dequant(h, 1 / a2[e], 16)
            return hq @ _decode(c2[e], s2[e]).T * g2[e]

        return _routed(x, topk_ids, topk_weights, expert)

    x = (torch.randn(CPU_M, h) * torch.logspace(-1, 0.5, h)).bfloat16()
    tensors = dict(
        w13=c13,
        w13_scale=s13,
        w13_scale_2=g13,
        a13_scale=a13,
        w2=c2,
        w2_scale=s2,
        w2_scale_2=g2,
        a2_scale=a2,
    )
    return tensors, function, x


def _prepare_b12x(t: dict, monkeypatch, use_a16: bool = False):
    """The checkpoint through vLLM's FLASHINFER_B12X path, as the ModelOpt and
    compressed-tensors MoE methods run it (load layout in, kernel out)."""
    monkeypatch.setattr(
        pytest.importorskip("flashinfer.fused_moe"),
        "B12xMoEWrapper",
        _TorchB12xMoEWrapper,
    )
    e = CPU_E
    moe_config = make_dummy_moe_config(
        num_experts=e,
        experts_per_token=CPU_TOPK,
        hidden_dim=CPU_H,
        intermediate_size=CPU_I,
    )
    layer = SimpleNamespace(activation=MoEActivation.SILU, moe_config=moe_config)
    w13, w13_scale, w13_scale_2, a13, w2, w2_scale, w2_scale_2, a2 = (
        convert_to_nvfp4_moe_kernel_format(
            NvFp4MoeBackend.FLASHINFER_B12X,
            layer,
            t["w13"].clone(),
            t["w13_scale"].clone(),
            t["w13_scale_2"].clone(),
            t["a13_scale"].unsqueeze(1).repeat(1, 2),
            t["w2"].clone(),
            t["w2_scale"].clone(),
            t["w2_scale_2"].clone(),
            t["a2_scale"].clone(),
            is_act_and_mul=True,
            use_a16=use_a16,
        )
    )
    quant_config = make_nvfp4_moe_quant_config(
        NvFp4MoeBackend.FLASHINFER_B12X,
        w13_scale,
        w2_scale,
        w13_scale_2,
        w2_scale_2,
        a13,
        a2,
        layer=layer,
        use_a16=use_a16,
    )
    # The experts class vLLM's backend oracle picks for the checkpoint.
    activation_key = None if use_a16 else kNvfp4Dynamic
    experts_cls = next(
        cls
        for cls in backend_to_kernel_cls(NvFp4MoeBackend.FLASHINFER_B12X)
        if cls._supports_quant_scheme(kNvfp4Static, activation_key)
    )
    kernel = make_nvfp4_moe_kernel(
        quant_config, moe_config, experts_cls, NvFp4MoeBackend.FLASHINFER_B12X
    )
    # The parameters as the quant method leaves them (replace_parameter).
    layer.w13_weight, layer.w13_weight_scale, layer.w13_weight_scale_2 = (
        w13,
        w13_scale,
        w13_scale_2,
    )
    layer.w2_weight, layer.w2_weight_scale, layer.w2_weight_scale_2 = (
        w2,
        w2_scale,
        w2_scale_2,
    )
    kernel.fused_experts.process_weights_after_loading(layer)
    return kernel, layer


def test_b12x_preparation_keeps_the_checkpoint_scales(monkeypatch):
    """W4A4 on b12x keeps every block scale and global scale as loaded
    (reordered, swizzled): the global scales are the kernel's alphas."""
    t, _, _ = _checkpoint_layer()
    kernel, layer = _prepare_b12x(t, monkeypatch)
    experts = kernel.fused_experts

    w13_scale = t["w13_scale"].clone()
    reorder_w1w3_to_w3w1(torch.empty_like(t["w13"]), w13_scale)
    for got, want in ((experts.w1_scale, w13_scale), (experts.w2_scale, t["w2_scale"])):
        n, k = want.shape[1], want.shape[2] * 16
        for x in range(CPU_E):
            back = convert_swizzled_to_linear(got[x].view(torch.uint8), n, k, 16)
            assert torch.equal(back, want[x].view(torch.uint8))
    assert torch.equal(experts.g1_alphas, t["w13_scale_2"])
    assert torch.equal(experts.g2_alphas, t["w2_scale_2"])


def test_b12x_experts_compute_the_checkpoint_function(monkeypatch):
    t, function, x = _checkpoint_layer()
    kernel, layer = _prepare_b12x(t, monkeypatch)
    score = torch.randn(CPU_M, CPU_E)
    topk_weights, topk_ids = torch.topk(score.softmax(-1), CPU_TOPK)
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    ref = function(x, topk_ids, topk_weights)

    def rel_err(out):
        return ((out.float() - ref).norm() / ref.norm()).item()

    def run(**swap):
        return kernel.apply(
            hidden_states=x,
            w1=swap.get("w1", layer.w13_weight),
            w2=layer.w2_weight,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            global_num_experts=CPU_E,
            activation=MoEActivation.SILU,
            apply_router_weight_on_input=False,
            expert_map=None,
        )

    # BF16 rounding of the output is all that differs.
    assert rel_err(run()) < 0.01
    # Negative controls: gate and up swapped; the global scales folded into
    # the FP8 block scales (0.34.0's preparation).
    assert rel_err(run(w1=t["w13"])) > 0.5
    experts = kernel.fused_experts
    for sf, scale_2 in (
        (experts.w1_scale, experts.g1_alphas),
        (experts.w2_scale, experts.g2_alphas),
    ):
        sf.copy_((sf.float() * scale_2.view(-1, 1, 1)).to(sf.dtype))
        scale_2.fill_(1.0)
    experts.process_weights_after_loading(layer)
    assert rel_err(run()) > 0.03


def test_b12x_w4a16_prepared_in_place_as_flashinfer_prepares(monkeypatch):
    """A W4A16 checkpoint runs FlashInfer's W4A16 path, its layout written over
    the loaded weights and scales: the bytes of FlashInfer's own prepare."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_w4a16_prepare import (
        prepare_w4a16_modelopt_nvfp4_weights,
    )

    # FlashInfer's host code sizes a workspace from the SM count.
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda *_: SimpleNamespace(multi_processor_count=1),
    )
    t, _, _ = _checkpoint_layer()
    swizzled = {k: swizzle_blockscale_(t[k].clone()) for k in ("w13_scale", "w2_scale")}
    want = prepare_w4a16_modelopt_nvfp4_weights(
        *(t["w13"], swizzled["w13_scale"], t["w13_scale_2"]),
        *(t["w2"], swizzled["w2_scale"], t["w2_scale_2"]),
        activation="silu",
    )

    kernel, layer = _prepare_b12x(t, monkeypatch, use_a16=True)

    assert kernel.fused_experts.quant_config.use_nvfp4_w4a16
    for param, packed in (
        (layer.w13_weight, want.w13),
        (layer.w13_weight_scale, want.w13_scale),
        (layer.w2_weight, want.w2),
        (layer.w2_weight_scale, want.w2_scale),
    ):
        assert torch.equal(
            param.view(torch.uint8), packed.view(torch.uint8).view_as(param)
        )
    prepared = kernel.fused_experts._layout
    assert torch.equal(prepared.w13_global_scale, want.w13_global_scale)
    assert torch.equal(prepared.w2_global_scale, want.w2_global_scale)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_b12x_quant_methods_prepare_a_layer_once(fmt, monkeypatch):
    """A second process_weights_after_loading leaves a prepared layer as it
    is (the preparation works in place: run twice, compressed-tensors swapped
    gate and up back; ModelOpt raised an IndexError)."""
    monkeypatch.setattr(
        pytest.importorskip("flashinfer.fused_moe"),
        "B12xMoEWrapper",
        _TorchB12xMoEWrapper,
    )
    # What an explicit moe_backend="flashinfer_b12x" selects on SM120.
    monkeypatch.setattr(
        ct_nvfp4_moe if fmt == "compressed-tensors" else modelopt,
        "select_nvfp4_moe_backend",
        lambda **_: (NvFp4MoeBackend.FLASHINFER_B12X, FlashInferB12xExperts),
    )
    # One rank, without a process group (ModelOpt's parameters ask the TP rank).
    monkeypatch.setattr(
        "vllm.model_executor.parameter.get_tensor_model_parallel_rank", lambda: 0
    )
    monkeypatch.setattr(
        "vllm.model_executor.parameter.get_tensor_model_parallel_world_size", lambda: 1
    )
    moe_config = make_dummy_moe_config(
        num_experts=CPU_E,
        experts_per_token=CPU_TOPK,
        hidden_dim=CPU_H,
        intermediate_size=CPU_I,
    )
    t, _, _ = _checkpoint_layer()
    g13, a13 = (t[k].unsqueeze(1).repeat(1, 2) for k in ("w13_scale_2", "a13_scale"))
    if fmt == "modelopt":
        quant_config = modelopt.ModelOptNvFp4Config(
            is_checkpoint_nvfp4_serialized=True, kv_cache_quant_algo=None
        )
        method = modelopt.ModelOptNvFp4FusedMoE(quant_config, moe_config)
        loaded = {
            "w13_weight": t["w13"],
            "w13_weight_scale": t["w13_scale"],
            "w13_weight_scale_2": g13,
            "w13_input_scale": a13,
            "w2_weight": t["w2"],
            "w2_weight_scale": t["w2_scale"],
            "w2_weight_scale_2": t["w2_scale_2"],
            "w2_input_scale": t["a2_scale"],
        }
    else:  # compressed-tensors stores the reciprocal global scales
        method = ct_nvfp4_moe.CompressedTensorsW4A4Nvfp4MoEMethod(moe_config)
        loaded = {
            "w13_weight_packed": t["w13"],
            "w13_weight_scale": t["w13_scale"],
            "w13_weight_global_scale": 1 / g13,
            "w13_input_global_scale": 1 / a13,
            "w2_weight_packed": t["w2"],
            "w2_weight_scale": t["w2_scale"],
            "w2_weight_global_scale": 1 / t["w2_scale_2"],
            "w2_input_global_scale": 1 / t["a2_scale"],
        }
    layer = torch.nn.Module()
    method.create_weights(
        layer, CPU_E, CPU_H, CPU_I, torch.bfloat16, global_num_experts=CPU_E
    )
    for name, value in loaded.items():
        getattr(layer, name).copy_(value)
    # What the methods read of RoutedExperts besides the weights.
    layer.activation, layer.moe_config = MoEActivation.SILU, moe_config
    layer._expert_routing_tables = lambda: None

    method.process_weights_after_loading(layer)
    kernel = method.moe_kernel
    assert kernel is not None  # the first call prepared the layer
    prepared = {n: p.clone() for n, p in layer.named_parameters()}
    method.process_weights_after_loading(layer)

    for name, param in layer.named_parameters():
        got, want = param.view(torch.uint8), prepared[name].view(torch.uint8)
        assert torch.equal(got, want), name
    assert method.moe_kernel is kernel
