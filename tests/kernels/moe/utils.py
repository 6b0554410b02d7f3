# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for the MoE tests: this tree's ``FusedMoE`` NVFP4 layer, random
layers of ModelOpt tensors, the checkpoints' decode and the test-side
preparation references (fold, split+cat reorder, whole-tensor preparation);
re-exported, the BF16 experts, their NVFP4 ModelOpt tensors and the error
measure.

Two ways to a prepared layer: this tree's ``FusedMoE`` (``make_nvfp4_layer``,
with its weight loader, reloads and state dicts), or vLLM's modular-kernel
interface alone (flashinfer_b12x_utils.py): the experts built and called as
vLLM's oracle builds and calls them, which runs the same in vLLM 0.33.0 with
this branch. The b12x test's helpers live in flashinfer_b12x_utils.py and
moe_reference.py, new files in upstream's test tree (whose
``tests/kernels/moe/utils.py`` is its own, with other names)."""

from __future__ import annotations

import torch

from tests.kernels.moe.flashinfer_b12x_utils import (
    bf16_experts,
    dequantized_experts,
    quantize_experts_modelopt,
)
from tests.kernels.moe.moe_reference import rel_rms_error
from tests.kernels.utils import random_bits
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    dequantize_nvfp4,
    global_scale_from_modelopt,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)

__all__ = [
    "bf16_experts",
    "dequantized_checkpoint_layer",
    "dequantized_experts",
    "fold_reference",
    "load_nvfp4_experts",
    "make_dummy_moe_config",
    "make_nvfp4_layer",
    "quantize_experts_modelopt",
    "random_layer_tensors",
    "rel_rms_error",
    "split_cat_halves",
    "whole_tensor_preparation",
]


def split_cat_halves(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Test-side reorder: a NEW tensor with the two halves of ``t`` along
    ``dim`` swapped, built with split + cat: ``[a; b] -> [b; a]``."""
    first, second = t.chunk(2, dim=dim)
    return torch.cat([second, first], dim=dim).contiguous()


