# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The preparation state of a MoE layer's weights: what has been done to them.

The weight preparation rewrites the loaded parameters in place, so the layer
itself must know which layout its bytes are in::

    LOADING  --process_weights_after_loading-->  PREPARING  -->  PREPARED
       ^          (each step recorded when done;      |              |
       |           an interrupted step keeps its      |  weight_loader (reload)
       |           ChunkProgress and resumes)         v              v
       +------------------------------------------  RESTORING  <-----+
                 (back to the load layout, in place, resumable)

* A second ``process_weights_after_loading`` on a PREPARED layer is a no-op.
* After an exception, ``process_weights_after_loading`` resumes: steps done
  are skipped, the interrupted one continues from its last whole chunk.
* ``weight_loader`` on a layer that is not LOADING returns it to the load
  layout first (in place, bounded): a step started is finished, the steps
  done are undone, a step never started is not run (so a preparation that
  failed cannot block a reload).
* One lock per layer (:attr:`MoEWeightPrepState.lock`, re-entrant): the
  preparation, the restore, ``weight_loader``, ``load_state_dict`` and the
  experts' ``apply`` hold it, so they never interleave on one layer.
* **Torn.** A reload that fails after writing part of the layer (a bad
  scale in expert 3, an interrupt), or a layer whose bytes can no longer be
  trusted (parameters replaced or converted, e.g. ``layer.to(bf16)``), is
  *torn*: preparing it is refused until every (expert, row group) slot of
  every required parameter has been written again (:meth:`mark_torn`).
* **Guard.** A PREPARED layer records each parameter's fingerprint (storage,
  offset, shape, strides, dtype, ``_version``) and, with
  ``VLLM_MOE_PREP_VERIFY=1``, a checksum of its bytes; writes that bypass
  the loader are refused at ``forward`` and at a re-preparation. A
  parameter's own ``weight_loader`` attribute (vLLM's ``RoutedExperts``
  loader, which writes ``param.data[...]``: no version counter moves) is
  wrapped by :func:`guard_weight_loaders`: a write through it into a layer
  that is not in the load layout is recorded and refused the same way.
