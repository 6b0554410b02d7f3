# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The guard of a prepared MoE layer, kept at the events that change weights.

The experts' ``apply`` tests one flag (``state.ready``); nothing is walked
per call, so a captured CUDA graph and an eager call are guarded alike. The
flag is set by :func:`record_prepared` (the end of a preparation, a copy, a
prepared state dict) and cleared by every event that can change a prepared
layer's weights, each of which refuses or repairs the layer there:

* preparation and re-preparation (:func:`guarded_preparation`): a layer
  whose parameters moved since :func:`record_prepared` is refused;
* a guarded ``weight_loader`` (:func:`guard_weight_loaders`) writing into a
  layer that is not LOADING: refused at the write, with that message;
* ``load_state_dict``: the layout is checked first, the bytes are copied in
  place and recorded again;
* a weight reload: the direct one refuses, before any byte changes and with
  that message, a layer whose parameters moved, then restores the load
  layout in place; the layerwise one prepares new tensors and copies them
  into the kernel's;
* ``.to()`` (``Module._apply``): :func:`note_converted`; the next ``apply``
  checks once, refusing a layer whose parameters were converted.

What no event sees: a write through ``param.data`` (``param.data.copy_``,
``param.data = ...``) or an in-place op on a parameter after the preparation,
outside vLLM's loaders, is not seen by ``apply``; the next event above
refuses it (``VLLM_MOE_PREP_VERIFY=1`` adds checksums of the bytes to those
checks, so that even ``param.data.copy_`` is refused there). vLLM writes
weights through these events only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator

import torch

import vllm.envs as envs
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    has_storage_room,
    record_storage_room,
)

__all__ = [
    "after_copy",
    "changed_parameters",
    "check_unchanged",
    "copy_facts",
    "get_prep_state",
    "guard_weight_loaders",
    "guarded_preparation",
    "note_converted",
    "record_prepared",
    "unchanged_problem",
    "weight_checksum",
]


def get_prep_state(layer: torch.nn.Module) -> MoEWeightPrepState:
    """``layer.weight_prep_state``, created (LOADING) on first use."""
    state = getattr(layer, "weight_prep_state", None)
    if state is None:
        state = MoEWeightPrepState()
        layer.weight_prep_state = state
    return state


@contextlib.contextmanager
def guarded_preparation(layer: torch.nn.Module) -> Iterator[MoEWeightPrepState]:
    """Hold ``layer``'s lock while it is prepared, and yield its record.

    On entry: its parameters' ``weight_loader`` guarded
    (:func:`guard_weight_loaders`), and a layer prepared before, or one a
    loader wrote into since its preparation began, refused when its
    parameters changed (:func:`check_unchanged`). When the block ends with
    the layer PREPARED and not yet recorded: :func:`record_prepared` (the
    experts' ``apply`` may then run unchecked). Not on an exception.
    """
    state = get_prep_state(layer)
    guard_weight_loaders(layer)
    with state.lock:
        if state.status is PrepStatus.PREPARED or (
            state.loader_writes and state.status is PrepStatus.PREPARING
        ):
            # A PREPARING one: resuming would run the remaining steps on a
            # mix of layouts.
            check_unchanged(state, layer)
        yield state
        if state.status is PrepStatus.PREPARED and not state.ready:
            record_prepared(state, layer)


# 2^16 - 15, the largest prime below 2^16: position weights of the checksum.
_CHECKSUM_MOD = 65521
_CHECKSUM_CHUNK = 1 << 16


def weight_checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum of bytes, position-weighted sum of bytes) of ``t``: a permutation
    of rows or halves changes the second. Bounded memory: chunks of 64 Ki
    bytes (about 1.5 MiB of int64 transients)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    plain = weighted = 0
    for start in range(0, flat.numel(), _CHECKSUM_CHUNK):
        chunk = flat[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=chunk.device)
        plain += int(chunk.sum())
        weighted += int((chunk * (pos % _CHECKSUM_MOD + 1)).sum())
    return plain, weighted


