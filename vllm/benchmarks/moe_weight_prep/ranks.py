# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ranks of ``vllm bench moe-weight-prep``: one rank's job, and the worker
processes of ``--tp N``."""

from __future__ import annotations

import threading

import torch

from vllm.benchmarks.moe_weight_prep.shard import shard_of
from vllm.benchmarks.moe_weight_prep.sources import checkpoint_source
from vllm.benchmarks.moe_weight_prep.w4a4_layers import run_benchmark
from vllm.benchmarks.moe_weight_prep.w4a16_layers import run_w4a16_benchmark
from vllm.distributed.launcher import spawn_workers
from vllm.distributed.parallel_state import backend_for_device

__all__ = [
    "rank_job",
    "run_ranks",
]


def rank_job(rank: int, params: dict) -> dict:
    """One rank of the job: prepares its own shard of every layer of mode
    ``params["quant_mode"]`` and returns its :func:`run_benchmark` (``"w4a4"``)
    or :func:`run_w4a16_benchmark` (``"w4a16"``, one rank) result. In a
    worker of ``--tp N`` it meets the other ranks before each layer, so they
    prepare at the same moment; with ``--tp 1`` it runs in the job's own
    process."""
    n = params["world_size"]
    quant_mode = params.get("quant_mode", "w4a4")
    shard = shard_of(rank, n, params["expert_parallel"])
    device = (
        torch.device("cuda", rank)
        if params["device"] == "cuda"
        else (torch.device("cpu"))
    )
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
        preset, layer_tensors = checkpoint_source(
            params["checkpoint"], shard, device, quant_mode
        )
    if quant_mode == "w4a16":
        return run_w4a16_benchmark(
            preset,
            device=device,
            num_layers=params["num_layers"],
            max_transient_bytes=params["max_transient_bytes"],
            memory_limit=params["memory_limit"],
            seed=params["seed"],
            progress=params["progress"],
            layer_tensors=layer_tensors,
        )
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
    return spawn_workers(
        rank_job,
        params["world_size"],
        args=(params,),
        backend=backend_for_device(params["device"]),
    )
