# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What MoE experts need to know: the layer geometry and its quantization."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation

__all__ = ["FusedMoEConfig", "FusedMoEQuantConfig"]


@dataclass
class FusedMoEConfig:
    """Geometry of one MoE layer, per tensor-parallel partition.

    Attributes:
        num_experts: E, experts held by this rank.
        experts_per_token: top-k.
        hidden_dim: H.
        intermediate_size_per_partition: I (after TP sharding).
        activation: see :class:`MoEActivation`.
        in_dtype: activation dtype (bfloat16 for the b12x kernel).
        tp_rank, tp_size: tensor parallelism along I.
        ep_size: expert parallelism: this rank holds E of ep_size * E
            experts (1: all of them).
    """

    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size_per_partition: int
    activation: MoEActivation
    in_dtype: torch.dtype = torch.bfloat16
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1

    @property
    def is_act_and_mul(self) -> bool:
        return self.activation.is_gated

    @property
    def w13_rows(self) -> int:
        return self.activation.fc1_rows(self.intermediate_size_per_partition)


@dataclass
class FusedMoEQuantConfig:
    """Quantization tensors the experts read at ``apply`` time.

    For NVFP4 (``quant_dtype="nvfp4"``):

    Attributes:
        w1_scale, w2_scale: FP8 block scales as the kernel reads them (for
            b12x: MMA-layout views of the swizzled scales).
        g1_alphas, g2_alphas: [E] float32 per-expert output multipliers of
            FC1 / FC2 (dequantization direction).
        a1_gscale, a2_gscale: [E] float32 quantization-direction global scales
            of the FC1 / FC2 inputs, or None when the kernel quantizes them
            dynamically.
    """

    quant_dtype: str = "nvfp4"
    w1_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    g1_alphas: torch.Tensor | None = None
    g2_alphas: torch.Tensor | None = None
    a1_gscale: torch.Tensor | None = None
    a2_gscale: torch.Tensor | None = None
