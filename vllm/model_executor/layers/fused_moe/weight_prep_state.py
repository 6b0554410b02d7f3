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
* **Guard.** Writes that bypass the loader into a PREPARED layer are
  refused at ``forward`` and at a re-preparation
  (:mod:`~vllm.model_executor.layers.fused_moe.weight_prep_guard`; the
  records are fields here).

The steps themselves and their runner:
:mod:`~vllm.model_executor.layers.fused_moe.weight_prep_steps`; the layout
a state dict carries: :mod:`~vllm.model_executor.layers.fused_moe.
weight_prep_state_dict`.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
)

__all__ = [
    "MoEWeightPrepState",
    "PrepStatus",
    "get_prep_state",
    "wait_for_step",
]


def wait_for_step(device: torch.device) -> None:
    """Synchronize ``device`` if it is CUDA (else a no-op), once at the end
    of a step before it is recorded done: a step recorded done has run to
    the end, and an asynchronous error is raised by the step it belongs to."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrepStatus(enum.Enum):
    LOADING = "loading"  # load layout; weight_loader writes here
    PREPARING = "preparing"  # some preparation steps done (maybe interrupted)
    PREPARED = "prepared"  # kernel layout; forward may run
    RESTORING = "restoring"  # returning to the load layout (maybe interrupted)


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
        checksums: parameter name -> ``weight_prep_guard.weight_checksum`` when
            prepared
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
            attribute (``weight_prep_guard.guard_weight_loaders``) wrote
            into while the layer was not in the load layout: their bytes
            are not the layout the state describes.
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

    # -- steps -----------------------------------------------------------------
    def begin(self, status: PrepStatus) -> None:
        """Enter PREPARING, RESTORING or LOADING: a new list of steps."""
        self.status = status
        self.done = []
        self.progress = {}
        self.plans = {}

    def mark_done(
        self, step: str, device: torch.device, begin: PrepStatus | None = None
    ) -> None:
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
        return any(
            k.split(".")[0] == prefix and p.done > 0 for k, p in self.progress.items()
        )

    def record_storage_room(self, name: str, t: torch.Tensor) -> None:
        """Record that ``t``'s storage was made with room for padded scales."""
        s = t.untyped_storage()
        self.padded_storage[name] = (s.data_ptr(), s.nbytes())

    def has_storage_room(self, name: str, t: torch.Tensor) -> bool:
        s = t.untyped_storage()
        return self.padded_storage.get(name) == (s.data_ptr(), s.nbytes())

    # -- torn reloads ----------------------------------------------------------
    def mark_torn(self, slots: dict[str, tuple[int, int]], reason: str) -> None:
        """Every slot of ``slots`` (name -> (experts, row groups)) must be
        written again before the layer may be prepared."""
        self.torn = {
            n: torch.ones(shape, dtype=torch.bool) for n, shape in slots.items()
        }
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
