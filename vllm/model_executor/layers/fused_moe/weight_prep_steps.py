# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The step machinery every b12x weight layout's preparation shares: the
runner that records each step in the layer's
:class:`~vllm.model_executor.layers.fused_moe.weight_prep_state.MoEWeightPrepState`,
in an explicit order, and the way back to the load layout::

    run_preparation_steps(layer, state, weights[, name])
      1. a PREPARED layer: only checked (check_unchanged); done
      2. RESTORING: restore_load_layout first (an interrupted restore)
      3. LOADING: the layout's first step (it validates), then PREPARING
      4. the layout's steps not yet done, in order (``name``: that step
         only, once its predecessor is done)
      5. the last one done: PREPARED, recorded (record_prepared)

    restore_load_layout(weights, layer, state):  exact (the layout's own
      inverse of each step done, after the step in flight is finished), or
      reset_load_layout (torn) when the bytes cannot be trusted

Each layout keeps its steps beside their inverses
(``experts/flashinfer_b12x_w4a4.py``, ``experts/flashinfer_b12x_w4a16.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    changed_parameters,
    check_unchanged,
    record_prepared,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    check_load_layout,
    load_layout_data,
    load_layout_ok,
    nvfp4_moe_param_specs,
    reload_slots,
)
from vllm.model_executor.utils import replace_parameter

logger = init_logger(__name__)

__all__ = [
    "PrepStep",
    "WeightLayout",
    "check_global_scales",
    "reset_load_layout",
    "restore_load_layout",
    "run_preparation_steps",
]

#: A named preparation step.
PrepStep = tuple[str, Callable[[], None]]