"""

from __future__ import annotations

import enum
import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    blockscale_storage_for_swizzle,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
    env_int,
)

__all__ = [
    "REQUIRED_SUFFIXES",
    "MoEWeightPrepState",
    "PrepStatus",
    "adopt_extra_state",
    "get_prep_state",
    "guard_weight_loaders",
    "layout_extra_state",
    "load_layout_data",
    "nvfp4_moe_param_specs",
    "reload_slots",
    "state_dict_problem",
    "wait_for_step",
    "weight_checksum",
]

#: Parameters a complete reload must write, per prefix (``w13_``, ``w2_``):
#: input scales are optional in checkpoints (b12x quantizes dynamically).
REQUIRED_SUFFIXES = ("weight", "weight_scale", "weight_scale_2")

# 2^16 - 15, the largest prime below 2^16: position weights of the checksum.
_CHECKSUM_MOD = 65521
_CHECKSUM_CHUNK = 1 << 16


def wait_for_step(device: torch.device) -> None:
    """Wait, once at the end of a step, until the device has finished it.

    On CUDA a chunk's copies are only queued when its progress is recorded;
    an asynchronous error (or a failure of the device) would surface at some
    later call. Synchronizing here, before the step is recorded done, means
    a step recorded done has run to the end, and an error is raised by the
    step it belongs to. Once per step, not per chunk: chunks stay queued
    back to back. (An interrupted step resumes from recorded chunks, which
    the stream runs in order before anything queued after them.)"""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrepStatus(enum.Enum):
    LOADING = "loading"  # load layout; weight_loader writes here
    PREPARING = "preparing"  # some preparation steps done (maybe interrupted)
    PREPARED = "prepared"  # kernel layout; forward may run
    RESTORING = "restoring"  # returning to the load layout (maybe interrupted)


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


def _fingerprint(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device, t._version)  # fmt: skip


@dataclass
class MoEWeightPrepState:
    """Bookkeeping of one layer's preparation (``layer.weight_prep_state``).

    Attributes:
        status: see :class:`PrepStatus`.
        done: names of the steps completed in the current direction
            (preparing or restoring), in order.
        progress: chunk progress of each started step, by step name.
        undo: the preparation steps done when the restore began (what the
            restore must undo).
        load_w3w1: whether w13 rows were [w3; w1] when the preparation began
            (the load layout a restore returns to); None before any.
        padded_storage: scale parameter name -> (storage data pointer, bytes)
            of a storage made with room for the swizzled, padded scales. A
            record, checked against the parameter before it is used: a
            parameter replaced by the caller loses it.
        fingerprints: parameter name -> fingerprint when the preparation
            finished (storage, offset, shape, strides, dtype, ``_version``).
        checksums: parameter name -> :func:`weight_checksum` when prepared
            (only with ``VLLM_MOE_PREP_VERIFY=1``).
        folds: block-scale parameter name -> [E, G] float32 factor folded
            into its FP8 values (absent: 1). In the load layout the global
            scale parameters always hold the values as loaded.
        global_scales: global-scale parameter name -> [E, G] values as
            loaded, kept while the prepared parameter holds something else
            (1 after a fold, the alpha): the restore puts them back.
        plans: transient per-step data a resumed step must reuse.
        torn: parameter name -> bool [E, G], True for slots that must be
            written again before the layer may be prepared; empty when whole.
        torn_reason: why the layer is torn.
        writes_since_prepared: weight_loader wrote since the last
            preparation (a failure then tears the layer).
        loader_writes: names of parameters a guarded ``weight_loader``
            attribute (:func:`guard_weight_loaders`) wrote into while the
            layer was not in the load layout: their bytes are not the
            layout the state describes.
        lock: the layer's re-entrant lock (not copied: a copy gets its own).
    """

    status: PrepStatus = PrepStatus.LOADING
    done: list[str] = field(default_factory=list)
    progress: dict[str, ChunkProgress] = field(default_factory=dict)
    undo: list[str] = field(default_factory=list)
    load_w3w1: bool | None = None
    padded_storage: dict[str, tuple[int, int]] = field(default_factory=dict)
    fingerprints: dict[str, tuple | None] = field(default_factory=dict)
    checksums: dict[str, tuple[int, int]] = field(default_factory=dict)
    folds: dict[str, torch.Tensor] = field(default_factory=dict)
    global_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    plans: dict[str, Any] = field(default_factory=dict)
    torn: dict[str, torch.Tensor] = field(default_factory=dict)
    torn_reason: str = ""
    writes_since_prepared: bool = False
    loader_writes: set[str] = field(default_factory=set)
    lock: Any = field(default_factory=threading.RLock, repr=False, compare=False)
    #: small facts a preparation records for its later steps and for the
    #: way back (W4A16: the scale exponents, taken before the scales are
    #: rewritten, and the rotation), by the experts' own keys
    values: dict[str, Any] = field(default_factory=dict)

    # -- copies (copy.deepcopy, pickle, torch.save) ----------------------------
    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d.pop("lock", None)  # a lock cannot be copied; the copy makes its own
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self.lock = threading.RLock()

    def copy_facts(self, layer: torch.nn.Module) -> dict:
        """What a faithful copy of ``layer`` may take over: which scale
        storages have recorded room, and whether the prepared bytes are
        untouched (checked on the original, before it is copied)."""
        room = [n for n in self.padded_storage
                if self.has_storage_room(n, getattr(layer, n))]  # fmt: skip
        clean = self.status is not PrepStatus.PREPARED or not self.changed(layer)
        return {"room": room, "clean": clean}

    def after_copy(self, layer: torch.nn.Module, facts: dict) -> None:
        """Re-key the records on the copy's own storages (see copy_facts)."""
        self.padded_storage = {}
        for n in facts["room"]:
            self.record_storage_room(n, getattr(layer, n))
        if self.status is PrepStatus.PREPARED:
            if facts["clean"]:
                self.record_prepared(layer)
            else:  # modified before the copy: the copy refuses like the original
                self.fingerprints = dict.fromkeys(self.fingerprints)

    # -- steps -----------------------------------------------------------------
    def begin(self, status: PrepStatus) -> None:
        """Enter PREPARING, RESTORING or LOADING: a new list of steps."""
        self.status = status
        self.done = []
        self.progress = {}
        self.plans = {}

    def mark_done(self, step: str, device: torch.device,
                  begin: PrepStatus | None = None) -> None:  # fmt: skip
        """Record ``step`` done, once the device has finished it
        (:func:`wait_for_step`): preparation and restore steps alike.
        ``begin``: enter that status (a new list of steps) after the wait
        and before the record, so a device error raised by the wait leaves
        the status as it was."""
        wait_for_step(device)
        if begin is not None:
            self.begin(begin)
        self.done.append(step)

    def progress_of(self, step: str) -> ChunkProgress:
        return self.progress.setdefault(step, ChunkProgress())

    def started(self, prefix: str) -> bool:
        """Whether any chunk of a step whose progress key starts with
        ``prefix`` was done."""
        return any(k.split(".")[0] == prefix and p.done > 0
                   for k, p in self.progress.items())  # fmt: skip

    def record_storage_room(self, name: str, t: torch.Tensor) -> None:
        """Record that ``t``'s storage was made with room for padded scales."""
        s = t.untyped_storage()
        self.padded_storage[name] = (s.data_ptr(), s.nbytes())

    def has_storage_room(self, name: str, t: torch.Tensor) -> bool:
        s = t.untyped_storage()
        return self.padded_storage.get(name) == (s.data_ptr(), s.nbytes())

    # -- the guard of a prepared layer -------------------------------------------
    def record_prepared(self, layer: torch.nn.Module) -> None:
        """Fingerprint (and with VLLM_MOE_PREP_VERIFY, checksum) every
        parameter of a layer just prepared."""
        params = dict(layer.named_parameters())
        self.fingerprints = {n: _fingerprint(p) for n, p in params.items()}
        self.checksums = (
            {n: weight_checksum(p) for n, p in params.items()}
            if env_int("VLLM_MOE_PREP_VERIFY", 0)
            else {}
        )

    def changed(self, layer: torch.nn.Module) -> dict[str, str]:
        """Parameter name -> how it changed since the preparation finished."""
        out = {
            n: "written through its weight_loader after the preparation began"
            for n in sorted(self.loader_writes)
        }
        params = dict(layer.named_parameters())
        for n, fp in self.fingerprints.items():
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
        if env_int("VLLM_MOE_PREP_VERIFY", 0):
            for n, want in self.checksums.items():
                if n not in out and n in params and weight_checksum(params[n]) != want:
                    out[n] = "modified in place (bytes differ: param.data.copy_?)"
        return out

    def check_unchanged(self, layer: torch.nn.Module) -> None:
        """RuntimeError if a prepared layer's parameters were written or
        replaced other than through ``weight_loader`` (``param.copy_``,
        ``param.data = ...``; ``param.data.copy_`` with
        ``VLLM_MOE_PREP_VERIFY=1``): their bytes are then not what the
        kernel's views describe while the layer says prepared."""
        changed = self.changed(layer)
        if changed:
            what = ", ".join(f"{n} {how}" for n, how in changed.items())
            raise RuntimeError(
                f"parameters of a prepared MoE layer were modified in place or "
                f"replaced after its preparation ({what}); load new weights through "
                "FusedMoE.weight_loader (or NVFP4MoECheckpoint.load_layer), which "
                "returns the layer to its load layout first, or call the experts' "
                "restore_load_layout(layer) before loading through another "
                "weight_loader, then call process_weights_after_loading again"
            )

    # -- torn reloads ----------------------------------------------------------
    def mark_torn(self, slots: dict[str, tuple[int, int]], reason: str) -> None:
        """Every slot of ``slots`` (name -> (experts, row groups)) must be
        written again before the layer may be prepared."""
        self.torn = {n: torch.ones(shape, dtype=torch.bool)
                     for n, shape in slots.items()}  # fmt: skip
        self.torn_reason = reason

    def clear_slot(self, name: str, expert: int, group: int) -> None:
        """A slot was written (a whole shard of one expert)."""
        mask = self.torn.get(name)
        if mask is None:
            return
        mask[expert, group] = False
        if not any(bool(m.any()) for m in self.torn.values()):
            self.torn, self.torn_reason = {}, ""

    def check_not_torn(self) -> None:
        """RuntimeError naming what is missing when the layer is torn."""
        if not self.torn:
            return
        missing = []
        for n, m in self.torn.items():
            experts = sorted({int(e) for e in m.nonzero()[:, 0]})
            if experts:
                shown = experts[:8] + (["..."] if len(experts) > 8 else [])
                missing.append(f"{n} of local experts {shown}")
        raise RuntimeError(
            f"the MoE layer is torn ({self.torn_reason}): its weights are a mix "
            "of two loads or cannot be trusted, so it is not prepared until a "
            "complete reload through FusedMoE.weight_loader (or load_state_dict) "
            f"has written again: {'; '.join(missing)}"
        )


