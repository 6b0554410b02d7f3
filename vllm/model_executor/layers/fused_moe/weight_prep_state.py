# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The preparation state of a MoE layer's weights: which layout its bytes are in::

    LOADING  --process_weights_after_loading-->  PREPARING  -->  PREPARED
       ^         (each step recorded when done;       |              |
       |          an interrupted one resumes)         |  weight_loader (reload)
       |                                              v              v
       +------------------------------------------  RESTORING  <-----+
                 (back to the load layout, in place, resumable)

One re-entrant lock per layer (``state.lock``, not copied: a copy gets its
own): the preparation, the restore, ``weight_loader``, ``load_state_dict``
and the experts' ``apply`` hold it. A *torn* layer is not prepared until
every slot is written again. The rules in full:
``docs/design/nvfp4_moe_weight_preparation.md``.
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
    "wait_for_step",
]


def wait_for_step(device: torch.device) -> None:
    """Synchronize ``device`` if it is the accelerator's (else a no-op): a
    step recorded done has finished, and its asynchronous errors are raised
    by it."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        torch.accelerator.synchronize(device)


class PrepStatus(enum.Enum):
    LOADING = "loading"  # load layout; weight_loader writes here
    PREPARING = "preparing"  # some preparation steps done (maybe interrupted)
    PREPARED = "prepared"  # kernel layout; forward may run
    RESTORING = "restoring"  # returning to the load layout (maybe interrupted)


@dataclass
class MoEWeightPrepState:
    """Bookkeeping of one layer's preparation (``layer.weight_prep_state``).

    Attributes:
        done: steps completed in the current direction, in order.
        progress: each started step's chunk progress, by step name.
        undo: the preparation steps done when the restore began.
        load_w3w1: w13 rows were [w3; w1] when the preparation began (the
            layout a restore returns to); None before any.
        padded_storage: scale name -> (storage data_ptr, nbytes) of a
            storage with room for the padded scales; stale once replaced
            (``nvfp4_moe_load_layout.record_storage_room``).
        fingerprints, checksums: name -> fingerprint, and checksum
            (``VLLM_MOE_PREP_VERIFY=1`` only), when prepared.
        folds: block-scale name -> [E, G] float32 factor folded into its FP8
            values (absent: 1).
        global_scales: global-scale name -> [E, G] values as loaded, while
            the prepared parameter holds another (1, the alpha).
        plans: per-step data a resumed step must reuse.
        torn: name -> bool [E, G], True for slots to write again; empty when whole.
        writes_since_prepared: weight_loader wrote since the last
            preparation (a failure then tears the layer).
        loader_writes: parameters a guarded ``weight_loader`` wrote outside
            the load layout (their bytes are not the recorded layout).
        values: facts a preparation records for its later steps and the
            restore (W4A16: scale exponents, rotation), by the experts' keys.
        ready: PREPARED and unchanged as far as the events saw (the guard,
            ``weight_prep_guard``): the experts' ``apply`` runs without a
            check; cleared by every status change and every event that can
            change the weights.

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
    values: dict[str, Any] = field(default_factory=dict)
    ready: bool = False

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d.pop("lock", None)  # a lock cannot be copied; the copy makes its own
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self.lock = threading.RLock()

    def begin(self, status: PrepStatus) -> None:
        """Enter PREPARING, RESTORING or LOADING: a new list of steps. The
        record of the last preparation (fingerprints, checksums) is dropped:
        the new steps rewrite the bytes it describes, so a check between
        them and the next record would refuse the layer's own writes."""
        self.ready = False
        self.fingerprints, self.checksums = {}, {}
        self.status = status
        self.done = []
        self.progress = {}
        self.plans = {}

    def mark_done(
        self, step: str, device: torch.device, begin: PrepStatus | None = None
    ) -> None:
        """Record ``step`` done after :func:`wait_for_step`. ``begin``: enter
        that status after the wait, so a device error leaves it unchanged."""
        wait_for_step(device)
        if begin is not None:
            self.begin(begin)
        self.done.append(step)

    def progress_of(self, step: str) -> ChunkProgress:
        return self.progress.setdefault(step, ChunkProgress())

    def started(self, prefix: str) -> bool:
        """Whether a chunk of step ``prefix`` (keys ``prefix[.*]``) was done."""
        return any(
            k.split(".")[0] == prefix and p.done > 0 for k, p in self.progress.items()
        )

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
