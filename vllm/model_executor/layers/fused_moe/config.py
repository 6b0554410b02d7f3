# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What MoE experts need to know: the layer geometry, its parallelism and its
quantization (the part of vLLM's interface the NVFP4 experts use)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation

__all__ = [
    "RoutingMethodType",
    "FusedMoEConfig",
    "FusedMoEParallelConfig",
    "FusedMoEQuantConfig",
    "FusedMoEQuantDesc",
    "nvfp4_moe_quant_config",
    "nvfp4_w4a16_moe_quant_config",
]

#: FusedMoEConfig.max_num_tokens when not given (vLLM's default).
DEFAULT_MAX_NUM_TOKENS = 256


class RoutingMethodType(IntEnum):
    """How router logits become top-k weights (vLLM's values)."""

    Default = 0  # softmax, then top-k
    Renormalize = 1  # top-k, then softmax
    RenormalizeNaive = 4  # softmax, top-k, renormalize
    TopK = 5  # top-k, no softmax
    Unspecified = 9


@dataclass
class FusedMoEParallelConfig:
    """How a MoE layer is split: tensor parallelism along I, or expert
    parallelism (``use_ep``: experts split over ``ep_size`` ranks, I whole)."""

    tp_size: int = 1
    pcp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    tp_rank: int = 0
    pcp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    sp_size: int = 1
    use_ep: bool = False
    all2all_backend: str = "naive"
    enable_eplb: bool = False

    @property
    def use_batched_activation_format(self) -> bool:
        return False

    @classmethod
    def make_no_parallel(cls) -> FusedMoEParallelConfig:
        return cls()


@dataclass
class FusedMoEConfig:
    """Geometry of one MoE layer.

    Attributes:
        num_experts: experts of the whole model (global).
        num_local_experts: experts this rank holds.
        experts_per_token: top-k.
        hidden_dim: H.
        intermediate_size: I of the whole model; this rank holds
            ``intermediate_size_per_partition`` = I / tp_size of it.
        activation: see :class:`MoEActivation`.
        moe_parallel_config: see :class:`FusedMoEParallelConfig`.
        in_dtype: activation dtype (bfloat16 for the b12x kernel).
        moe_backend: the backend asked for (``"auto"`` or a name).
        max_num_tokens: the most tokens one forward call takes (CUDA-graph
            buffers are sized for it).
    """

    num_experts: int
    experts_per_token: int
    hidden_dim: int
    intermediate_size: int
    num_local_experts: int
    activation: MoEActivation
    moe_parallel_config: FusedMoEParallelConfig
    in_dtype: torch.dtype = torch.bfloat16
    num_logical_experts: int | None = None
    device: torch.device | str = "cpu"
    routing_method: RoutingMethodType = RoutingMethodType.Unspecified
    hidden_dim_unpadded: int | None = None
    moe_backend: str = "auto"
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS
    swiglu_limit: float | None = None
    intermediate_size_per_partition: int = -1

    def __post_init__(self):
        tp_size = self.moe_parallel_config.tp_size
        if self.intermediate_size % tp_size != 0:
            raise ValueError(
                f"intermediate_size {self.intermediate_size} is not divisible by "
                f"tp_size {tp_size}"
            )
        self.intermediate_size_per_partition = self.intermediate_size // tp_size
        if self.num_logical_experts is None:
            self.num_logical_experts = self.num_experts
        if self.hidden_dim_unpadded is None:
            self.hidden_dim_unpadded = self.hidden_dim
        n = self.max_num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"max_num_tokens must be a positive int, got {n!r}")

    @property
    def is_act_and_mul(self) -> bool:
        return self.activation.is_gated

    @property
    def w13_num_shards(self) -> int:
        """Shards fused into w13: gate and up (gated), up only otherwise."""
        return 2 if self.is_act_and_mul else 1

    @property
    def tp_size(self) -> int:
        return self.moe_parallel_config.tp_size

    @property
    def tp_rank(self) -> int:
        return self.moe_parallel_config.tp_rank

    @property
    def ep_size(self) -> int:
        return self.moe_parallel_config.ep_size

    @property
    def ep_rank(self) -> int:
        return self.moe_parallel_config.ep_rank

    @property
    def use_ep(self) -> bool:
        return self.moe_parallel_config.use_ep


@dataclass
class FusedMoEQuantDesc:
    """Quantization of one operand: dtype, group shape, scale, alpha or
    global scale."""

    dtype: torch.dtype | str | None = None
    shape: tuple[int, int] | None = None
    scale: torch.Tensor | None = None
    alpha_or_gscale: torch.Tensor | None = None


