# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Parameter helpers the quantization methods use (vLLM's names and semantics)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["replace_parameter", "set_weight_attrs"]


def set_weight_attrs(weight: torch.Tensor, weight_attrs: dict[str, Any] | None) -> None:
    """Set each of ``weight_attrs`` as an attribute of ``weight``
    (TypeError/ValueError... none: an attribute already set is an error)."""
    if weight_attrs is None:
        return
    for key, value in weight_attrs.items():
        if hasattr(weight, key):
            raise ValueError(f"overwriting existing tensor attribute: {key}")
        setattr(weight, key, value)


def replace_parameter(
    layer: torch.nn.Module, param_name: str, new_tensor: torch.Tensor | None
) -> None:
    """Make ``new_tensor`` the data of ``layer``'s parameter ``param_name``,
    keeping the Parameter object: copied into it when shape, stride, dtype and
    device match (a tensor that is the parameter's own data is left as is),
    else ``.data`` is rebound. Registers a new parameter where there is none;
    None sets the attribute to None."""
    if new_tensor is None:
        setattr(layer, param_name, None)
        return
    if isinstance(new_tensor, torch.nn.Parameter):
        new_tensor = new_tensor.data
    old = getattr(layer, param_name, None)
    if isinstance(old, torch.nn.Parameter):
        if (
            old.shape == new_tensor.shape
            and old.stride() == new_tensor.stride()
            and old.dtype == new_tensor.dtype
            and old.device == new_tensor.device
        ):
            old.data.copy_(new_tensor)
        else:
            old.data = new_tensor
        return
    setattr(layer, param_name, torch.nn.Parameter(new_tensor, requires_grad=False))
