# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fused Mixture-of-Experts layers and kernels."""

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.fused_moe import (
    fused_experts,
    fused_moe,
    fused_topk,
)

__all__ = [
    "FusedMoEConfig",
    "FusedMoEQuantConfig",
    "MoEActivation",
    "fused_experts",
    "fused_moe",
    "fused_topk",
]
