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
* ``weight_loader`` on a layer that is not LOADING first completes what was
  started and returns the layer to the load layout (in place, bounded), so
  new weights land where a fresh layer would have them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
)

__all__ = ["MoEWeightPrepState", "PrepStatus", "get_prep_state"]


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
        padded_storage: scale parameter name -> (storage data pointer, bytes)
            of a storage made with room for the swizzled, padded scales. A
            record, checked against the parameter before it is used: a
            parameter replaced by the caller loses it.
        versions: parameter name -> ``tensor._version`` when the
            preparation finished; a change means the parameters were written
            outside ``weight_loader`` (see :meth:`check_unchanged`).
    """

    status: PrepStatus = PrepStatus.LOADING
    done: list[str] = field(default_factory=list)
    progress: dict[str, ChunkProgress] = field(default_factory=dict)
    padded_storage: dict[str, tuple[int, int]] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def begin(self, status: PrepStatus) -> None:
        """Enter PREPARING or RESTORING from the opposite resting state."""
        self.status = status
        self.done = []
        self.progress = {}

    def progress_of(self, step: str) -> ChunkProgress:
        return self.progress.setdefault(step, ChunkProgress())

    def record_storage_room(self, name: str, t: torch.Tensor) -> None:
        """Record that ``t``'s storage was made with room for padded scales."""
        s = t.untyped_storage()
        self.padded_storage[name] = (s.data_ptr(), s.nbytes())

    def has_storage_room(self, name: str, t: torch.Tensor) -> bool:
        s = t.untyped_storage()
        return self.padded_storage.get(name) == (s.data_ptr(), s.nbytes())

    def record_versions(self, layer: torch.nn.Module) -> None:
        self.versions = {n: p._version for n, p in layer.named_parameters()}

    def check_unchanged(self, layer: torch.nn.Module) -> None:
        """RuntimeError if a prepared layer's parameters were written in place
        other than through ``weight_loader`` (e.g. ``param.copy_``): their
        bytes are then in the load layout while the layer says prepared."""
        changed = [
            n
            for n, p in layer.named_parameters()
            if n in self.versions and p._version != self.versions[n]
        ]
        if changed:
            raise RuntimeError(
                f"parameters {changed} of a prepared MoE layer were modified in "
                "place after its preparation; load new weights through "
                "FusedMoE.weight_loader (or NVFP4MoECheckpoint.load_layer), which "
                "returns the layer to its load layout first, then call "
                "process_weights_after_loading again"
            )


def get_prep_state(layer: torch.nn.Module) -> MoEWeightPrepState:
    """``layer.weight_prep_state``, created (LOADING) on first use."""
    state = getattr(layer, "weight_prep_state", None)
    if state is None:
        state = MoEWeightPrepState()
        layer.weight_prep_state = state
    return state