class WeightLayout(Protocol):
    """What the runner needs of a layout (``B12xW4A4Weights``,
    ``B12xW4A16Weights``): its steps in order and its exact inverse.
    ``restore_completes_preparation``: the inverse needs an interrupted
    preparation completed first (else only the step in flight is finished)."""

    moe_config: FusedMoEConfig
    swizzles_block_scales: bool
    restore_completes_preparation: bool

    def preparation_steps(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> list[PrepStep]: ...

    def restore_load_layout(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> None: ...


# -- helpers the layouts' steps share ------------------------------------------
def check_global_scales(
    layer: torch.nn.Module,
    first_expert: int,
    suffixes: tuple[str, ...] = ("weight_scale_2",),
) -> None:
    """ValueError naming the parameter, expert and shard of a global scale
    (``{w13,w2}_{suffix}`` for each of ``suffixes``) that is not finite and
    positive (scales set in memory, not loaded)."""
    first = "w3" if getattr(layer, "w13_loaded_as_w3w1", False) else "w1"
    shards = {"w13": (first, "w1" if first == "w3" else "w3"), "w2": ("w2",)}
    for prefix in ("w13", "w2"):
        for suffix in suffixes:
            name = f"{prefix}_{suffix}"
            t = getattr(layer, name, None)
            if t is None:
                continue
            values = t.detach().float().reshape(t.shape[0], -1)  # [E, G], tiny
            bad = ~(torch.isfinite(values) & (values > 0))
            if bool(bad.any()):
                e, g = (int(i) for i in bad.nonzero()[0])
                shard = shards[prefix][g] if values.shape[1] > 1 else prefix
                raise ValueError(
                    f"{name} of expert {first_expert + e} ({shard}) is "
                    f"{values[e, g].item()}: global and input scales must be "
                    "finite and positive"
                )


# -- the way there ---------------------------------------------------------------
def _enter(layer, state, weights, steps, device) -> bool:
    """Bring ``layer`` to where a step may run; False for a PREPARED layer
    (only checked). From LOADING the first step (it validates) runs here,
    while the layer is still LOADING, so a ValueError leaves it loadable
    and untouched."""
    if state.status is PrepStatus.PREPARED:
        check_unchanged(state, layer)
        return False
    if state.loader_writes and state.status is PrepStatus.PREPARING:
        # Resuming would run the remaining steps on a mix of layouts.
        check_unchanged(state, layer)
    if state.status is PrepStatus.RESTORING:
        restore_load_layout(weights, layer, state)
    if state.status is PrepStatus.LOADING:
        state.check_not_torn()
        check_load_layout(layer, weights.moe_config)
        name, validate = steps[0]
        validate()
        state.load_w3w1 = bool(getattr(layer, "w13_loaded_as_w3w1", False))
        state.mark_done(name, device, begin=PrepStatus.PREPARING)
    return True


def _check_order(state, names: list[str], name: str) -> None:
    """ValueError for an unknown step; RuntimeError when the step before
    ``name`` is not done (the first step runs from the load layout, each
    other one after its predecessor)."""
    if name not in names:
        raise ValueError(f"unknown preparation step {name!r}; the steps are {names}")
    index = names.index(name)
    after = names[index - 1] if index > 0 else None
    if (
        after is not None
        and state.status is not PrepStatus.PREPARED
        and (state.status is not PrepStatus.PREPARING or after not in state.done)
    ):
        raise RuntimeError(
            f"preparation step {name!r} runs after {after!r}, which is not "
            f"done (status {state.status.value}, done: {state.done}); the "
            f"steps, in order: {names}"
        )


def run_preparation_steps(
    layer: torch.nn.Module,
    state: MoEWeightPrepState,
    weights: WeightLayout,
    name: str | None = None,
) -> None:
    """Run the steps of ``weights`` (the layer's layout) not yet done on
    ``layer``, in order, each at most once per preparation: a call after an
    exception resumes where the last one stopped. Each step is recorded once
    the device finished it (``state.mark_done``); the last one marks the
    layer PREPARED (``record_prepared``). A PREPARED layer is only checked
    (``check_unchanged``); a RESTORING one is first brought back to the load
    layout (:func:`restore_load_layout`).

    ``name``: run that one step only (a benchmark times them one by one this
    way), recorded the same way; ValueError for an unknown step,
    RuntimeError when the step before it is not done (nothing runs then).
    Holds the layer's lock."""
    steps = weights.preparation_steps(layer, state)
    names = [n for n, _ in steps]
    # Read once: no torch call (a tensor attribute is one) between a step's
    # last write and its record, where an interrupt could land.
    device = layer.w13_weight.device
    with state.lock:
        if name is not None:
            _check_order(state, names, name)
        if not _enter(layer, state, weights, steps, device):
            return
        for n, fn in steps:
            if n not in state.done and name in (None, n):
                fn()
                state.mark_done(n, device)
        if names[-1] in state.done:
            state.status = PrepStatus.PREPARED
            state.plans = {}
            state.writes_since_prepared = False
            record_prepared(state, layer)


def _finish_started_step(
    layer: torch.nn.Module, state: MoEWeightPrepState, weights: WeightLayout
) -> None:
    """Finish the step of an interrupted preparation that had started (its
    cap was accepted), recorded; a step never started is not run."""
    # Read once: nothing (not even a tensor attribute, a torch call that an
    # interrupt may hit) stands between a step's last write and its record.
    device = layer.w13_weight.device
    for name, step in weights.preparation_steps(layer, state):
        if name not in state.done:
            if state.started(name):
                step()
                state.mark_done(name, device)
            break


# -- the way back ----------------------------------------------------------------
def reset_load_layout(
    weights: WeightLayout, layer: torch.nn.Module, state: MoEWeightPrepState, reason
) -> None:
    """The load layout's shapes and dtypes, whatever the bytes; torn
    (``weights``: the layer's ``B12xW4A4Weights`` or ``B12xW4A16Weights``)."""
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
                and state.has_storage_room(name, param)
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


def restore_load_layout(
    weights: WeightLayout, layer: torch.nn.Module, state: MoEWeightPrepState
) -> None:
    """Return ``layer``, from any state, to the layout its weight loader
    writes: exactly (``weights.restore_load_layout``, the inverse of each
    step done, once the step of an interrupted preparation in flight is
    finished, or the whole preparation where the layout needs it) or,
    where the bytes cannot be trusted (parameters modified, replaced or
    converted since the preparation) or the exact restore fails,
    :func:`reset_load_layout` (torn). Holds the layer's lock."""
    with state.lock:
        if state.status is PrepStatus.LOADING:
            if not load_layout_ok(layer, weights.moe_config):
                reset_load_layout(
                    weights, layer, state, "parameters were replaced or converted"
                )
            return
        if state.status is PrepStatus.PREPARED:
            changed = changed_parameters(state, layer)
        else:  # an interrupted preparation or restore: loader writes only
            changed = {n: "written" for n in state.loader_writes}
        if changed:
            why = f"parameters changed after the preparation: {sorted(changed)}"
            reset_load_layout(weights, layer, state, why)
            return
        try:
            if state.status is PrepStatus.PREPARING:
                if weights.restore_completes_preparation:
                    run_preparation_steps(layer, state, weights)
                else:
                    _finish_started_step(layer, state, weights)
            weights.restore_load_layout(layer, state)
        except Exception as err:  # noqa: BLE001 - the layer is reset, torn
            logger.warning(
                "restoring the MoE layer's load layout failed (%s); the "
                "layer needs a complete reload",
                err,
            )
            reset_load_layout(
                weights, layer, state, f"restoring the load layout failed: {err}"
            )
