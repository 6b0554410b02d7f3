# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The modular MoE kernel: prepare/finalize (communication) + experts (compute).

::

    FusedMoEKernel.forward(x, topk_weights, topk_ids)
      -> prepare_finalize.prepare(...)     # single device: nothing to do
      -> experts.apply(...)                # the expert GEMMs
      -> prepare_finalize.finalize(...)    # single device: nothing to do

An experts implementation also owns the weight layout it needs:
``process_weights_after_loading(layer)`` turns the checkpoint layout of the
layer's parameters into the kernel's, once, after loading.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)

__all__ = [
    "FusedMoEExperts",
    "FusedMoEKernel",
    "FusedMoEPrepareAndFinalize",
    "MoEPrepareAndFinalizeNoEP",
    "Support",
]


@dataclass(frozen=True)
class Support:
    """Answer of a capability predicate: truthy when supported, else a reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls) -> Support:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


class FusedMoEPrepareAndFinalize(ABC):
    """Moves tokens to the experts and results back (all-to-all under EP)."""

    @abstractmethod
    def prepare(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Returns the (hidden_states, topk_weights, topk_ids) the experts see."""

    @abstractmethod
    def finalize(self, expert_output: torch.Tensor) -> torch.Tensor:
        """Returns the layer output [T, H] from the experts' output."""


class MoEPrepareAndFinalizeNoEP(FusedMoEPrepareAndFinalize):
    """Single device: tokens are already where the experts are."""

    def prepare(self, hidden_states, topk_weights, topk_ids):
        return hidden_states, topk_weights, topk_ids

    def finalize(self, expert_output):
        return expert_output


class FusedMoEExperts(ABC):
    """Base class of expert implementations.

    Subclasses answer the capability predicates (each returns a
    :class:`Support` with a reason when the answer is no), prepare the
    layer's weights once in ``process_weights_after_loading`` and compute in
    ``apply``.
    """

    #: Backend name used by ``FusedMoE(moe_backend=...)``.
    name: str = ""
    #: Whether the kernel wants gated FC1 weights as [w3; w1] (up first).
    wants_w3w1: bool = False
    #: Whether the preparation swizzles the FP8 block scales (128x4): the
    #: scale parameters are then created with room for the padded result.
    swizzles_block_scales: bool = False

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        self.moe_config = moe_config
        self.quant_config = quant_config

    # -- capability predicates ------------------------------------------------
    @classmethod
    @abstractmethod
    def is_supported_device(cls, device: torch.device) -> Support: ...

    @classmethod
    @abstractmethod
    def supports_quant_scheme(cls, quant_dtype: str) -> Support: ...

    @classmethod
    @abstractmethod
    def supports_activation(cls, activation: MoEActivation) -> Support: ...

    @classmethod
    def supports_expert_parallel(cls) -> bool:
        """Whether ``apply`` accepts local expert ids with -1 for experts held
        by other ranks, producing this rank's partial output."""
        return False

    @classmethod
    def check_supported(
        cls, moe: FusedMoEConfig, quant_dtype: str, device: torch.device
    ) -> None:
        """Raise ValueError listing every reason ``cls`` cannot run here."""
        answers = [
            cls.is_supported_device(device),
            cls.supports_quant_scheme(quant_dtype),
            cls.supports_activation(moe.activation),
        ]
        reasons = [a.reason for a in answers if not a]
        if reasons:
            raise ValueError(
                f"MoE backend {cls.name!r} cannot run here: " + "; ".join(reasons)
            )

    # -- weights and compute --------------------------------------------------
    @abstractmethod
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Rearrange ``layer``'s loaded parameters for this kernel, once."""

    @abstractmethod
    def apply(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Expert computation: [T, H] in, [T, H] out (top-k weighted sum)."""


class FusedMoEKernel:
    """A prepare/finalize and an experts implementation, run together."""

    def __init__(
        self, prepare_finalize: FusedMoEPrepareAndFinalize, experts: FusedMoEExperts
    ):
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    def forward(
        self,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        x, weights, ids = self.prepare_finalize.prepare(
            hidden_states, topk_weights, topk_ids
        )
        out = self.experts.apply(x, w1, w2, weights, ids)
        return self.prepare_finalize.finalize(out)

    __call__ = forward
