# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weight reload of layers prepared in place (``layer.weight_prep_state``).

The b12x NVFP4 MoE experts rewrite a layer's parameters into the kernel's
layout in their own storage and record each step. A reload must not let a
checkpoint loader write into that layout, nor rerun the preparation on a
layer whose record says it is done:

* direct: ``check_prepared_reload(model)``, among ``begin_direct_reload``'s
  checks, refuses a prepared layer that cannot be brought back exactly
  (the model untouched); ``begin_prepared_reload(model, direct=True)``,
  once the reload began, brings each back to the load layout in place
  (the experts' ``restore_load_layout``); the loaders write in place and
  the finish's ``process_weights_after_loading`` prepares again in the
  same storage.
  ``finish_prepared_reload(model)``, after it, binds the new experts with
  the previous binding (``bind_prepared(layer, previous=...)``, which
  refills the derived alphas and scales into the previous tensors), so
  every address a captured CUDA graph holds stays valid.
* layerwise (``begin_prepared_reload(model, direct=False)``, from
  ``initialize_layerwise_reload``): the layer's kernel tensors are set
  aside by the reload and new ones materialized in the load layout, so the
  layer starts a new preparation record; ``finish_prepared_reload(model)``,
  from ``finalize_layerwise_reload``, re-keys that record and the experts'
  views on the kernel tensors the processed values were copied into.

Layers without a preparation record are not touched.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    after_copy,
    get_prep_state,
    unchanged_problem,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)

logger = init_logger(__name__)

__all__ = ["begin_prepared_reload", "check_prepared_reload", "finish_prepared_reload"]

# Attributes the reload keeps on a prepared layer between begin and finish.
_BEFORE = "_prepared_reload_before"
# The row order of the layer's w13 bytes ([w3; w1] when True): the experts'
# preparation records it on the layer.
_ORDER = "w13_loaded_as_w3w1"


def _experts(layer: torch.nn.Module) -> Any | None:
    """The experts that prepared ``layer`` (its quant method's modular
    kernel's), or None."""
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return experts if hasattr(experts, "restore_load_layout") else None


def _prepared_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module.__dict__.get("weight_prep_state"), MoEWeightPrepState)
    ]


def _direct_problem(layer: torch.nn.Module, experts: Any | None) -> str | None:
    """Why ``layer`` cannot be brought back to its load layout exactly, or
    None."""
    state = get_prep_state(layer)
    if state.status is PrepStatus.LOADING:
        return None  # the load layout already (a torn layer is rewritten whole)
    if experts is None:
        return "its preparation record has no experts to restore it"
    if getattr(experts, "effective_global_scale_mode", "alpha") == "fold":
        return (
            "its block scales hold the folded global scales (b12x global scale "
            "mode 'fold'), which a loader writing part of the layer would mix "
            "with the checkpoint's; reload with VLLM_RELOAD_MODE=layerwise"
        )
    # Prepared: anything moved since (the guard's refusal); an interrupted
    # preparation or restore: the writes its record saw.
    return unchanged_problem(state, layer)


def check_prepared_reload(model: torch.nn.Module) -> None:
    """RuntimeError naming the layer and the reason (for a layer whose
    parameters moved since its preparation, the guard's message) when a
    direct reload cannot bring a prepared layer of ``model`` back to its
    load layout exactly; changes nothing."""
    for name, layer in _prepared_layers(model):
        if problem := _direct_problem(layer, _experts(layer)):
            raise RuntimeError(f"direct reload: {name or 'model'}: {problem}")


def begin_prepared_reload(model: torch.nn.Module, *, direct: bool) -> int:
    """Make every prepared layer of ``model`` loadable for a weight reload
    (see the module doc); returns how many layers it changed. Direct: run
    :func:`check_prepared_reload` first (a layer it would refuse is torn
    here, and RuntimeError names it)."""
    layers = _prepared_layers(model)
    mode = "direct" if direct else "layerwise"
    changed = 0
    for name, layer in layers:
        state, experts = get_prep_state(layer), _experts(layer)
        order = layer.__dict__.get(_ORDER)
        before = (state, experts, _binding(experts), order)
        if direct:
            if state.status is PrepStatus.LOADING:
                continue
            if experts is None:  # check_prepared_reload refuses it
                raise RuntimeError(
                    f"{mode} reload: {name or 'model'}: its preparation record "
                    "has no experts to restore it"
                )
            experts.restore_load_layout(layer)
            if state.status is not PrepStatus.LOADING or state.torn:
                raise RuntimeError(
                    f"{mode} reload: {name or 'model'}: restoring the load "
                    f"layout left the layer {state.status.value}"
                    + (f" and torn ({state.torn_reason})" if state.torn else "")
                )
        else:
            # New tensors will be materialized in the load layout (rows in
            # the order the loader writes them) and prepared: a new record.
            state.ready = False  # apply refuses until the finish
            layer.weight_prep_state = MoEWeightPrepState()
            if state.load_w3w1 is not None:
                layer.__dict__[_ORDER] = state.load_w3w1
        layer.__dict__[_BEFORE] = before
        changed += 1
    if changed:
        logger.info("%s reload: %d prepared layers made loadable", mode, changed)
    return changed


def _binding(experts: Any | None) -> Any | None:
    return None if experts is None else getattr(experts, "prepared", None)


def _rekey(layer: torch.nn.Module, state: MoEWeightPrepState) -> None:
    """A record made on the materialized tensors, now on the kernel tensors
    the layerwise reload copied the processed values into."""
    room = list(state.padded_storage)
    after_copy(state, layer, {"room": room, "clean": True})


def finish_prepared_reload(model: torch.nn.Module) -> int:
    """After a reload's processing: each layer :func:`begin_prepared_reload`
    changed is bound again at the addresses it had (see the module doc);
    returns how many. A layer whose new record is not prepared (nothing was
    loaded into it) keeps its previous record and views."""
    done = 0
    for _, layer in _prepared_layers(model):
        before = layer.__dict__.pop(_BEFORE, None)
        if before is None:
            continue
        old_state, old_experts, old_binding, order = before
        state, experts = get_prep_state(layer), _experts(layer)
        if state.status is not PrepStatus.PREPARED or experts is None:
            if state is not old_state and state.status is PrepStatus.LOADING:
                # Nothing was reprocessed: the kernel tensors are the old ones.
                layer.weight_prep_state = old_state
                if order is not None:
                    layer.__dict__[_ORDER] = order
            continue
        if state is not old_state:
            _rekey(layer, state)
        # The derived tensors into the previous ones (their addresses).
        experts.bind_prepared(layer, previous=old_binding)
        done += 1
    return done
