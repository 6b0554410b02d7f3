# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The step machinery every b12x weight layout's preparation shares: the
runner that records each step in the layer's
:class:`~vllm.model_executor.layers.fused_moe.weight_prep_state.MoEWeightPrepState`,
in an explicit order, and the way back to the load layout::

    run_preparation_steps(layer, state, weights[, name])  (the guard around
    it: weight_prep_guard.guarded_preparation)
      1. a PREPARED layer: nothing to do
      2. LOADING: its load layout checked; RESTORING: the restore finished
         first (nvfp4_moe_load_layout.restore_or_reset)
      3. not torn: the layout's first step (it validates), then PREPARING
      4. the layout's steps not yet done, in order (``name``: that step
         only, once its predecessor is done)
      5. the last one done: PREPARED

    restore_load_layout(weights, layer, state):  exact (the layout's own
      inverse of each step done, after the step in flight is finished), or
      reset_load_layout (torn) when the bytes cannot be trusted

Each layout keeps its steps beside their inverses
(``experts/flashinfer_b12x_w4a4.py``, ``experts/flashinfer_b12x_w4a16.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    changed_parameters,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    RestorableLayout,
    check_load_layout,
    failed_restore_reason,
    load_layout_ok,
    reset_load_layout,
    restore_or_reset,
)

__all__ = [
    "PrepStep",
    "WeightLayout",
    "refill_binding",
    "restore_load_layout",
    "run_preparation_steps",
]


#: A named preparation step.
PrepStep = tuple[str, Callable[[], None]]


class WeightLayout(RestorableLayout, Protocol):
    """What the runner needs of a layout (``B12xW4A4Weights``,
    ``B12xW4A16Weights``): its steps in order and its exact inverse.
    ``restore_completes_preparation``: the inverse needs an interrupted
    preparation completed first (else only the step in flight is finished)."""

    restore_completes_preparation: bool

    def preparation_steps(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> list[PrepStep]: ...


def refill_binding(old: Any, new: Any, layer: torch.nn.Module) -> Any:
    """``new`` (a layout's binding: a dataclass of the kernel's views and the
    tensors derived from the weights), with each derived tensor copied into
    ``old``'s tensor of the same field, shape, dtype and device, so that the
    addresses a captured CUDA graph holds stay valid; views of a parameter
    are at their address already."""
    if not dataclasses.is_dataclass(new) or isinstance(new, type):
        return new  # not a binding (a dataclass instance)
    if type(old) is not type(new):
        return new
    params = {p.untyped_storage().data_ptr() for p in layer.parameters(recurse=False)}
    kept = {}
    for f in dataclasses.fields(new):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        if b.untyped_storage().data_ptr() in params:
            continue
        if (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device):
            kept[f.name] = a.copy_(b)
    return dataclasses.replace(new, **kept) if kept else new


# -- the way there ---------------------------------------------------------------
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
    layer PREPARED. A LOADING layer's load layout is checked first (a
    ValueError leaves it loadable and untouched), a RESTORING one is first
    brought back to it (``restore_or_reset``); a torn one is refused.

    ``name``: run that one step only (a benchmark times them one by one this
    way), recorded the same way; ValueError for an unknown step,
    RuntimeError when the step before it is not done (nothing runs then).
    Holds the layer's lock; the guard around it:
    ``weight_prep_guard.guarded_preparation``."""
    steps = weights.preparation_steps(layer, state)
    names = [n for n, _ in steps]
    # Read once: no torch call (a tensor attribute is one) between a step's
    # last write and its record, where an interrupt could land.
    device = layer.w13_weight.device
    with state.lock:
        if name is not None:
            _check_order(state, names, name)
        if state.status is PrepStatus.PREPARED:
            return
        if state.status is PrepStatus.LOADING:
            check_load_layout(layer, weights.moe_config)
        elif state.status is PrepStatus.RESTORING:
            restore_or_reset(weights, layer, state)
        if state.status is PrepStatus.LOADING:
            # The first step validates; the layer stays LOADING until it is
            # done, so its ValueError leaves the layer loadable.
            state.check_not_torn()
            first, validate = steps[0]
            validate()
            state.load_w3w1 = bool(getattr(layer, "w13_loaded_as_w3w1", False))
            state.mark_done(first, device, begin=PrepStatus.PREPARING)
        for n, fn in steps:
            if n not in state.done and name in (None, n):
                fn()
                state.mark_done(n, device)
        if names[-1] in state.done:
            state.status = PrepStatus.PREPARED
            state.plans = {}
            state.writes_since_prepared = False


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
        if state.status is PrepStatus.PREPARING:
            try:
                if weights.restore_completes_preparation:
                    run_preparation_steps(layer, state, weights)
                else:
                    _finish_started_step(layer, state, weights)
            except Exception as err:  # noqa: BLE001 - the layer is reset, torn
                reset_load_layout(weights, layer, state, failed_restore_reason(err))
                return
        restore_or_reset(weights, layer, state)