def fold_reference(scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Test-side whole-tensor fold of linear [E, R, C] FP8 scales:
    fp8(clamp(float(scale) * scale_2 of its row group)), scale_2 [E] or [E, G]."""
    e, r, c = scale.shape
    groups = scale_2.reshape(e, -1).shape[1]
    f = scale.float().view(e, groups, r // groups, c) * scale_2.view(e, groups, 1, 1)
    return f.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(e, r, c)


def whole_tensor_preparation(t: dict, gated: bool, mode: str = "alpha") -> dict:
    """Test-side reference: the same preparation done the straightforward way,
    on whole tensors (float32 fold, split+cat reorder, padded swizzle).

    ``mode="fold"``: every global scale folded into the block scales, then 1.
    ``mode="alpha"``: every block scale as loaded (reordered and swizzled
    only). The [E, 2] global scales stay as loaded.
    Also the kernel's alphas: ``w1_alpha`` = the gate's (w1's) global
    scale, ``w2_alpha`` = w2's times s_w3 / s_w1 times FC2's input scale as
    the kernel gets it (``1 / a2_gscale``, ``a2_gscale = 1 / input_scale``);
    1 and 1 after a fold."""
    s13, s2 = t["w13_weight_scale"].cpu(), t["w2_weight_scale"].cpu()
    g13, g2 = t["w13_weight_scale_2"].cpu(), t["w2_weight_scale_2"].cpu()
    if mode == "fold":
        s13, s2 = fold_reference(s13, g13), fold_reference(s2, g2)
        g13, g2 = torch.ones_like(g13), torch.ones_like(g2)
    alpha1, alpha2 = g13[:, 0], g2
    if gated:
        alpha2 = g2 * (g13[:, 1] / g13[:, 0])
    if mode == "alpha":
        alpha2 = alpha2 * (1.0 / (1.0 / t["w2_input_scale"].cpu().float()))
    w13 = t["w13_weight"].cpu()
    if gated:
        w13, s13 = split_cat_halves(w13, -2), split_cat_halves(s13, -2)
    return {
        "w13_weight": w13,
        "w13_weight_scale": swizzle_blockscale(s13),
        "w2_weight": t["w2_weight"].cpu(),
        "w2_weight_scale": swizzle_blockscale(s2),
        "w13_weight_scale_2": g13.contiguous(),
        "w2_weight_scale_2": g2,
        "w1_alpha": alpha1,
        "w2_alpha": alpha2,
    }


def random_layer_tensors(e, h, i, gated, seed, device="cpu", shared_w13_scale=False):
    """Random ModelOpt tensors of one layer (E experts, hidden size H,
    intermediate size I), by FusedMoE parameter name, checkpoint layout:
    random codes, valid FP8 block scales, w1 and w3 global scales that
    differ (``shared_w13_scale``: one per expert, as ModelOpt exports)."""
    rows = 2 * i if gated else i
    gen = torch.Generator().manual_seed(seed)

    def scales(shape):
        raw = torch.randint(0x08, 0x78, shape, dtype=torch.uint8, generator=gen)
        return raw.view(torch.float8_e4m3fn)

    shards = 2 if gated else 1
    tensors = {
        "w13_weight": random_bits((e, rows, h // 2), torch.uint8, "cpu", seed + 1),
        "w13_weight_scale": scales((e, rows, h // 16)),
        "w13_weight_scale_2": torch.rand(e, shards, generator=gen) * 4 + 0.01,
        "w13_input_scale": torch.rand(e, shards, generator=gen),
        "w2_weight": random_bits((e, h, i // 2), torch.uint8, "cpu", seed + 2),
        "w2_weight_scale": scales((e, h, i // 16)),
        "w2_weight_scale_2": torch.rand(e, generator=gen) * 4 + 0.01,
        "w2_input_scale": torch.rand(e, generator=gen),
    }
    if shared_w13_scale:
        g13 = tensors["w13_weight_scale_2"]
        tensors["w13_weight_scale_2"] = g13[:, :1].expand(e, shards).contiguous()
    return {k: v.to(device) for k, v in tensors.items()}


def dequantized_checkpoint_layer(ckpt, layer_idx: int, gated: bool):
    """Float32 [w13 ([gate; up]) [E, 2I or I, H], w2 [E, H, I]] decoded from an
    ``NVFP4MoECheckpoint``'s own tensors (its exact function)."""
    parts = {}
    for _, e, proj, suffix, t in ckpt.iter_layer_tensors(layer_idx):
        parts[(e, proj, suffix)] = t
    projs = ("gate_proj", "up_proj") if gated else ("up_proj",)

    def deq(e, proj):
        return dequantize_nvfp4(
            parts[(e, proj, "weight")],
            parts[(e, proj, "weight_scale")],
            global_scale_from_modelopt(parts[(e, proj, "weight_scale_2")]),
        )

    experts = range(ckpt.num_experts)
    w13 = torch.stack([torch.cat([deq(e, p) for p in projs]) for e in experts])
    w2 = torch.stack([deq(e, "down_proj") for e in experts])
    return w13, w2


def make_nvfp4_layer(
    e,
    topk,
    k,
    n,
    gated,
    backend,
    device="cpu",
    max_num_tokens=256,
    quant_mode="w4a4",
    **experts_kwargs,
):
    """This tree's FusedMoE NVFP4 layer in checkpoint layout ([w1; w3], no
    load-time placement), for :func:`load_nvfp4_experts` to copy tensors
    into. (Imported here: vLLM 0.33.0, where the rest of this module runs
    too, has no ``FusedMoE`` class.)"""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    return FusedMoE(
        num_experts=e,
        top_k=topk,
        hidden_size=k,
        intermediate_size=n,
        activation="silu" if gated else "relu2",
        quant_config=ModelOptNvFp4Config.for_mode(quant_mode),
        moe_backend=backend,
        params_dtype=torch.bfloat16,
        device=device,
        place_w3w1_at_load=False,  # load_nvfp4_experts copies checkpoint layout
        experts_kwargs=experts_kwargs,
        max_num_tokens=max_num_tokens,
    )


def load_nvfp4_experts(layer: torch.nn.Module, tensors: dict) -> None:
    """Copy ModelOpt tensors into the layer's parameters (checkpoint layout)."""
    with torch.no_grad():
        for name, value in tensors.items():
            param = getattr(layer, name)
            param.copy_(value.reshape(param.shape).to(param.device))


def make_dummy_moe_config(
    num_experts: int = 1,
    experts_per_token: int = 1,
    hidden_dim: int = 1,
    intermediate_size: int = 1,
    in_dtype: torch.dtype = torch.bfloat16,
    max_num_tokens: int = 512,
    activation: MoEActivation = MoEActivation.SILU,
) -> FusedMoEConfig:
    """A one-rank ``FusedMoEConfig``, called as upstream's test helper of this
    name is (tests/kernels/moe/utils.py there)."""
    return FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=experts_per_token,
        hidden_dim=hidden_dim,
        intermediate_size=intermediate_size,
        num_local_experts=num_experts,
        num_logical_experts=num_experts,
        activation=activation,
        device="cpu",
        routing_method=RoutingMethodType.TopK,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=in_dtype,
        max_num_tokens=max_num_tokens,
    )
