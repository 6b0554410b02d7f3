# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A MoE layer's state dict carries its preparation layout (``_extra_state``)
beside the tensors, and is checked against it before anything is copied."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    get_prep_state,
    record_prepared,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    nvfp4_moe_param_specs,
)

__all__ = ["adopt_extra_state", "layout_extra_state", "state_dict_problem"]

_EXTRA_STATE_FORMAT = 1


def layout_extra_state(layer: torch.nn.Module) -> dict:
    """A ``FusedMoE``'s ``get_extra_state()``: whether its bytes are prepared,
    how w13 is ordered, what is folded into the block scales, whether it is
    torn. RuntimeError for a layer whose preparation or restore is
    unfinished."""
    state = get_prep_state(layer)
    with state.lock:
        if state.status in (PrepStatus.PREPARING, PrepStatus.RESTORING):
            raise RuntimeError(
                "state_dict() of a MoE layer whose preparation or restore was "
                "interrupted: call process_weights_after_loading first"
            )
        return {
            "format": _EXTRA_STATE_FORMAT,
            "status": state.status.value,
            "w13_loaded_as_w3w1": bool(layer.w13_loaded_as_w3w1),
            "load_w3w1": state.load_w3w1,
            "moe_backend": layer.moe_backend,
            "global_scale_mode": _global_scale_mode(layer),
            "folds": {k: v.clone() for k, v in state.folds.items()},
            "global_scales": {k: v.clone() for k, v in state.global_scales.items()},
            "torn": {k: v.clone() for k, v in state.torn.items()},
            "torn_reason": state.torn_reason,
        }


def adopt_extra_state(layer: torch.nn.Module, extra: dict) -> None:
    """Take over the layout of a state dict whose parameters were just copied
    into ``layer`` (checked by :func:`state_dict_problem` first)."""
    state = get_prep_state(layer)
    layer.w13_loaded_as_w3w1 = extra["w13_loaded_as_w3w1"]
    state.load_w3w1 = extra["load_w3w1"]
    state.folds = {k: v.clone() for k, v in extra["folds"].items()}
    state.global_scales = {k: v.clone() for k, v in extra["global_scales"].items()}
    state.torn = {k: v.clone() for k, v in extra["torn"].items()}
    state.torn_reason = extra["torn_reason"]
    state.writes_since_prepared = False
    if state.status is PrepStatus.PREPARED:
        layer.quant_method.experts.bind_prepared(layer)
        record_prepared(state, layer)


def _global_scale_mode(layer: torch.nn.Module) -> str | None:
    return getattr(layer.quant_method, "global_scale_mode", None)


def state_dict_problem(layer: torch.nn.Module, state_dict, prefix: str) -> str | None:
    """Why ``state_dict`` cannot be loaded into ``layer`` (nothing is written
    then), or None: no layout saved, a prepared state dict into a layer
    that is not prepared (or prepared for another backend or mode), a
    tensor missing or of another shape or dtype."""
    state = get_prep_state(layer)
    extra = state_dict.get(prefix + "_extra_state")
    if not isinstance(extra, dict) or extra.get("format") != _EXTRA_STATE_FORMAT:
        return (
            "the state dict carries no preparation layout (_extra_state): "
            "whether its bytes are prepared cannot be told, so it is refused"
        )
    status = extra.get("status")
    if status not in ("loading", "prepared"):
        return f"unknown layout status {status!r}"
    if status == "prepared":
        mine = {
            "moe_backend": layer.moe_backend,
            "global_scale_mode": _global_scale_mode(layer),
        }
        for key, value in mine.items():
            if extra[key] != value:
                return f"prepared with {key} {extra[key]!r}, this layer has {value!r}"
        if state.status is not PrepStatus.PREPARED:
            return (
                "a prepared state dict loads only into a prepared layer (its "
                "bytes are in the kernel layout): call process_weights_after_"
                "loading on this layer first, or save the state dict before "
                "preparing"
            )
    specs = nvfp4_moe_param_specs(layer.moe_config) if status == "loading" else {}
    for name, param in layer.named_parameters(recurse=False):
        t = state_dict.get(prefix + name)
        if t is None:
            return f"{prefix + name} is missing"
        shape, dtype = specs.get(name, (tuple(param.shape), param.dtype))
        if (tuple(t.shape), t.dtype) != (tuple(shape), dtype):
            return (
                f"{prefix + name} is {t.dtype} {tuple(t.shape)}, expected "
                f"{dtype} {tuple(shape)}"
            )
    return None
