# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MoE expert activations: gated (SiLU, GELU-tanh) and non-gated (ReLU^2)."""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

__all__ = ["MoEActivation"]


class MoEActivation(enum.Enum):
    """Activation between the two expert GEMMs (vLLM's names and values).

    Gated activations (``SILU``, ``GELU_TANH``): FC1 produces ``2I`` columns,
    ``[gate | up]`` in vLLM's (checkpoint) order, and the activation is
    ``act(gate) * up`` -> ``I``. ``RELU2_NO_MUL`` is not gated: FC1 produces
    ``I`` columns and the activation is ``relu(x) ** 2`` (Nemotron-H).
    """

    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    RELU2_NO_MUL = "relu2_no_mul"

    @property
    def is_gated(self) -> bool:
        return not self.value.endswith("_no_mul")

    def fc1_rows(self, intermediate_size: int) -> int:
        """Rows of the fused FC1 weight for one expert: 2I if gated, else I."""
        return 2 * intermediate_size if self.is_gated else intermediate_size

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Apply to FC1 output ``x`` [..., 2I] ([gate | up]) or [..., I]."""
        if self is MoEActivation.RELU2_NO_MUL:
            return torch.square(F.relu(x))
        gate, up = x.chunk(2, dim=-1)
        if self is MoEActivation.GELU_TANH:
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    @classmethod
    def from_str(cls, name: str | MoEActivation) -> MoEActivation:
        """By value (vLLM's), or by this tree's short names: "relu2" is the
        non-gated ReLU^2 (Nemotron-H's experts), "gelu_pytorch_tanh" GELU-tanh."""
        if isinstance(name, MoEActivation):
            return name
        name = _ALIASES.get(name.lower(), name.lower())
        for act in cls:
            if name in (act.value, act.name.lower()):
                return act
        raise ValueError(
            f"unknown MoE activation {name!r}; expected one of "
            f"{[a.value for a in cls] + sorted(_ALIASES)}"
        )


_ALIASES = {"relu2": "relu2_no_mul", "gelu_pytorch_tanh": "gelu_tanh"}
