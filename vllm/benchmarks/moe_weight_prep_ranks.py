# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ranks of ``vllm bench moe-weight-prep --tp N``: shards and worker processes."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from vllm.benchmarks.moe_model_presets import MoEModelPreset
from vllm.distributed.launcher import spawn_workers
from vllm.distributed.parallel_state import backend_for_device

__all__ = [
    "RankShard",
    "rank_job",
    "run_ranks",
    "shard_of",
]


@dataclass(frozen=True)
class RankShard:
    """The shard of every MoE layer one rank prepares: I split ``tp_size``
    ways (tensor parallelism) or the experts split ``ep_size`` ways (expert
    parallelism, each expert's I whole)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def rank(self) -> int:
        return self.tp_rank * self.ep_size + self.ep_rank

    def layer_kwargs(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "ep_rank": self.ep_rank, "ep_size": self.ep_size}  # fmt: skip

    def describe(self) -> str:
        if self.ep_size > 1:
            return f"EP {self.ep_rank}/{self.ep_size}"
        return f"TP {self.tp_rank}/{self.tp_size}"

    def check(self, preset: MoEModelPreset) -> None:
        """ValueError if ``preset`` cannot be split this way."""
        preset.intermediate_size_per_partition(self.tp_size)
        if preset.num_experts % self.ep_size:
            raise ValueError(
                f"--tp {self.ep_size} with --enable-expert-parallel does not divide "
                f"{preset.name}'s {preset.num_experts} experts"
            )


def shard_of(rank: int, world_size: int, expert_parallel: bool) -> RankShard:
    if expert_parallel:
        return RankShard(ep_rank=rank, ep_size=world_size)
    return RankShard(tp_rank=rank, tp_size=world_size)


def rank_job(rank: int, params: dict) -> dict:
    """One rank of the job: prepares its own shard of every layer and returns
    its ``run_benchmark`` result. In a worker of ``--tp N`` (``parallel``)
    it meets the other ranks before each layer, so they prepare at the same
    moment; with ``--tp 1`` it runs in the job's own process."""
    # Imported here: the run module imports RankShard from this one.
    from vllm.benchmarks.moe_checkpoint_source import checkpoint_source
    from vllm.benchmarks.moe_weight_prep_run import run_benchmark

    n = params["world_size"]
    shard = shard_of(rank, n, params["expert_parallel"])
    device = torch.device("cuda", rank) if params["device"] == "cuda" else (
        torch.device("cpu"))  # fmt: skip
    preset, layer_tensors = params["preset"], None
    before_layer = None
    if n > 1:
        from tqdm import tqdm

        from vllm.distributed import get_tp_group

        before_layer = get_tp_group().barrier
        # tqdm's default lock is a multiprocessing one (a semaphore): a rank
        # stopped by the parent (Ctrl-C, a failed rank) would leave it to the
        # resource tracker, which then warns of a leaked semaphore. A rank
        # shares its bars with no other process: a thread lock does.
        tqdm.set_lock(threading.RLock())
    if params["checkpoint"]:
        preset, layer_tensors = checkpoint_source(params["checkpoint"], shard, device)
    return run_benchmark(
        preset,
        device=device,
        shard=shard,
        num_layers=params["num_layers"],
        max_transient_bytes=params["max_transient_bytes"],
        memory_limit=params["memory_limit"],
        seed=params["seed"] + rank,
        progress=params["progress"] and rank == 0,
        layer_tensors=layer_tensors,
        global_scale_mode=params["global_scale_mode"],
        before_layer=before_layer,
        precision=params["precision"],
    )


def run_ranks(params: dict) -> list[dict]:
    """Run ``params["world_size"]`` workers (:func:`rank_job`); their results
    in rank order."""
    # The backend follows the device the ranks compute on: gloo for
    # --device cpu even on a GPU host, NCCL for --device cuda.
    return spawn_workers(rank_job, params["world_size"], args=(params,),
                         backend=backend_for_device(params["device"]))  # fmt: skip
