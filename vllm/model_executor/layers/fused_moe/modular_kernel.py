# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The modular MoE kernel: prepare/finalize (communication) + experts (compute).

The part of vLLM's modular-kernel interface the NVFP4 experts are written
against (names and signatures as vLLM 0.33.0's)::

    FusedMoEKernel(prepare_finalize, fused_experts).apply(
        hidden_states, w1, w2, topk_weights, topk_ids, activation,
        global_num_experts, expert_map, apply_router_weight_on_input)
      -> prepare_finalize.prepare(...)          # single device: nothing to do
      -> fused_experts.apply(output, ...)       # writes output [M, K]
      -> prepare_finalize.finalize(...)         # top-k weight and reduce

An experts implementation also owns the weight layout it needs:
``process_weights_after_loading(layer)`` turns the checkpoint layout of the
layer's parameters into the kernel's, once, after loading.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey
from vllm.platforms import current_platform

__all__ = [
    "ExpertTokensMetadata",
    "FusedMoEActivationFormat",
    "FusedMoEExperts",
    "FusedMoEExpertsModular",
    "FusedMoEKernel",
    "FusedMoEPrepareAndFinalize",
    "FusedMoEPrepareAndFinalizeModular",
    "PrepareResultType",
    "TopKWeightAndReduce",
]


class FusedMoEActivationFormat(Enum):
    """Standard: [tokens, hidden]; BatchedExperts: [experts, max tokens, hidden]."""

    Standard = ("standard",)
    BatchedExperts = ("batched_experts",)


@dataclass
class ExpertTokensMetadata:
    """Tokens per local expert (batched formats); unused on one device."""

    expert_num_tokens: torch.Tensor | None
    expert_num_tokens_cpu: torch.Tensor | None


#: (a1q, a1q_scale, expert_tokens_meta, topk_ids, topk_weights); None entries
#: mean "unchanged".
PrepareResultType = tuple[
    torch.Tensor,
    torch.Tensor | None,
    ExpertTokensMetadata | None,
    torch.Tensor | None,
    torch.Tensor | None,
]


class TopKWeightAndReduce(ABC):
    """Applies the top-k weights to the experts' output and reduces over k."""

    @abstractmethod
    def apply(
        self,
        output: torch.Tensor | None,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
    ) -> torch.Tensor: ...


class FusedMoEPrepareAndFinalize(ABC):
    """Moves tokens to the experts and results back (all-to-all under EP)."""

    @property
    @abstractmethod
    def activation_format(self) -> FusedMoEActivationFormat: ...

    @abstractmethod
    def topk_indices_dtype(self) -> torch.dtype | None: ...

    @abstractmethod
    def max_num_tokens_per_rank(self) -> int | None: ...

    @abstractmethod
    def num_dispatchers(self) -> int: ...

    @abstractmethod
    def output_is_reduced(self) -> bool: ...


class FusedMoEPrepareAndFinalizeModular(FusedMoEPrepareAndFinalize):
    """Prepare/finalize on top-k ids and weights."""

    @abstractmethod
    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> PrepareResultType: ...

    @abstractmethod
    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: TopKWeightAndReduce,
    ) -> None: ...


