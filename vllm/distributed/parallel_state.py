# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Process groups for tensor (and, over the same group, expert) parallelism.

The part of upstream vLLM's ``vllm.distributed.parallel_state`` this slice
needs, with its names, on ``torch.distributed`` process groups::

    init_distributed_environment(world_size=2, rank=r,
                                 distributed_init_method="tcp://host:port")
    initialize_model_parallel(tensor_model_parallel_size=2)
    get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    tensor_model_parallel_all_reduce(x)   # vllm.distributed.communication_op
    destroy_model_parallel(); destroy_distributed_environment()

Ranks [i * tp, (i + 1) * tp) form tensor-parallel group i. The backend
follows the device the ranks compute on (``backend_for_device``): NCCL for
CUDA, gloo otherwise, whatever hardware the host has, unless given.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "GroupCoordinator",
    "backend_for_device",
    "check_ranks_agree",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]


@dataclass
class GroupCoordinator:
    """One process group and this process's place in it.

    ``ranks`` are the global ranks of the group, ``rank_in_group`` this
    process's index among them; ``device_group`` is the
    ``torch.distributed`` group collectives run on.
    """

    ranks: list[int]
    rank: int
    device_group: dist.ProcessGroup | None
    backend: str

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, in place; returns ``x`` (a group
        of one returns it unchanged). Every rank must call it."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.device_group)
        return x

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length on all), in group order.
        Every rank must call it."""
        if self.world_size == 1:
            return [list(values)]
        device = "cuda" if self.backend == "nccl" else "cpu"
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.device_group)
        return [t.tolist() for t in out]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


def backend_for_device(device: torch.device | str | None = None) -> str:
    """The ``torch.distributed`` backend for ranks computing on ``device``
    (default: torch's default device): "nccl" for CUDA, "gloo" otherwise. A
    CPU job on a host that also has GPUs (``--device cpu --tp N``) uses gloo:
    NCCL would need the CPU tensors on a GPU."""
    device = torch.device(device if device is not None else torch.get_default_device())
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str | None = None,
    timeout: datetime.timedelta | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Join the default process group (``torch.distributed``) unless this
    process already has; sets the world group.

    ``world_size`` and ``rank`` of -1 are read by the init method (e.g. the
    ``WORLD_SIZE`` and ``RANK`` variables of ``env://``). ``backend``:
    default ``backend_for_device(device)``: NCCL when the ranks compute on
    CUDA, gloo otherwise (also on a GPU host). ``local_rank`` (the device
    index on this node) selects the CUDA device with NCCL; -1 means
    ``rank``. Raises ValueError for a rank outside the world.
    """
    global _WORLD
    if world_size < -1 or world_size == 0:
        raise ValueError(f"world_size must be >= 1 (or -1), got {world_size}")
    if rank < -1 or (world_size != -1 and not -1 <= rank < world_size):
        raise ValueError(f"rank must be in [0, {world_size}) (or -1), got {rank}")
    backend = backend or backend_for_device(device)
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            **kwargs,
        )
    backend = dist.get_backend()
    if backend == "nccl":
        torch.cuda.set_device(local_rank if local_rank != -1 else dist.get_rank())
    if _WORLD is None:
        _WORLD = GroupCoordinator(
            ranks=list(range(dist.get_world_size())),
            rank=dist.get_rank(),
            device_group=dist.group.WORLD,
            backend=backend,
        )


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError(
            "the distributed environment is not initialized: call "
            "init_distributed_environment first"
        )
    return _WORLD


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1, backend: str | None = None
) -> None:
    """Split the world into tensor-parallel groups of
    ``tensor_model_parallel_size`` consecutive ranks. Every rank must call
    it (each group is created by all ranks). Raises ValueError when the size
    does not divide the world, RuntimeError when already initialized."""
    global _TP
    world = get_world_group()
    tp = tensor_model_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_model_parallel_size must be >= 1, got {tp!r}")
    if world.world_size % tp != 0:
        raise ValueError(
            f"tensor_model_parallel_size {tp} does not divide the world size "
            f"{world.world_size}"
        )
    if _TP is not None:
        raise RuntimeError("tensor model parallel group is already initialized")
    # Every rank must split the world the same way (new_group below is
    # collective): a rank that asked for another size would hang or pair
    # the wrong ranks. One tiny all-gather over the world says so instead.
    sizes = [v[0] for v in world.all_gather_ints([tp])]
    if len(set(sizes)) != 1:
        raise ValueError(
            "initialize_model_parallel: the ranks disagree on "
            f"tensor_model_parallel_size: {_by_rank(sizes)}"
        )
    backend = backend or world.backend
    mine = None
    for start in range(0, world.world_size, tp):
        ranks = list(range(start, start + tp))
        # new_group is collective over the whole world: every rank creates
        # every group, and keeps its own.
        group = dist.new_group(ranks, backend=backend)
        if world.rank in ranks:
            mine = GroupCoordinator(ranks, world.rank, group, backend)
    _TP = mine


def _by_rank(values: list) -> str:
    return ", ".join(f"rank {r} has {v}" for r, v in enumerate(values))


def check_ranks_agree(what: str, values: dict[str, int]) -> None:
    """All-gather ``values`` over the tensor-parallel group and raise
    ValueError, on every rank, naming each key whose value differs between
    ranks. Keys starting with ``"rank:"`` are this rank's place instead:
    they must differ on every rank (no two ranks holding the same shard).
    Every rank of the group must call it, with the same keys; a group of
    one returns at once."""
    group = get_tp_group()
    keys = sorted(values)
    rows = group.all_gather_ints([int(values[k]) for k in keys])
    problems = []
    for i, key in enumerate(keys):
        column = [row[i] for row in rows]
        if key.startswith("rank:"):
            pairs = [
                tuple(row[j] for j, k in enumerate(keys) if k.startswith("rank:"))
                for row in rows
            ]
            if len(set(pairs)) != len(pairs) and key == min(
                k for k in keys if k.startswith("rank:")
            ):
                names = [k[5:] for k in keys if k.startswith("rank:")]
                problems.append(
                    f"two ranks hold the same shard ({'/'.join(names)}: "
                    f"{_by_rank(pairs)})"
                )
        elif len(set(column)) != 1:
            problems.append(f"{key}: {_by_rank(column)}")
    if problems:
        raise ValueError(
            f"{what}: the {group.world_size} tensor-parallel ranks built different "
            f"layers, so their results cannot be reduced: {'; '.join(problems)}"
        )


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError(
            "tensor model parallel group is not initialized: call "
            "initialize_model_parallel first"
        )
    return _TP


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in its tensor-parallel group."""
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    """The size of this process's tensor-parallel group."""
    return get_tp_group().world_size


def destroy_model_parallel() -> None:
    """Drop the tensor-parallel group (a no-op when there is none)."""
    global _TP
    if _TP is not None and _TP.device_group is not None and dist.is_initialized():
        dist.destroy_process_group(_TP.device_group)
    _TP = None


def destroy_distributed_environment() -> None:
    """Drop the model-parallel groups and leave the default process group."""
    global _WORLD
    destroy_model_parallel()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
