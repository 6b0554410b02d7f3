# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""This tree's ``FusedMoE`` with the ModelOpt NVFP4 method: vLLM's constructor
arguments, the backend selection and its refusals, and the BF16-activation
emulation's exactness through the whole layer."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe
from tests.kernels.moe.utils import (
    bf16_experts,
    dequantized_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    rel_rms_error,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
    is_flashinfer_b12x_moe_available,
)
from vllm.model_executor.layers.quantization.modelopt import (
    ModelOptNvFp4Config,
    ModelOptNvFp4FusedMoE,
)

_B12X = is_flashinfer_b12x_moe_available()
EMULATED = "flashinfer_b12x_emulated"


def test_create_weights_takes_upstreams_arguments():
    layer = make_nvfp4_layer(8, 2, 256, 128, True, EMULATED)
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


def test_quant_config_takes_upstreams_arguments():
    config = ModelOptNvFp4Config("W4A16_NVFP4", True, None, ["lm_head"], 16)
    assert config.quant_mode == "w4a16" and config.is_weight_only
    assert config.exclude_modules == ["lm_head"]
    assert ModelOptNvFp4Config.for_mode("w4a4").quant_method == "NVFP4"
    with pytest.raises(ValueError, match="Unsupported ModelOpt NVFP4 quant_algo"):
        ModelOptNvFp4Config("FP8")
    layer = make_nvfp4_layer(8, 2, 256, 128, True, EMULATED)
    with pytest.raises(ValueError, match="serialized NVFP4 checkpoints only"):
        ModelOptNvFp4FusedMoE(ModelOptNvFp4Config(), layer.moe_config)
    method = ModelOptNvFp4FusedMoE(config, layer.moe_config)
    assert method.use_a16


def test_layer_refuses_before_preparation():
    layer = make_nvfp4_layer(8, 2, 256, 128, True, EMULATED)
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 8))


@pytest.mark.skipif(bool(_B12X), reason="the b12x kernel can run here")
def test_kernel_backend_names_its_requirement():
    with pytest.raises(ValueError, match="flashinfer_b12x.*since.*: needs "):
        make_nvfp4_layer(8, 2, 256, 128, True, "flashinfer_b12x")
    assert not is_flashinfer_b12x_moe_available()
    assert _B12X.reason


def test_unknown_backend():
    with pytest.raises(ValueError, match="moe_backend='triton' is not supported"):
        make_nvfp4_layer(8, 2, 256, 128, True, "triton")


@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
def test_bf16_activation_emulation_is_exact_when_the_fold_is_exact(gated):
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
    layer = make_nvfp4_layer(e, topk, k, n, gated, EMULATED, bf16_activations=True)
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    out = layer(x, logits)
    act = "silu" if gated else "relu2"
    dw1, dw2 = dequantized_experts(tensors, gated=gated)
    ref = torch_moe(x, dw1, dw2, logits, topk, True, act)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # Control: the same comparison with gate and up (or the two halves of the
    # I rows) swapped is nowhere near.
    half = dw1.shape[1] // 2
    swapped = torch.cat([dw1[:, half:], dw1[:, :half]], dim=1)
    wrong = torch_moe(x, swapped, dw2, logits, topk, True, act)
    assert rel_rms_error(out, wrong) > 0.5
