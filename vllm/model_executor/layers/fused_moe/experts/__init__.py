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
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
    FlashInferB12xW4A16Experts,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16_emulated import (  # noqa: E501
    FlashInferB12xW4A16EmulatedExperts,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

__all__ = [
    "FlashInferB12xEmulatedExperts",
    "FlashInferB12xExperts",
    "FlashInferB12xW4A16EmulatedExperts",
    "FlashInferB12xW4A16Experts",
    "NVFP4_MOE_BACKENDS",
    "NVFP4_W4A16_MOE_BACKENDS",
    "get_nvfp4_experts_class",
    "is_flashinfer_b12x_moe_available",
]

#: NVFP4 MoE backends selectable with ``FusedMoE(moe_backend=...)``.
NVFP4_MOE_BACKENDS: dict[str, type[FusedMoEExperts]] = {
    FlashInferB12xExperts.name: FlashInferB12xExperts,
    FlashInferB12xEmulatedExperts.name: FlashInferB12xEmulatedExperts,
}

#: The same backends for weight-only NVFP4 (``quant_mode="w4a16"``).
NVFP4_W4A16_MOE_BACKENDS: dict[str, type[FusedMoEExperts]] = {
    FlashInferB12xW4A16Experts.name: FlashInferB12xW4A16Experts,
    FlashInferB12xW4A16EmulatedExperts.name: FlashInferB12xW4A16EmulatedExperts,
}


def get_nvfp4_experts_class(
    backend: str, quant_mode: str = "w4a4"
) -> type[FusedMoEExperts]:
    """The experts class of ``backend`` for ``quant_mode`` ("w4a4": NVFP4
    activations too; "w4a16": BF16 activations, FlashInfer's W4A16 layout)."""
    if quant_mode not in ("w4a4", "w4a16"):
        raise ValueError(f"quant_mode must be 'w4a4' or 'w4a16', got {quant_mode!r}")
    backends = NVFP4_W4A16_MOE_BACKENDS if quant_mode == "w4a16" else NVFP4_MOE_BACKENDS
    if backend not in backends:
        raise ValueError(
            f"unknown NVFP4 MoE backend {backend!r}; expected one of {sorted(backends)}"
        )
    return backends[backend]
