# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for the MoE tests: BF16 experts, their NVFP4 ModelOpt tensors, layers.

Two ways to a prepared layer: this tree's ``FusedMoE`` (``make_nvfp4_layer``,
with its weight loader, reloads and state dicts), or vLLM's modular-kernel
interface alone (``NVFP4ExpertsLayer``, ``b12x_moe_config``,
``b12x_quant_config``, ``b12x_kernel``): the experts built and called as
vLLM's oracle builds and calls them, which runs the same in vLLM 0.33.0 with
this branch (``tests/upstream``)."""

from __future__ import annotations

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from tests.kernels.utils import random_bits
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
    nvfp4_moe_quant_config,
    nvfp4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
    MoEPrepareAndFinalizeNoDPEPModular,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    dequantize_nvfp4,
    global_scale_from_modelopt,
    global_scale_to_modelopt,
    nvfp4_global_scale,
    quantize_nvfp4,
    swizzle_blockscale,
)

__all__ = [
    "NVFP4ExpertsLayer",
    "b12x_kernel",
    "b12x_moe_config",
    "b12x_quant_config",
    "bf16_experts",
    "dequantized_checkpoint_layer",
    "dequantized_experts",
    "fold_reference",
    "load_nvfp4_experts",
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


def bf16_experts(e: int, n: int, k: int, gated: bool, seed: int):
    """Random BF16 experts: w1 [e, 2n or n, k] ([gate; up]), w2 [e, k, n].

    Scaled so FC1 outputs and FC2 outputs have unit variance for unit-variance
    inputs: SiLU works in its non-linear range, nothing is damped.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    w1 = torch.randn(e, rows, k, generator=gen) / k**0.5
    w2 = torch.randn(e, k, n, generator=gen) / n**0.5
    return w1.bfloat16(), w2.bfloat16()


