# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MoE expert activations: gated (SiLU) and non-gated (ReLU^2)."""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

__all__ = ["MoEActivation"]


class MoEActivation(enum.Enum):
    """Activation between the two expert GEMMs.

    ``SILU`` is gated: FC1 produces ``2I`` columns, ``[gate | up]`` in vLLM's
    (checkpoint) order, and the activation is ``silu(gate) * up`` -> ``I``.
    ``RELU2_NO_MUL`` is not gated: FC1 produces ``I`` columns and the
    activation is ``relu(x) ** 2`` (Nemotron-H).
    """

    SILU = "silu"
    RELU2_NO_MUL = "relu2"

    @property
    def is_gated(self) -> bool:
        return self is MoEActivation.SILU

    @property
    def flashinfer_name(self) -> str:
        """The ``activation`` string FlashInfer's MoE kernels take."""
        return self.value

    def fc1_rows(self, intermediate_size: int) -> int:
        """Rows of the fused FC1 weight for one expert: 2I if gated, else I."""
        return 2 * intermediate_size if self.is_gated else intermediate_size

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Apply to FC1 output ``x`` [..., 2I] ([gate | up]) or [..., I]."""
        if self is MoEActivation.SILU:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        return torch.square(F.relu(x))

    @classmethod
    def from_str(cls, name: str | MoEActivation) -> MoEActivation:
        if isinstance(name, MoEActivation):
            return name
        for act in cls:
            if name.lower() in (act.value, act.name.lower()):
                return act
        raise ValueError(
            f"unknown MoE activation {name!r}; expected one of {[a.value for a in cls]}"
        )
