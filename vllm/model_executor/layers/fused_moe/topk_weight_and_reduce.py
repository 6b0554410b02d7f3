# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Top-k weight application and reduction after the experts."""

from __future__ import annotations

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk

__all__ = ["TopKWeightAndReduceNoOP"]


class TopKWeightAndReduceNoOP(mk.TopKWeightAndReduce):
    """The experts already applied the weights and reduced over the top-k:
    the result is copied into ``output`` (or returned when there is none)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TopKWeightAndReduceNoOP)

    def apply(
        self,
        output: torch.Tensor | None,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor:
        if output is None:
            return fused_expert_output
        if output is not fused_expert_output:
            if output.shape != fused_expert_output.shape:
                raise ValueError(
                    f"output {tuple(output.shape)} and the experts' output "
                    f"{tuple(fused_expert_output.shape)} differ in shape"
                )
            output.copy_(fused_expert_output)
        return output