def _quantize_rows(w: torch.Tensor, groups: int, shared: bool = False):
    """Quantize [E, R, K] with one global scale per expert per row group (the
    same one for every group when ``shared``, from the expert's amax)."""
    e, r, _ = w.shape
    parts = w.view(e, groups, r // groups, -1)
    amax = parts.float().abs().amax(dim=(2, 3))  # [E, G]
    if shared:
        amax = amax.amax(dim=1, keepdim=True).expand(e, groups)
    gs = nvfp4_global_scale(amax)  # [E, G], quantization direction
    packed, scale = [], []
    for g in range(groups):
        p, s = quantize_nvfp4(parts[:, g], gs[:, g])
        packed.append(p)
        scale.append(s)
    return torch.cat(packed, dim=1), torch.cat(scale, dim=1), gs.contiguous()


def quantize_experts_modelopt(
    w1: torch.Tensor, w2: torch.Tensor, gated: bool, shared_w13_scale: bool = True
):
    """ModelOpt NVFP4 tensors of BF16 experts (w1 in [gate; up] order).

    Gated w1's gate and up halves share one global scale per expert (what
    ModelOpt exports), or get their own with ``shared_w13_scale=False``.
    Returns a dict keyed by the FusedMoE parameter names.
    """
    p13, s13, gs13 = _quantize_rows(w1, 2 if gated else 1, shared_w13_scale)
    p2, s2, gs2 = _quantize_rows(w2, 1)
    e = w1.shape[0]
    return {
        "w13_weight": p13,
        "w13_weight_scale": s13,
        "w13_weight_scale_2": global_scale_to_modelopt(gs13),  # [E, G]
        "w13_input_scale": torch.ones_like(gs13),
        "w2_weight": p2,
        "w2_weight_scale": s2,
        "w2_weight_scale_2": global_scale_to_modelopt(gs2).reshape(e),
        "w2_input_scale": torch.ones(e),
    }


def dequantized_experts(
    tensors: dict, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 w1, w2 decoded from ModelOpt tensors (checkpoint layout)."""

    def deq(p, s, scale_2, groups):
        e, r = p.shape[:2]
        gs = 1.0 / scale_2.reshape(e, groups)
        parts = [
            dequantize_nvfp4(
                p.view(e, groups, r // groups, -1)[:, g],
                s.view(e, groups, r // groups, -1)[:, g],
                gs[:, g],
            )
            for g in range(groups)
        ]
        return torch.cat(parts, dim=1).bfloat16()

    w1 = deq(tensors["w13_weight"], tensors["w13_weight_scale"],
             tensors["w13_weight_scale_2"], 2 if gated else 1)  # fmt: skip
    w2 = deq(tensors["w2_weight"], tensors["w2_weight_scale"],
             tensors["w2_weight_scale_2"], 1)  # fmt: skip
    return w1, w2


def dequantized_checkpoint_layer(ckpt, layer_idx: int, gated: bool):
    """Float32 [w13 ([gate; up]) [E, 2I or I, H], w2 [E, H, I]] decoded from an
    ``NVFP4MoECheckpoint``'s own tensors (its exact function)."""
    parts = {}
    for _, e, proj, suffix, t in ckpt.iter_layer_tensors(layer_idx):
        parts[(e, proj, suffix)] = t
    projs = ("gate_proj", "up_proj") if gated else ("up_proj",)

    def deq(e, proj):
        return dequantize_nvfp4(
            parts[(e, proj, "weight")], parts[(e, proj, "weight_scale")],
            global_scale_from_modelopt(parts[(e, proj, "weight_scale_2")]),
        )  # fmt: skip

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


def rel_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in float32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


# -- the experts through vLLM's modular-kernel interface ------------------------


def b12x_moe_config(
    e: int,
    topk: int,
    h: int,
    i: int,
    activation: MoEActivation,
    max_num_tokens: int = 256,
) -> FusedMoEConfig:
    """A one-rank ``FusedMoEConfig`` given the fields vLLM's requires."""
    return FusedMoEConfig(
        num_experts=e,
        experts_per_token=topk,
        hidden_dim=h,
        intermediate_size=i,
        num_local_experts=e,
        num_logical_experts=e,
        activation=activation,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        max_num_tokens=max_num_tokens,
    )


class NVFP4ExpertsLayer(torch.nn.Module):
    """The parameters an NVFP4 MoE quant method leaves for the experts to
    prepare (ModelOpt names, load layout: w13 rows [w1; w3], per-shard
    ``w13_weight_scale_2`` [E, G]), made from :func:`quantize_experts_modelopt`
    tensors (copied)."""

    def __init__(self, tensors: dict, activation: MoEActivation):
        super().__init__()
        self.activation = activation
        for name, value in tensors.items():
            data = value.detach().clone().contiguous()
            self.register_parameter(name, torch.nn.Parameter(data, requires_grad=False))


def b12x_quant_config(layer: torch.nn.Module, weight_only: bool) -> FusedMoEQuantConfig:
    """The quant config vLLM's oracle gives the b12x experts: the layer's
    scale parameters themselves, the FC1/FC2 input global scales of 1."""
    if weight_only:
        return nvfp4_w4a16_moe_quant_config(
            g1_alphas=layer.w13_weight_scale_2,
            g2_alphas=layer.w2_weight_scale_2,
            w1_scale=layer.w13_weight_scale,
            w2_scale=layer.w2_weight_scale,
        )
    e = layer.w13_weight.shape[0]
    return nvfp4_moe_quant_config(
        g1_alphas=layer.w13_weight_scale_2,
        g2_alphas=layer.w2_weight_scale_2,
        a1_gscale=torch.ones(e),
        a2_gscale=torch.ones(e),
        w1_scale=layer.w13_weight_scale,
        w2_scale=layer.w2_weight_scale,
    )


def b12x_kernel(experts: mk.FusedMoEExpertsModular) -> mk.FusedMoEKernel:
    """The modular kernel of one device: no dispatch, ``experts``."""
    return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
