# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The NVFP4 MoE parameters as the weight loader writes them (the load
layout): names, shapes, dtypes, their first data, the checks of it, and the
way back to it: the layout's exact inverse, or, from bytes that cannot be
trusted, new parameters of its shapes (:func:`restore_or_reset`,
:func:`reset_load_layout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    blockscale_storage_for_swizzle,
)
from vllm.model_executor.utils import replace_parameter

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

logger = init_logger(__name__)

__all__ = [
    "REQUIRED_SUFFIXES",
    "RestorableLayout",
    "check_load_layout",
    "expert_param_specs",
    "failed_restore_reason",
    "restore_or_reset",
    "has_storage_room",
    "load_layout_data",
    "load_layout_ok",
    "nvfp4_moe_param_specs",
    "record_storage_room",
    "reload_slots",
    "reset_load_layout",
    "w13_rows",
]


class RestorableLayout(Protocol):
    """What the way back needs of a kernel layout (``B12xW4A4Weights``,
    ``B12xW4A16Weights``): the layer's config, whether it pads the block
    scales, and its exact inverse."""

    moe_config: FusedMoEConfig
    swizzles_block_scales: bool

    def restore_load_layout(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> None: ...


#: Parameters a complete reload must write, per prefix (``w13_``, ``w2_``):
#: input scales are optional in checkpoints (b12x quantizes dynamically).
REQUIRED_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


def w13_rows(moe: FusedMoEConfig) -> int:
    """Rows of one expert's fused FC1 weight: 2I gated, I otherwise."""
    return moe.w13_num_shards * moe.intermediate_size_per_partition


def nvfp4_moe_param_specs(
    moe: FusedMoEConfig,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of a layer's NVFP4 parameters in the load
    layout, for a ``FusedMoEConfig`` ``moe`` (rows = 2I gated, I otherwise)."""
    e, h = moe.num_local_experts, moe.hidden_dim
    i = moe.intermediate_size_per_partition
    groups = moe.w13_num_shards
    rows = w13_rows(moe)
    return {
        "w13_weight": ((e, rows, h // 2), torch.uint8),
        "w13_weight_scale": ((e, rows, h // 16), torch.float8_e4m3fn),
        "w13_weight_scale_2": ((e, groups), torch.float32),
        "w13_input_scale": ((e, groups), torch.float32),
        "w2_weight": ((e, h, i // 2), torch.uint8),
        "w2_weight_scale": ((e, h, i // 16), torch.float8_e4m3fn),
        "w2_weight_scale_2": ((e,), torch.float32),
        "w2_input_scale": ((e,), torch.float32),
    }


def expert_param_specs(
    moe: FusedMoEConfig,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The :func:`nvfp4_moe_param_specs` the b12x experts read and rewrite
    (this rank's experts). ``w13_weight_scale_2`` holds one global scale per
    shard ([E, 2] gated: w1's and w3's in load order); input scales are not
    listed: the kernel quantizes its input itself."""
    specs = nvfp4_moe_param_specs(moe)
    return {n: s for n, s in specs.items() if not n.endswith("_input_scale")}


def record_storage_room(state: MoEWeightPrepState, name: str, t: torch.Tensor) -> None:
    """Record in ``state`` that ``t``'s storage was made with room for the
    padded (swizzled) block scales of parameter ``name``."""
    s = t.untyped_storage()
    state.padded_storage[name] = (s.data_ptr(), s.nbytes())


def has_storage_room(state: MoEWeightPrepState, name: str, t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is the one recorded with room for ``name``."""
    s = t.untyped_storage()
    return state.padded_storage.get(name) == (s.data_ptr(), s.nbytes())


def load_layout_data(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    swizzles_block_scales: bool,
    state: MoEWeightPrepState,
) -> torch.Tensor:
    """New data for parameter ``name`` in the load layout (on the current
    default device): block scales a swizzling backend prepares get storage
    with room for the swizzled, padded scales (recorded in ``state``, so the
    preparation swizzles in place whatever the shape); float32 global and
    input scales are 1 (a checkpoint may omit input scales: b12x quantizes
    activations dynamically); everything else 0."""
    if name.endswith("_weight_scale") and swizzles_block_scales:
        data = blockscale_storage_for_swizzle(*shape)
        record_storage_room(state, name, data)
        return data
    if dtype == torch.float32:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def reload_slots(moe: FusedMoEConfig) -> dict[str, tuple[int, int]]:
    """Name -> (experts, row groups) of the slots a complete reload writes:
    one per expert and shard (w1 / w3 of w13, w2) of each required
    parameter (:data:`REQUIRED_SUFFIXES`)."""
    groups = moe.w13_num_shards
    return {
        f"{prefix}_{suffix}": (moe.num_local_experts, groups if prefix == "w13" else 1)
        for prefix in ("w13", "w2")
        for suffix in REQUIRED_SUFFIXES
    }


def _layout_problems(layer: torch.nn.Module, moe: FusedMoEConfig) -> list[str]:
    problems = []
    for name, (shape, dtype) in expert_param_specs(moe).items():
        t = getattr(layer, name, None)
        if t is None:
            problems.append(f"{name} is missing")
        elif t.dtype != dtype or tuple(t.shape) != shape:
            problems.append(
                f"{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}"
            )
    return problems


def load_layout_ok(layer: torch.nn.Module, moe: FusedMoEConfig) -> bool:
    """Whether every parameter the experts read has its load-layout shape
    and dtype."""
    return not _layout_problems(layer, moe)


def check_load_layout(layer: torch.nn.Module, moe: FusedMoEConfig) -> None:
    """ValueError naming each parameter whose shape or dtype is not the load
    layout's (e.g. replaced, or converted by ``layer.to(dtype)``)."""
    problems = _layout_problems(layer, moe)
    if problems:
        raise ValueError(
            f"cannot prepare the MoE layer: {'; '.join(problems)}. Load the "
            "weights again through the layer's weight_loader, which restores "
            "the load layout"
        )


def failed_restore_reason(err: Exception) -> str:
    """Log a restore that failed with ``err``; the reason the reset records."""
    logger.warning(
        "restoring the MoE layer's load layout failed (%s); the layer needs a "
        "complete reload",
        err,
    )
    return f"restoring the load layout failed: {err}"


def reset_load_layout(
    weights: RestorableLayout,
    layer: torch.nn.Module,
    state: MoEWeightPrepState,
    reason: str,
) -> None:
    """The load layout's shapes and dtypes, whatever the bytes; the layer is
    torn (``reason``): every slot must be written again before it is
    prepared. A block scale whose storage has room keeps it."""
    for name, (shape, dtype) in nvfp4_moe_param_specs(weights.moe_config).items():
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            continue  # a method that keeps its input scales elsewhere
        if param.dtype == dtype and tuple(param.shape) == shape:
            continue
        with torch.device(param.device):
            if (
                name.endswith("_weight_scale")
                and weights.swizzles_block_scales
                and param.dtype == dtype
                and has_storage_room(state, name, param)
            ):
                data = torch.empty(0, dtype=dtype).set_(
                    param.untyped_storage(), 0, shape
                )
            else:
                data = load_layout_data(
                    name, shape, dtype, weights.swizzles_block_scales, state
                )
        replace_parameter(layer, name, data)
    if state.load_w3w1 is not None:
        layer.w13_loaded_as_w3w1 = state.load_w3w1
    state.begin(PrepStatus.LOADING)
    state.undo, state.folds, state.global_scales = [], {}, {}
    state.fingerprints, state.checksums = {}, {}
    state.writes_since_prepared = False
    state.loader_writes = set()
    state.mark_torn(reload_slots(weights.moe_config), reason)


def restore_or_reset(
    weights: RestorableLayout, layer: torch.nn.Module, state: MoEWeightPrepState
) -> None:
    """Return a PREPARED layer, or resume a RESTORING one (an interrupted
    restore), to the load layout in place: the layout's exact inverse of
    the steps done; or, where a loader wrote into the layer since its
    preparation began or the inverse fails, :func:`reset_load_layout`
    (torn). The layer is LOADING after it. Holds the layer's lock."""
    with state.lock:
        if state.loader_writes:
            why = (
                "parameters changed after the preparation: "
                f"{sorted(state.loader_writes)}"
            )
        else:
            why = ""
            try:
                weights.restore_load_layout(layer, state)
            except Exception as err:  # noqa: BLE001 - the layer is reset, torn
                why = failed_restore_reason(err)
        if why:
            reset_load_layout(weights, layer, state, why)
