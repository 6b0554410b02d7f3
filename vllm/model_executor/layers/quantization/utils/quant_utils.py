# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quantization keys (what a kernel supports) and activation-scale reduction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "GroupShape",
    "QuantKey",
    "ScaleDesc",
    "amax_for_moe_activation_quant",
    "kNvfp4Dynamic",
    "kNvfp4Static",
]


@dataclass(frozen=True)
class GroupShape:
    """Elements a scale covers: (rows, cols); -1 is the whole dimension."""

    row: int
    col: int


@dataclass(frozen=True)
class ScaleDesc:
    """A scale: its dtype, static (from the checkpoint) or dynamic, its group."""

    dtype: torch.dtype
    static: bool
    group_shape: GroupShape


@dataclass(frozen=True)
class QuantKey:
    """A quantization type: data type, its scale, an optional second scale."""

    dtype: torch.dtype
    scale: ScaleDesc
    scale2: ScaleDesc | None = None
    symmetric: bool = True


_PER_TENSOR = GroupShape(-1, -1)
_STATIC_TENSOR_SCALE = ScaleDesc(torch.float32, True, _PER_TENSOR)

#: NVFP4 weights: static FP8 block scales of 16 and a static global scale.
kNvfp4Static = QuantKey(
    torch.uint8,
    scale=ScaleDesc(torch.float8_e4m3fn, True, GroupShape(1, 16)),
    scale2=_STATIC_TENSOR_SCALE,
)
#: NVFP4 activations: block scales computed at run time, a static global one.
kNvfp4Dynamic = QuantKey(
    torch.uint8,
    scale=ScaleDesc(torch.float8_e4m3fn, False, GroupShape(1, 16)),
    scale2=_STATIC_TENSOR_SCALE,
)


def amax_for_moe_activation_quant(
    a_scale: torch.Tensor, enable_eplb: bool
) -> torch.Tensor:
    """One activation scale for all experts: the largest (a 0-d float32
    tensor). Expert load balancing, which needs it reduced across ranks, is
    not supported here (NotImplementedError)."""
    if enable_eplb:
        raise NotImplementedError("expert load balancing is not in this tree")
    return a_scale.max().to(torch.float32)