def get_prep_state(layer: torch.nn.Module) -> MoEWeightPrepState:
    """``layer.weight_prep_state``, created (LOADING) on first use."""
    state = getattr(layer, "weight_prep_state", None)
    if state is None:
        state = MoEWeightPrepState()
        layer.weight_prep_state = state
    return state


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
    """A parameter's ``weight_loader`` that records writes into a layer that
    is not in the load layout (see :func:`guard_weight_loaders`). An object
    rather than a closure, so that a copy of the layer (``copy.deepcopy``,
    pickling) gets a loader of its own copy: its fields are copied with it,
    as a bound method of the layer would be."""

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
                # A loader that restored the load layout first (this tree's
                # FusedMoE) leaves the layer LOADING; one that wrote into a
                # prepared layer (vLLM's, through param.data) does not.
                if state.status is not PrepStatus.LOADING:
                    state.loader_writes.add(name)
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
    """Wrap the ``weight_loader`` attribute of each of ``layer``'s own
    parameters (once) so that a write through it while the layer is not in
    the load layout (PREPARING, PREPARED, RESTORING) is recorded in
    ``state.loader_writes``: ``check_unchanged`` (the forward's guard and a
    re-preparation) then refuses the layer, and a restore resets it (torn)
    instead of undoing the preparation on mixed bytes. Writes into a torn
    layer in the load layout clear their (expert, shard) slot. vLLM's own
    loaders write ``param.data[...]``, which moves no version counter; the
    wrapper keeps the loader's signature (``functools.wraps``), as vLLM's
    layerwise reload reads it."""
    for name, param in layer.named_parameters(recurse=False):
        loader = getattr(param, "weight_loader", None)
        if loader is None or getattr(loader, "_moe_prep_guarded", False):
            continue
        param.weight_loader = _GuardedWeightLoader(layer, name, loader)


