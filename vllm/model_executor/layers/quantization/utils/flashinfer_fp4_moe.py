# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Utility helpers for NVFP4 + FlashInfer fused-MoE path.

The b12x preparation of a loaded NVFP4 MoE layer is a sequence of bounded,
in-place steps (drawn in ``fused_moe/experts/flashinfer_b12x_w4a4.py``)::

    validate  blockscale_checks.check_blockscale_values
    fold      blockscale_fold.fold_global_scale_into_blockscale_  ("fold" mode)
    reorder   bounded_halves_swap.swap_halves_   [w1; w3] -> [w3; w1]
    swizzle   blockscale_swizzle.swizzle_blockscale_bounded     linear -> 128x4

Each step is a sequence of chunks run by ``bounded_chunks.run_chunks``: it
allocates at most ``max_transient_bytes`` and resumes from a ``ChunkProgress``
after an exception, which leaves the chunk in flight untouched or, when it
came after the chunk's last write began, finished and counted.
"""

from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    ChunkProgress,
)
from vllm.model_executor.layers.quantization.utils.bounded_halves_swap import (
    swap_halves_,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    amax_for_moe_activation_quant,
)

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
        NvFp4MoeBackend,
    )

logger = init_logger(__name__)

__all__ = [
    "reorder_w1w3_to_w3w1",
]


def reorder_w1w3_to_w3w1(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dim: int = -2,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-order concatenated `[w1, w3]` tensors to `[w3, w1]` in-place.

    `weight` and `scale` must be contiguous; they remain contiguous on return.
    At most ``max_transient_bytes`` allocated, resumable from ``progress``;
    the contract in full: :func:`swap_halves_`.
    """
    return swap_halves_(
        weight,
        scale,
        dim,
        max_transient_bytes=max_transient_bytes,
        progress=progress,
    )


def _b12x_w13_global_scales(
    layer: "RoutedExperts", w13_scale_2: torch.Tensor
) -> torch.Tensor:
    """The per-shard w13 global scales [E, 2] (dequantization direction) of
    ``layer``, where it has them: the b12x experts carry an up scale that
    differs from the gate's exactly (in the FC2 alpha), so they keep both,
    where the quant methods pass only w1's (``w13_scale_2``, [E]) on."""
    ct_global = getattr(layer, "w13_weight_global_scale", None)
    if ct_global is not None:  # compressed-tensors: quantization direction
        per_shard = 1.0 / ct_global.float()
    else:
        per_shard = getattr(layer, "w13_weight_scale_2", None)
    if (
        per_shard is not None
        and per_shard.dim() == 2
        and per_shard.shape[0] == w13_scale_2.shape[0]
    ):
        return per_shard
    return w13_scale_2


