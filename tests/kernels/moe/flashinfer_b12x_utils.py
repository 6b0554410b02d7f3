# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NVFP4 experts for the FlashInfer b12x tests: BF16 experts, their ModelOpt
NVFP4 tensors and what those decode to, and the layer, configs and call the
experts see through vLLM's modular-kernel interface.

Imports only torch and vLLM names 0.33.0 has plus this branch's new ones
(the NVFP4 reference in ``nvfp4_format``), nothing from the other test
helpers: in upstream's test tree this is a new file beside its own
``tests/kernels/moe/utils.py``."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
    nvfp4_moe_quant_config,
    nvfp4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExpertsModular,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    dequantize_nvfp4,
    global_scale_to_modelopt,
    nvfp4_global_scale,
    quantize_nvfp4,
)

__all__ = [
    "NVFP4ExpertsLayer",
    "apply_experts",
    "b12x_moe_config",
    "b12x_quant_config",
    "bf16_experts",
    "dequantized_experts",
    "quantize_experts_modelopt",
]


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

    w1 = deq(
        tensors["w13_weight"],
        tensors["w13_weight_scale"],
        tensors["w13_weight_scale_2"],
        2 if gated else 1,
    )
    w2 = deq(
        tensors["w2_weight"],
        tensors["w2_weight_scale"],
        tensors["w2_weight_scale_2"],
        1,
    )
    return w1, w2


# -- the experts through vLLM's modular-kernel interface ------------------------


def b12x_moe_config(
    e: int,
    topk: int,
    h: int,
    i: int,
    activation: MoEActivation,
    max_num_tokens: int = 256,
) -> FusedMoEConfig:
    """A one-rank ``FusedMoEConfig`` given the fields vLLM's requires.
    vLLM 0.33.0's raises NotImplementedError for a non-gated activation
    off CUDA, XPU and ROCm."""
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


def apply_experts(
    experts: FusedMoEExpertsModular,
    layer: torch.nn.Module,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation,
    global_num_experts: int,
    *,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' output [M, K] (``hidden_states.dtype``, on their device)
    for one call with the 15 arguments vLLM's modular kernel passes, on the
    layer's weights: one rank unless ``expert_map`` (the layer's, under
    expert parallelism) is given, no input quantization by the
    caller (b12x quantizes BF16 inputs itself), router weights applied by
    the experts (their finalize is a no-op), no workspaces (b12x manages its
    own).

    Not through ``FusedMoEKernel.apply``: in vLLM 0.33.0 that takes its
    workspaces from the worker's ``WorkspaceManager`` (upstream's tests set
    one up on CUDA with their ``workspace_init`` fixture), whose allocation
    calls ``torch.accelerator.empty_cache()``, an error without an
    accelerator: the CPU emulation could not run through it."""
    output = torch.empty_like(hidden_states)
    experts.apply(
        output,
        hidden_states,
        layer.w13_weight,
        layer.w2_weight,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        None,  # a1q_scale
        None,  # a2_scale
        None,  # workspace13
        None,  # workspace2
        None,  # expert_tokens_meta
        False,  # apply_router_weight_on_input
    )
    return output