@dataclass
class FusedMoEQuantConfig:
    """The quantization tensors the experts read, per operand (FC1 and FC2
    inputs ``_a1``/``_a2``, weights ``_w1``/``_w2``), read-only properties
    as in vLLM. For NVFP4: ``w1_scale``/``w2_scale`` FP8 block scales,
    ``g1_alphas``/``g2_alphas`` the weights' global scales (dequantization
    direction), ``a1_gscale``/``a2_gscale`` the inputs' global scales
    (quantization direction)."""

    _a1: FusedMoEQuantDesc
    _a2: FusedMoEQuantDesc
    _w1: FusedMoEQuantDesc
    _w2: FusedMoEQuantDesc
    is_scale_swizzled: bool = True

    @property
    def quant_dtype(self) -> torch.dtype | str | None:
        return self._a1.dtype

    @property
    def weight_quant_dtype(self) -> torch.dtype | str | None:
        return self._w1.dtype

    @property
    def use_nvfp4_w4a4(self) -> bool:
        return self.quant_dtype == "nvfp4"

    @property
    def use_nvfp4_w4a16(self) -> bool:
        return self._a1.dtype is None and self._w1.dtype == "nvfp4"

    @property
    def w1_scale(self) -> torch.Tensor | None:
        return self._w1.scale

    @property
    def w2_scale(self) -> torch.Tensor | None:
        return self._w2.scale

    @property
    def g1_alphas(self) -> torch.Tensor | None:
        return self._w1.alpha_or_gscale

    @property
    def g2_alphas(self) -> torch.Tensor | None:
        return self._w2.alpha_or_gscale

    @property
    def a1_gscale(self) -> torch.Tensor | None:
        return self._a1.alpha_or_gscale

    @property
    def a2_gscale(self) -> torch.Tensor | None:
        return self._a2.alpha_or_gscale

    @staticmethod
    def make(
        quant_dtype: torch.dtype | str | None = None,
        w1_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        g1_alphas: torch.Tensor | None = None,
        g2_alphas: torch.Tensor | None = None,
        a1_gscale: torch.Tensor | None = None,
        a2_gscale: torch.Tensor | None = None,
        weight_dtype: torch.dtype | str | None = None,
        is_scale_swizzled: bool = True,
    ) -> FusedMoEQuantConfig:
        if weight_dtype is None:
            weight_dtype = quant_dtype
        return FusedMoEQuantConfig(
            _a1=FusedMoEQuantDesc(quant_dtype, None, None, a1_gscale),
            _a2=FusedMoEQuantDesc(quant_dtype, None, None, a2_gscale),
            _w1=FusedMoEQuantDesc(weight_dtype, None, w1_scale, g1_alphas),
            _w2=FusedMoEQuantDesc(weight_dtype, None, w2_scale, g2_alphas),
            is_scale_swizzled=is_scale_swizzled,
        )


def nvfp4_moe_quant_config(
    g1_alphas: torch.Tensor,
    g2_alphas: torch.Tensor,
    a1_gscale: torch.Tensor,
    a2_gscale: torch.Tensor,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    is_scale_swizzled: bool = True,
    gemm1_alpha: float | None = None,
    gemm1_beta: float | None = None,
    gemm1_clamp_limit: float | None = None,
) -> FusedMoEQuantConfig:
    """NVFP4 weights and NVFP4 activations (W4A4)."""
    _no_extras(w1_bias, w2_bias, gemm1_alpha, gemm1_beta, gemm1_clamp_limit)
    return FusedMoEQuantConfig.make(
        "nvfp4",
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        g1_alphas=g1_alphas,
        g2_alphas=g2_alphas,
        a1_gscale=a1_gscale,
        a2_gscale=a2_gscale,
        is_scale_swizzled=is_scale_swizzled,
    )


def nvfp4_w4a16_moe_quant_config(
    g1_alphas: torch.Tensor,
    g2_alphas: torch.Tensor,
    w1_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    gemm1_alpha: float | None = None,
    gemm1_beta: float | None = None,
    gemm1_clamp_limit: float | None = None,
) -> FusedMoEQuantConfig:
    """NVFP4 weights, 16-bit activations (W4A16)."""
    _no_extras(None, None, gemm1_alpha, gemm1_beta, gemm1_clamp_limit)
    return FusedMoEQuantConfig.make(
        None,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        g1_alphas=g1_alphas,
        g2_alphas=g2_alphas,
        weight_dtype="nvfp4",
    )


def _no_extras(*values: object) -> None:
    if any(v is not None for v in values):
        raise NotImplementedError(
            "biases and SwiGLU alpha/beta/clamp are not supported in this tree"
        )