def _b12x_activation_scales(
    layer: "RoutedExperts",
    a13_scale: torch.Tensor,
    a2_scale: torch.Tensor,
    num_local_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The b12x kernel's FC1 and FC2 input scales, one per local expert, [E]
    float32 (dequantization direction, ``amax / (448 * 6)``).

    The kernel takes ``input_global_scale[expert]`` and
    ``fc2_input_scale[expert]``, so each expert keeps its calibrated scales;
    of w1's and w3's FC1 scales (one input) the larger, which never clips
    the other's range. Scales for all experts are narrowed to this rank's by
    ``layer.expert_map``. With EPLB (experts move, their scales would not
    follow): one value shared by all experts.

    Raises:
        ValueError: a scale count neither this rank's experts nor the
            expert map's.

    """
    a13 = a13_scale.detach().float()
    if a13.dim() == 2:
        a13 = a13.max(dim=1).values
    a13, a2 = a13.reshape(-1), a2_scale.detach().float().reshape(-1)
    if layer.moe_config.moe_parallel_config.enable_eplb:
        a13 = amax_for_moe_activation_quant(a13, True).repeat(num_local_experts)
        a2 = amax_for_moe_activation_quant(a2, True).repeat(num_local_experts)
        return a13, a2
    expert_map = getattr(layer, "expert_map", None)
    scales = []
    for name, a in (("w13_input_scale", a13), ("w2_input_scale", a2)):
        if a.numel() != num_local_experts:
            held = None
            if expert_map is not None and a.numel() == expert_map.numel():
                held = (expert_map >= 0).nonzero().flatten()
            if expert_map is None or held is None or held.numel() != num_local_experts:
                raise ValueError(
                    f"{name} has {a.numel()} experts' scales; expected "
                    f"{num_local_experts} (this rank's experts) or one per "
                    "expert of an expert map that holds that many"
                )
            local = torch.empty_like(a[:num_local_experts])
            local[expert_map[held].long()] = a[held.to(a.device)]
            a = local
        scales.append(a.contiguous())
    return scales[0], scales[1]


def prepare_nvfp4_moe_layer_for_fi_or_cutlass(
    backend: "NvFp4MoeBackend",
    layer: "RoutedExperts",
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor,
    a13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor,
    a2_scale: torch.Tensor,
    is_act_and_mul: bool,
    trtllm_hidden_alignment: int = 256,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """The NVFP4 MoE tensors of ``layer`` in the layout of a FlashInfer or
    CUTLASS ``backend``: ``(w13, w13_scale, w13_scale_2, a13_scale, w2,
    w2_scale, w2_scale_2, a2_scale)``.

    FLASHINFER_B12X: the weights and block scales are returned as they are
    (the same tensors): ``FlashInferB12xExperts.process_weights_after_loading``
    rewrites them in place, in bounded memory, resumably. ``w13_scale_2`` is
    the layer's per-shard [E, 2] global scales where it has them (see
    ``_b12x_w13_global_scales``). FLASHINFER_CUTLASS and FLASHINFER_TRTLLM:
    [w1; w3] reordered to [w3; w1] in place (bounded), then TRT-LLM's shuffle
    or the 128x4 swizzle (new tensors). The activation scales are reduced as
    each backend takes them: one per expert for FLASHINFER_B12X (see
    ``_b12x_activation_scales``), one value shared by all experts for
    FlashInfer's other backends, the max over w1/w3 otherwise.
    """
    # Delayed import for circular dependency avoidance.
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
        NvFp4MoeBackend,
        is_global_sf_supported_for_nvfp4_backend,
    )

    if backend not in (
        NvFp4MoeBackend.VLLM_CUTLASS,
        NvFp4MoeBackend.FLASHINFER_CUTLASS,
        NvFp4MoeBackend.FLASHINFER_TRTLLM,
        NvFp4MoeBackend.FLASHINFER_CUTEDSL_BATCHED,
        NvFp4MoeBackend.FLASHINFER_B12X,
    ):
        raise ValueError(f"{backend} is not a FlashInfer or CUTLASS NVFP4 MoE backend")

    if backend == NvFp4MoeBackend.FLASHINFER_B12X:
        w13_scale_2 = _b12x_w13_global_scales(layer, w13_scale_2)
        a13_scale, a2_scale = _b12x_activation_scales(
            layer, a13_scale, a2_scale, w13.shape[0]
        )
        return (
            w13,
            w13_scale,
            w13_scale_2,
            a13_scale,
            w2,
            w2_scale,
            w2_scale_2,
            a2_scale,
        )

    # For some FI kernels, the input scales are shared by all experts.
    if is_global_sf_supported_for_nvfp4_backend(backend):
        num_experts = w13.shape[0]
        enable_eplb = layer.moe_config.moe_parallel_config.enable_eplb
        a13_scale = amax_for_moe_activation_quant(a13_scale, enable_eplb).repeat(
            num_experts
        )
        a2_scale = amax_for_moe_activation_quant(a2_scale, enable_eplb).repeat(
            num_experts
        )
    else:
        a13_scale = a13_scale.max(dim=1).values.to(torch.float32)

    # Reorder [w1, w3] to [w3, w1] for FI NVFP4 MoE kernels.
    is_gated = layer.activation.is_gated
    if (
        is_gated
        and is_act_and_mul
        and backend
        in (NvFp4MoeBackend.FLASHINFER_CUTLASS, NvFp4MoeBackend.FLASHINFER_TRTLLM)
    ):
        w13, w13_scale = reorder_w1w3_to_w3w1(w13, w13_scale)

    if backend == NvFp4MoeBackend.FLASHINFER_TRTLLM:
        moe = layer.moe_config
        w13, w13_scale, w2, w2_scale, padded_hidden = align_fp4_moe_hidden_dim_for_fi(
            w13, w13_scale, w2, w2_scale, min_alignment=trtllm_hidden_alignment
        )
        if moe.hidden_dim_unpadded is None:
            moe.hidden_dim_unpadded = moe.hidden_dim
        moe.hidden_dim = padded_hidden
        # TRT-LLM's block-scale shuffle needs the w13 rows (2 x the padded I
        # when gated) to be a multiple of 128; the padded rows are zero.
        w13, w13_scale, w2, w2_scale, padded_intermediate = (
            align_fp4_moe_weights_for_fi(
                w13, w13_scale, w2, w2_scale, is_act_and_mul, 64 if is_gated else 128
            )
        )
        moe.intermediate_size_per_partition = padded_intermediate
        w13, w13_scale, w2, w2_scale = prepare_static_weights_for_trtllm_fp4_moe(
            w13,
            w2,
            w13_scale,
            w2_scale,
            hidden_size=w2.size(-2),
            intermediate_size=w13.size(-2) // 2 if is_gated else w13.size(-2),
            num_experts=w13.size(0),
            is_gated_activation=is_gated,
        )
    else:
        # The 128x4 swizzle of the other FlashInfer / CUTLASS kernels.
        w13_scale = swizzle_blockscale(w13_scale)
        pad_size = w13_scale.size(1) - w13.size(1)
        if pad_size > 0:
            if is_act_and_mul:
                raise NotImplementedError(
                    "intermediate size padding of gated w1 and w3 is not "
                    f"supported by the {backend.value} NVFP4 MoE backend"
                )
            w13 = torch.nn.functional.pad(w13, (0, 0, 0, pad_size))
            w2 = torch.nn.functional.pad(w2, (0, pad_size // 2, 0, 0))
            w2_scale = torch.nn.functional.pad(w2_scale, (0, pad_size // 16))
        w2_scale = swizzle_blockscale(w2_scale)

    return w13, w13_scale, w13_scale_2, a13_scale, w2, w2_scale, w2_scale_2, a2_scale


# -- The rest of vLLM's module (its TRT-LLM and CuteDSL paths), which the
# NVFP4 MoE preparation does not use: the names the definitions above call,
# refusing here. (Not part of the branch: the fork keeps vLLM's own.)


def align_fp4_moe_hidden_dim_for_fi(w13, w13_scale, w2, w2_scale, min_alignment=256):
    raise NotImplementedError("FlashInfer TRT-LLM NVFP4 MoE is not available here")


def align_fp4_moe_weights_for_fi(
    w13, w13_scale, w2, w2_scale, is_act_and_mul, min_alignment=16
):
    raise NotImplementedError("FlashInfer TRT-LLM NVFP4 MoE is not available here")


def prepare_static_weights_for_trtllm_fp4_moe(
    gemm1_weights,
    gemm2_weights,
    gemm1_scales_linear_fp4_bytes,
    gemm2_scales_linear_fp4_bytes,
    hidden_size,
    intermediate_size,
    num_experts,
    is_gated_activation,
):
    raise NotImplementedError("FlashInfer TRT-LLM NVFP4 MoE is not available here")


def nvfp4_swizzled_scale_to_cutedsl_mma_view(scale):
    raise NotImplementedError("FlashInfer CuteDSL NVFP4 MoE is not available here")