def _version(t: torch.Tensor) -> int | None:
    # An inference tensor (made under torch.inference_mode) has no version
    # counter: reading it raises. Its in-place writes are seen at events only.
    return None if t.is_inference() else t._version


def _fingerprint(t: torch.Tensor) -> tuple:
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
        _version(t),
    )


def record_prepared(state: MoEWeightPrepState, layer: torch.nn.Module) -> None:
    """Fingerprint (and with VLLM_MOE_PREP_VERIFY, checksum) every
    parameter of a layer just prepared, into ``state``; ``apply`` may run
    unchecked from now (``state.ready``) until an event clears it."""
    params = dict(layer.named_parameters())
    state.fingerprints = {n: _fingerprint(p) for n, p in params.items()}
    state.checksums = (
        {n: weight_checksum(p) for n, p in params.items()}
        if envs.VLLM_MOE_PREP_VERIFY
        else {}
    )
    state.ready = True


def changed_parameters(
    state: MoEWeightPrepState, layer: torch.nn.Module
) -> dict[str, str]:
    """Parameter name -> how it changed since the preparation finished."""
    out = {
        n: "written through its weight_loader after the preparation began"
        for n in sorted(state.loader_writes)
    }
    params = dict(layer.named_parameters())
    for n, fp in state.fingerprints.items():
        if n in out:
            continue
        p = params.get(n)
        if p is None or fp is None:
            out[n] = "replaced"
            continue
        now = _fingerprint(p)
        if now[:6] != fp[:6]:
            out[n] = "replaced (param.data = ..., .to(), ...)"
        elif now[6] != fp[6]:
            out[n] = "modified in place"
    if envs.VLLM_MOE_PREP_VERIFY:
        for n, want in state.checksums.items():
            if n not in out and n in params and weight_checksum(params[n]) != want:
                out[n] = "modified in place (bytes differ: param.data.copy_?)"
    return out


def unchanged_problem(state: MoEWeightPrepState, layer: torch.nn.Module) -> str | None:
    """The refusal :func:`check_unchanged` raises, or None."""
    changed = changed_parameters(state, layer)
    if not changed:
        return None
    what = ", ".join(f"{n} {how}" for n, how in changed.items())
    return (
        f"parameters of a prepared MoE layer were modified in place or "
        f"replaced after its preparation ({what}); load new weights through "
        "FusedMoE.weight_loader (or NVFP4MoECheckpoint.load_layer), which "
        "returns the layer to its load layout first, or call the experts' "
        "restore_load_layout(layer) before loading through another "
        "weight_loader, then call process_weights_after_loading again"
    )


def check_unchanged(state: MoEWeightPrepState, layer: torch.nn.Module) -> None:
    """RuntimeError naming the parameters of a prepared layer written or
    replaced other than through ``weight_loader`` (``param.copy_``,
    ``param.data = ...``; ``param.data.copy_`` with VLLM_MOE_PREP_VERIFY=1).
    Run at the events (see the module doc), never per forward call."""
    problem = unchanged_problem(state, layer)
    if problem:
        state.ready = False
        raise RuntimeError(problem)


def note_converted(layer: torch.nn.Module) -> None:
    """``Module._apply`` (``.to()``, ``.half()``, ...) ran on ``layer``: the
    next ``apply`` checks the parameters once (:func:`check_unchanged`:
    refused when a conversion replaced them, accepted again otherwise)."""
    state = layer.__dict__.get("weight_prep_state")
    if isinstance(state, MoEWeightPrepState):
        state.ready = False


def copy_facts(state: MoEWeightPrepState, layer: torch.nn.Module) -> dict:
    """What a faithful copy of ``layer`` may take over: which scale
    storages have recorded room, and whether the prepared bytes are
    untouched (checked on the original, before it is copied)."""
    room = [
        n for n in state.padded_storage if has_storage_room(state, n, getattr(layer, n))
    ]
    clean = state.status is not PrepStatus.PREPARED or not changed_parameters(
        state, layer
    )
    return {"room": room, "clean": clean}