def nvfp4_moe_param_specs(moe) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of a layer's NVFP4 parameters in the load
    layout, for a ``FusedMoEConfig`` ``moe`` (rows = 2I gated, I otherwise)."""
    e, h = moe.num_local_experts, moe.hidden_dim
    i = moe.intermediate_size_per_partition
    groups = moe.w13_num_shards
    rows = groups * i
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


def load_layout_data(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                     swizzles_block_scales: bool,
                     state: MoEWeightPrepState) -> torch.Tensor:  # fmt: skip
    """New data for parameter ``name`` in the load layout (on the current
    default device): block scales a swizzling backend prepares get storage
    with room for the swizzled, padded scales (recorded in ``state``, so the
    preparation swizzles in place whatever the shape); float32 global and
    input scales are 1 (a checkpoint may omit input scales: b12x quantizes
    activations dynamically); everything else 0."""
    if name.endswith("_weight_scale") and swizzles_block_scales:
        data = blockscale_storage_for_swizzle(*shape)
        state.record_storage_room(name, data)
        return data
    if dtype == torch.float32:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def reload_slots(moe) -> dict[str, tuple[int, int]]:
    """Name -> (experts, row groups) of the slots a complete reload writes:
    one per expert and shard (w1 / w3 of w13, w2) of each required
    parameter (:data:`REQUIRED_SUFFIXES`)."""
    groups = moe.w13_num_shards
    return {
        f"{prefix}_{suffix}": (moe.num_local_experts, groups if prefix == "w13" else 1)
        for prefix in ("w13", "w2")
        for suffix in REQUIRED_SUFFIXES
    }


# -- state dicts: the layout travels with the tensors ----------------------------

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
        state.record_prepared(layer)


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
        mine = {"moe_backend": layer.moe_backend,
                "global_scale_mode": _global_scale_mode(layer)}  # fmt: skip
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
