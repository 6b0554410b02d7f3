# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Expert implementations, by backend name."""

from __future__ import annotations

from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_emulated import (
    FlashInferB12xEmulatedExperts,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
    is_flashinfer_b12x_moe_available,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

__all__ = [
    "FlashInferB12xEmulatedExperts",
    "FlashInferB12xExperts",
    "NVFP4_MOE_BACKENDS",
    "get_nvfp4_experts_class",
    "is_flashinfer_b12x_moe_available",
]

#: NVFP4 MoE backends selectable with ``FusedMoE(moe_backend=...)``.
NVFP4_MOE_BACKENDS: dict[str, type[FusedMoEExperts]] = {
    FlashInferB12xExperts.name: FlashInferB12xExperts,
    FlashInferB12xEmulatedExperts.name: FlashInferB12xEmulatedExperts,
}


def get_nvfp4_experts_class(backend: str) -> type[FusedMoEExperts]:
    if backend not in NVFP4_MOE_BACKENDS:
        raise ValueError(
            f"unknown NVFP4 MoE backend {backend!r}; expected one of "
            f"{sorted(NVFP4_MOE_BACKENDS)}"
        )
    return NVFP4_MOE_BACKENDS[backend]
