# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Utility helpers for NVFP4 + FlashInfer fused-MoE path.

The b12x preparation of a loaded NVFP4 MoE layer is a sequence of bounded,
in-place steps (drawn in ``fused_moe/experts/flashinfer_b12x_w4a4.py``)::

    validate  blockscale_checks.check_blockscale_values
    fold      blockscale_fold.fold_global_scale_into_blockscale_  ("fold" mode)
    reorder   reorder_w1w3_to_w3w1 (here)   [w1; w3] -> [w3; w1]
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
    allocation_bytes,
    check_cap,
    check_contiguous,
    largest_block_within,
    run_chunks,
    tile_bytes,
    unit_chunks,
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


def _normalize_dim(name: str, t: torch.Tensor, dim: int) -> int:
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"dim={dim} is out of range for {name} with {t.dim()} dimensions "
            f"(expected -{t.dim()} <= dim < {t.dim()})"
        )
    return dim % t.dim()


def _as_halves(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A view (aliasing ``t``, contiguous) as bytes [outer, 2, half_bytes]:
    ``outer`` is the product of the sizes before ``dim``."""
    outer = 1
    for s in t.shape[:dim]:
        outer *= s
    half_bytes = t.numel() * t.element_size() // max(outer, 1) // 2
    return t.reshape(-1).view(torch.uint8).view(outer, 2, half_bytes)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _bounce_buffer_bytes(
    nbytes_per_half: list[int], device: torch.device, max_transient_bytes: int
) -> int:
    """Bounce-buffer bytes: at most the cap (rounded as the CUDA allocator
    counts), the device's tile and the largest half."""
    largest = max(nbytes_per_half, default=0)
    size = max(1, min(max_transient_bytes, tile_bytes(device), largest))
    if allocation_bytes(size) > max_transient_bytes:
        size = largest_block_within(max_transient_bytes)
    return size


def _swap_chunk(a: torch.Tensor, b: torch.Tensor, tmp: torch.Tensor) -> None:
    """Swap equal-shape ``a`` and ``b`` through ``tmp``: done, or undone
    whichever copy raises, before or after its write."""
    tmp.copy_(a)
    a_holds_b = False
    try:
        a.copy_(b)
        a_holds_b = True  # b may be overwritten from here: a has its bytes
        b.copy_(tmp)
    except BaseException:
        if a_holds_b:
            b.copy_(a)
        a.copy_(tmp)
        raise


def reorder_w1w3_to_w3w1(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dim: int = -2,
    *,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    progress: ChunkProgress | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Swap the gate and up halves of a fused MoE weight and its scales, in place.

    FlashInfer's NVFP4 MoE kernels want the fused gate/up projection as
    ``[w3; w1]`` (up first); checkpoints load it as ``[w1; w3]``. Along ``dim``
    of size ``2I``::

        before:  rows [0, I) = w1 (gate)   rows [I, 2I) = w3 (up)
        after:   rows [0, I) = w3 (up)     rows [I, 2I) = w1 (gate)

    The result is bit-identical to ``torch.cat([w3, w1], dim)`` for every
    dtype, but no second copy of either tensor is ever alive.

    Args:
        weight: contiguous tensor, any dtype, e.g. ``w13_weight``
            [E, 2I, H/2] uint8 (packed FP4).
        scale: contiguous tensor on the same device, any dtype, e.g.
            ``w13_weight_scale`` [E, 2I, H/16] float8_e4m3fn in the linear
            (unswizzled) layout. Its size along ``dim`` must equal weight's.
        dim: the dimension holding ``[w1; w3]``; normalized against each
            tensor's own rank. Must have an even size.
        max_transient_bytes: upper bound on all memory this call allocates,
            together. Any positive value works: when one index along ``dim``
            spans more bytes than the cap, it is split further.
        progress: resumption point (see :class:`ChunkProgress`). The swap is
            an involution: without ``progress``, a retry after an exception
            would swap the chunks already done back.

    Returns:
        ``(weight, scale)``: the same tensor objects, modified in place;
        storage, data pointers, shape, strides and contiguity unchanged.

    Memory: one bounce buffer of ``min(max_transient_bytes, tile, largest
    half)`` bytes (tile: 2 MiB on CPU, 16 MiB on CUDA), allocated once before
    the first write and reused for every chunk of both tensors, so a failed
    allocation leaves both inputs untouched.

    Interruption: an exception (a KeyboardInterrupt included) raised by any
    operation of the call, before or after its write, leaves every chunk
    either swapped or untouched; none of its bytes is left only in the buffer.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a tensor is not contiguous, the tensors are on different
            devices or overlap, ``dim`` is out of range, the size along ``dim``
            is odd or differs between the tensors, or the cap is not positive.
            Nothing is modified when an error is raised.

    """
    check_contiguous("weight", weight)
    check_contiguous("scale", scale)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    check_cap(max_transient_bytes)
    if weight.device != scale.device:
        raise ValueError(
            "weight and scale must be on the same device, got "
            f"weight on {weight.device} and scale on {scale.device}"
        )
    w_dim = _normalize_dim("weight", weight, dim)
    s_dim = _normalize_dim("scale", scale, dim)
    size = weight.shape[w_dim]
    if scale.shape[s_dim] != size:
        raise ValueError(
            f"weight and scale must have the same size along dim={dim}, got "
            f"weight {tuple(weight.shape)} (size {size}) and scale "
            f"{tuple(scale.shape)} (size {scale.shape[s_dim]})"
        )
    if size % 2 != 0:
        raise ValueError(
            f"the size along dim={dim} must be even ([w1; w3] halves), got "
            f"{size} for weight {tuple(weight.shape)}"
        )
    if _overlaps(weight, scale):
        raise ValueError("weight and scale must not share memory")

    with torch.no_grad():
        targets = [
            _as_halves(t, d)
            for t, d in ((weight, w_dim), (scale, s_dim))
            if t.numel() > 0
        ]
        if not targets:
            run_chunks(0, lambda idx: None, progress)
            return weight, scale
        buf_bytes = _bounce_buffer_bytes(
            [h.shape[0] * h.shape[2] for h in targets],
            weight.device,
            max_transient_bytes,
        )
        # Chunks (row, n rows, start, n bytes) of each [outer, 2, L] halves.
        chunks = [
            (h, c)
            for h in targets
            for c in unit_chunks(h.shape[0], h.shape[2], buf_bytes)
        ]
        # The only allocation, made before any write: a failure mutates nothing.
        buf = torch.empty(buf_bytes, dtype=torch.uint8, device=weight.device)

        def swap(idx: int) -> None:
            halves, (row, rows, start, n) = chunks[idx]
            a = halves[row : row + rows, 0, start : start + n]
            b = halves[row : row + rows, 1, start : start + n]
            _swap_chunk(a, b, buf[: rows * n].view(rows, n))

        run_chunks(len(chunks), swap, progress)
    return weight, scale


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
