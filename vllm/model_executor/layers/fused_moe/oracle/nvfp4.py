# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NVFP4 MoE oracle: backend selection, conversion to the kernel format,
the quant config and the modular kernel, for the backends this tree runs
(FLASHINFER_B12X, its kernel or its CPU emulation); vLLM's names and
signatures."""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    nvfp4_moe_quant_config,
    nvfp4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    nvfp4_swizzled_scale_to_cutedsl_mma_view,
    prepare_nvfp4_moe_layer_for_fi_or_cutlass,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey

__all__ = [
    "EMULATED_B12X_BACKEND",
    "NvFp4MoeBackend",
    "backend_to_kernel_cls",
    "convert_to_nvfp4_moe_kernel_format",
    "is_global_sf_supported_for_nvfp4_backend",
    "make_nvfp4_moe_kernel",
    "make_nvfp4_moe_quant_config",
    "select_nvfp4_moe_backend",
]

logger = init_logger(__name__)


class NvFp4MoeBackend(Enum):
    B12X = "B12X"
    FLASHINFER_TRTLLM = "FLASHINFER_TRTLLM"
    FLASHINFER_CUTLASS = "FLASHINFER_CUTLASS"
    FLASHINFER_CUTEDSL = "FLASHINFER_CUTEDSL"
    FLASHINFER_CUTEDSL_BATCHED = "FLASHINFER_CUTEDSL_BATCHED"
    FLASHINFER_B12X = "FLASHINFER_B12X"
    VLLM_CUTLASS = "VLLM_CUTLASS"
    MARLIN = "MARLIN"
    HUMMING = "HUMMING"
    EMULATION = "EMULATION"
    FLASHINFER_MOE_EP_CUTEDSL = "FLASHINFER_MOE_EP_CUTEDSL"


FLASHINFER_NVFP4_MOE_BACKENDS = [
    NvFp4MoeBackend.FLASHINFER_TRTLLM,
    NvFp4MoeBackend.FLASHINFER_CUTLASS,
    NvFp4MoeBackend.FLASHINFER_CUTEDSL,
    NvFp4MoeBackend.FLASHINFER_CUTEDSL_BATCHED,
    NvFp4MoeBackend.FLASHINFER_B12X,
]

#: ``moe_backend`` of the b12x experts' CPU emulation (this tree only): the
#: FLASHINFER_B12X preparation, with ``apply`` computed in torch.
EMULATED_B12X_BACKEND = "flashinfer_b12x_emulated"


def is_global_sf_supported_for_nvfp4_backend(backend: NvFp4MoeBackend) -> bool:
    """Whether ``backend`` takes activation scales shared by all experts."""
    return backend in FLASHINFER_NVFP4_MOE_BACKENDS


def backend_to_kernel_cls(
    backend: NvFp4MoeBackend, emulated: bool = False
) -> list[type[mk.FusedMoEExperts]]:
    """The experts classes of ``backend`` (the emulation's, when asked)."""
    if backend != NvFp4MoeBackend.FLASHINFER_B12X:
        raise ValueError(f"NvFP4 MoE backend {backend.value} is not in this tree")
    if emulated:
        from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_emulated import (  # noqa: E501
            FlashInferB12xEmulatedExperts,
        )

        return [FlashInferB12xEmulatedExperts]
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    return [FlashInferB12xExperts]


def _use_a16(backend: NvFp4MoeBackend, checkpoint_uses_a16: bool) -> bool:
    return checkpoint_uses_a16


def select_nvfp4_moe_backend(
    config: FusedMoEConfig,
    weight_key: QuantKey | None,
    activation_key: QuantKey | None,
) -> tuple[NvFp4MoeBackend, type[mk.FusedMoEExperts]]:
    """The backend ``config.moe_backend`` names ("flashinfer_b12x", or
    "flashinfer_b12x_emulated"; "auto" means the kernel) and its experts
    class; ValueError with the reason when it cannot run this layer here."""
    name = config.moe_backend
    if name not in ("auto", "flashinfer_b12x", EMULATED_B12X_BACKEND):
        raise ValueError(
            f"moe_backend={name!r} is not supported for NvFP4 MoE in this tree. "
            f"Expected one of ['flashinfer_b12x', {EMULATED_B12X_BACKEND!r}]."
        )
    backend = NvFp4MoeBackend.FLASHINFER_B12X
    activation_format = mk.FusedMoEActivationFormat.Standard
    for k_cls in backend_to_kernel_cls(backend, name == EMULATED_B12X_BACKEND):
        supported, reason = k_cls.is_supported_config(
            k_cls, config, weight_key, activation_key, activation_format
        )
        if supported:
            return backend, k_cls
    raise ValueError(
        f"NvFp4 MoE backend {name!r} does not support the deployment "
        f"configuration since {reason}."
    )


def convert_to_nvfp4_moe_kernel_format(
    nvfp4_backend: NvFp4MoeBackend,
    layer: torch.nn.Module,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    a13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    a2_scale: torch.Tensor | None,
    is_act_and_mul: bool,
    use_a16: bool = False,
    trtllm_hidden_alignment: int = 256,
) -> tuple[torch.Tensor, ...]:
    """The layer's tensors in ``nvfp4_backend``'s format (see
    ``prepare_nvfp4_moe_layer_for_fi_or_cutlass``)."""
    if nvfp4_backend not in FLASHINFER_NVFP4_MOE_BACKENDS:
        raise ValueError(f"NvFP4 MoE backend {nvfp4_backend.value} is not in this tree")
    return prepare_nvfp4_moe_layer_for_fi_or_cutlass(
        backend=nvfp4_backend,
        layer=layer,
        w13=w13,
        w13_scale=w13_scale,
        w13_scale_2=w13_scale_2,
        a13_scale=a13_scale,
        w2=w2,
        w2_scale=w2_scale,
        w2_scale_2=w2_scale_2,
        a2_scale=a2_scale,
        is_act_and_mul=is_act_and_mul,
        trtllm_hidden_alignment=trtllm_hidden_alignment,
    )


def make_nvfp4_moe_quant_config(
    backend: NvFp4MoeBackend,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    w2_scale_2: torch.Tensor,
    a13_scale: torch.Tensor,
    a2_scale: torch.Tensor,
    swiglu_limit: float | None = None,
    swiglu_alpha: float | None = None,
    swiglu_beta: float | None = None,
    layer: torch.nn.Module | None = None,
    use_a16: bool = False,
) -> FusedMoEQuantConfig:
    """The quant config of ``backend``'s experts. The weights' global scales
    (``w13_scale_2``, ``w2_scale_2``) are passed on as the config's alphas
    themselves (the layer's parameters), so that the experts see their
    preparation; the activations' (dequantization direction) are inverted
    into quantization-direction global scales. Weight-only checkpoints
    (``use_a16``) get the W4A16 config on the backends that run it (Marlin,
    and both b12x backends)."""
    use_a16 = _use_a16(backend, use_a16)
    swiglu = {
        "gemm1_alpha": swiglu_alpha,
        "gemm1_beta": swiglu_beta,
        "gemm1_clamp_limit": swiglu_limit,
    }
    if backend == NvFp4MoeBackend.HUMMING:
        from vllm.model_executor.layers.fused_moe import RoutedExperts
        from vllm.model_executor.layers.quantization.utils.humming import (
            get_humming_moe_quant_config,
        )

        if not isinstance(layer, RoutedExperts):
            raise TypeError(
                f"the HUMMING backend needs the RoutedExperts layer, got {type(layer)}"
            )
        return get_humming_moe_quant_config(
            layer,
            gemm1_alpha=getattr(layer, "swiglu_alpha", None),
            gemm1_beta=getattr(layer, "swiglu_beta", None),
            gemm1_clamp_limit=swiglu_limit,
        )
    if backend == NvFp4MoeBackend.MARLIN or (
        use_a16 and backend in (NvFp4MoeBackend.B12X, NvFp4MoeBackend.FLASHINFER_B12X)
    ):
        return nvfp4_w4a16_moe_quant_config(
            g1_alphas=w13_scale_2,
            g2_alphas=w2_scale_2,
            w1_scale=w13_scale,
            w2_scale=w2_scale,
            **swiglu,
        )
    if backend == NvFp4MoeBackend.EMULATION:
        # The emulation quantizes with the scales as they are.
        return nvfp4_moe_quant_config(
            g1_alphas=w13_scale_2,
            g2_alphas=w2_scale_2,
            a1_gscale=a13_scale,
            a2_gscale=a2_scale,
            w1_scale=w13_scale,
            w2_scale=w2_scale,
            **swiglu,
        )
    if backend == NvFp4MoeBackend.FLASHINFER_CUTEDSL:
        w13_scale = nvfp4_swizzled_scale_to_cutedsl_mma_view(w13_scale)
        w2_scale = nvfp4_swizzled_scale_to_cutedsl_mma_view(w2_scale)
    return nvfp4_moe_quant_config(
        g1_alphas=w13_scale_2,
        g2_alphas=w2_scale_2,
        a1_gscale=(1.0 / a13_scale),
        a2_gscale=(1.0 / a2_scale),
        w1_scale=w13_scale,
        w2_scale=w2_scale,
        # TRT-LLM and CuteDSL take their input scales unswizzled.
        is_scale_swizzled=backend
        not in (NvFp4MoeBackend.FLASHINFER_TRTLLM, NvFp4MoeBackend.FLASHINFER_CUTEDSL),
        **swiglu,
    )


def make_nvfp4_moe_kernel(
    moe_quant_config: FusedMoEQuantConfig,
    moe_config: FusedMoEConfig,
    experts_cls: type[mk.FusedMoEExperts],
    backend: NvFp4MoeBackend,
    routing_tables: Any = None,
    per_token_activation: bool = False,
    *,
    experts_kwargs: dict[str, Any] | None = None,
) -> mk.FusedMoEKernel:
    """The modular kernel: no dispatch (one device or tensor parallelism),
    ``experts_cls`` built with the quant config (and this tree's
    ``experts_kwargs``: the emulation's options, the preparation's cap)."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )

    experts = experts_cls(
        moe_config=moe_config, quant_config=moe_quant_config, **(experts_kwargs or {})
    )
    return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