class FusedMoEExperts(ABC):
    """Base class of expert implementations: capability predicates for the
    backend selection, the weight preparation, the computation."""

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        max_num_tokens: int | None = None,
        num_dispatchers: int | None = None,
    ):
        if self.activation_format() == FusedMoEActivationFormat.Standard and (
            max_num_tokens is not None or num_dispatchers is not None
        ):
            raise ValueError(
                "max_num_tokens and num_dispatchers should only be set for "
                "BatchedExperts activation format."
            )
        self.moe_config = moe_config
        self.quant_config = quant_config
        self.max_num_tokens = max_num_tokens
        self.num_dispatchers = num_dispatchers

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:  # noqa: B027
        """Rearrange ``layer``'s loaded parameters for this kernel."""

    @staticmethod
    def is_monolithic() -> bool:
        raise NotImplementedError

    @property
    def expects_unquantized_inputs(self) -> bool:
        """Whether the experts quantize their input themselves."""
        return False

    @staticmethod
    @abstractmethod
    def activation_format() -> FusedMoEActivationFormat: ...

    @staticmethod
    def is_supported_config(
        cls: type[FusedMoEExperts],
        moe_config: FusedMoEConfig,
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
        activation_format: FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        """(True, None), or (False, the first reason ``cls`` cannot run)."""

        def no(reason: str) -> tuple[bool, str]:
            return False, f"kernel does not support {reason}"

        if not cls._supports_current_device():
            return no(f"current device {current_platform.device_name}")
        if not (moe_config.is_act_and_mul or cls._supports_no_act_and_mul()):
            return no("no act_and_mul MLP layer")
        if not cls._supports_activation(moe_config.activation):
            return no(f"{moe_config.activation} activation")
        if not cls._supports_quant_scheme(weight_key, activation_key):
            return no(f"quantization scheme {weight_key}x{activation_key}")
        if not cls._supports_parallel_config(moe_config.moe_parallel_config):
            return no(f"parallel config {moe_config.moe_parallel_config}")
        if activation_format != cls.activation_format():
            return no(f"{activation_format.value} activation format")
        return True, None

    @staticmethod
    @abstractmethod
    def _supports_current_device() -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_no_act_and_mul() -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_quant_scheme(
        weight_key: QuantKey | None, activation_key: QuantKey | None
    ) -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_activation(activation: MoEActivation) -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_parallel_config(
        moe_parallel_config: FusedMoEParallelConfig,
    ) -> bool: ...

    # -- the quant config's tensors, as the kernels read them ------------------
    @property
    def quant_dtype(self) -> torch.dtype | str | None:
        return self.quant_config.quant_dtype

    @property
    def a1_gscale(self) -> torch.Tensor | None:
        return self.quant_config.a1_gscale

    @property
    def a2_gscale(self) -> torch.Tensor | None:
        return self.quant_config.a2_gscale

    @property
    def w1_scale(self) -> torch.Tensor | None:
        return self.quant_config.w1_scale

    @property
    def w2_scale(self) -> torch.Tensor | None:
        return self.quant_config.w2_scale

    @property
    def g1_alphas(self) -> torch.Tensor | None:
        return self.quant_config.g1_alphas

    @property
    def g2_alphas(self) -> torch.Tensor | None:
        return self.quant_config.g2_alphas


class FusedMoEExpertsModular(FusedMoEExperts):
    """Experts that take routed tokens (top-k ids and weights) and write the
    [M, K] result into the ``output`` the kernel allocated."""

    @staticmethod
    def is_monolithic() -> bool:
        return False

    @abstractmethod
    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: ExpertTokensMetadata | None,
        activation: MoEActivation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(workspace13, workspace2, output) shapes."""

    def workspace_dtype(self, act_dtype: torch.dtype) -> torch.dtype:
        return act_dtype

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce: ...

    @abstractmethod
    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        """Compute the experts of ``topk_ids`` (global ids; ``expert_map``
        maps them to local ones, -1 for other ranks') into ``output``."""


class FusedMoEKernel:
    """A prepare/finalize and a modular experts implementation, run together."""

    def __init__(
        self,
        prepare_finalize: FusedMoEPrepareAndFinalizeModular,
        fused_experts: FusedMoEExpertsModular,
    ):
        if not isinstance(prepare_finalize, FusedMoEPrepareAndFinalizeModular) or (
            not isinstance(fused_experts, FusedMoEExpertsModular)
        ):
            raise ValueError(
                "this tree runs modular kernels only, got "
                f"{type(prepare_finalize).__name__} and {type(fused_experts).__name__}"
            )
        self._prepare_finalize = prepare_finalize
        self._fused_experts = fused_experts

    @property
    def prepare_finalize(self) -> FusedMoEPrepareAndFinalizeModular:
        return self._prepare_finalize

    @property
    def fused_experts(self) -> FusedMoEExpertsModular:
        return self._fused_experts

    @property
    def moe_config(self) -> FusedMoEConfig:
        return self._fused_experts.moe_config

    @property
    def is_monolithic(self) -> bool:
        return False

    def apply(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        shared_experts: object = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[M, K] hidden states routed by ``topk_ids`` (global expert ids)
        -> [M, K] output (a new tensor)."""
        experts = self._fused_experts
        a1q, a1q_scale, tokens_meta, ids, weights = self._prepare_finalize.prepare(
            hidden_states,
            topk_weights,
            topk_ids,
            global_num_experts,
            expert_map,
            apply_router_weight_on_input,
            experts.quant_config,
            defer_input_quant=experts.expects_unquantized_inputs,
        )
        ids = topk_ids if ids is None else ids
        weights = topk_weights if weights is None else weights
        m, k = hidden_states.shape
        ws13, ws2, out_shape = experts.workspace_shapes(
            m,
            w1.shape[1],
            k,
            ids.shape[1],
            global_num_experts,
            experts.moe_config.num_local_experts,
            tokens_meta,
            activation,
        )
        dtype = experts.workspace_dtype(hidden_states.dtype)
        device = hidden_states.device
        workspace13 = torch.empty(ws13, dtype=dtype, device=device)
        workspace2 = torch.empty(ws2, dtype=dtype, device=device)
        fused_out = torch.empty(out_shape, dtype=hidden_states.dtype, device=device)
        experts.apply(
            fused_out,
            a1q,
            w1,
            w2,
            weights,
            ids,
            activation,
            global_num_experts,
            expert_map,
            a1q_scale,
            None,
            workspace13,
            workspace2,
            tokens_meta,
            apply_router_weight_on_input,
        )
        output = torch.empty((m, k), dtype=hidden_states.dtype, device=device)
        self._prepare_finalize.finalize(
            output,
            fused_out,
            weights,
            ids,
            apply_router_weight_on_input,
            experts.finalize_weight_and_reduce_impl(),
        )
        return output

    __call__ = apply