def after_copy(state: MoEWeightPrepState, layer: torch.nn.Module, facts: dict) -> None:
    """Re-key the records on the copy's own storages (see copy_facts)."""
    state.padded_storage = {}
    for n in facts["room"]:
        record_storage_room(state, n, getattr(layer, n))
    if state.status is PrepStatus.PREPARED:
        if facts["clean"]:
            record_prepared(state, layer)
        else:  # modified before the copy: the copy refuses like the original
            state.fingerprints = dict.fromkeys(state.fingerprints)
            state.ready = False


def _slot_of(layer: torch.nn.Module, name: str, bound) -> tuple[int, int] | None:
    """(local expert, row group) a ``weight_loader(param, loaded_weight,
    weight_name, shard_id, expert_id, ...)`` call writes, or None."""
    args = bound.arguments
    shard, expert = args.get("shard_id"), args.get("expert_id")
    if not isinstance(expert, int) or shard not in ("w1", "w2", "w3"):
        return None
    to_local = getattr(layer, "_map_global_expert_id_to_local_expert_id", None)
    local = to_local(expert) if to_local is not None else expert
    if local is None or local < 0:
        return None
    first = "w3" if get_prep_state(layer).load_w3w1 else "w1"
    group = 0 if shard in ("w2", first) or not name.startswith("w13_") else 1
    return local, group


class _GuardedWeightLoader:
    """A parameter's ``weight_loader`` recording writes outside the load
    layout (:func:`guard_weight_loaders`). An object, not a closure, so that
    a copy of the layer (deepcopy, pickle) gets a loader of its own copy."""

    _moe_prep_guarded = True

    def __init__(self, layer: torch.nn.Module, name: str, loader: Callable):
        self.layer, self.name, self.loader = layer, name, loader
        # __wrapped__ (the loader), its name and doc: vLLM's layerwise
        # reload reads the loader's signature, which inspect finds through
        # __wrapped__.
        functools.update_wrapper(self, loader)

    def __call__(self, *args, **kwargs):
        layer, name, loader = self.layer, self.name, self.loader
        state = get_prep_state(layer)
        with state.lock:  # never beside a preparation, restore or forward
            try:
                result = loader(*args, **kwargs)
            finally:
                # A loader that restored the load layout first leaves the
                # layer LOADING; one that wrote into a prepared layer (through
                # param.data) does not.
                if state.status is not PrepStatus.LOADING:
                    state.loader_writes.add(name)
                    state.ready = False
            if state.loader_writes and state.status is not PrepStatus.LOADING:
                # Refused at the write: apply (and a captured graph) would
                # read a mix of layouts.
                check_unchanged(state, layer)
            if state.torn and result is not False:
                try:
                    bound = inspect.signature(loader).bind(*args, **kwargs)
                    slot = _slot_of(layer, name, bound)
                except TypeError:
                    slot = None
                if slot is not None:
                    state.clear_slot(name, *slot)
        return result


def guard_weight_loaders(layer: torch.nn.Module) -> None:
    """Wrap the ``weight_loader`` of each of ``layer``'s own parameters (once):
    a write through it while the layer is not LOADING is recorded in
    ``state.loader_writes`` (vLLM's loaders write ``param.data[...]``, which
    moves no version counter) and refused there (:func:`check_unchanged`
    raises at the write, and after it until a restore tears the layer); a
    write into a torn layer clears its (expert, shard) slot. The wrapper
    keeps the loader's signature."""
    for name, param in layer.named_parameters(recurse=False):
        loader = getattr(param, "weight_loader", None)
        if loader is None or getattr(loader, "_moe_prep_guarded", False):
            continue
        param.weight_loader = _GuardedWeightLoader(layer, name, loader)
