# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run a function in N worker processes that form one tensor-parallel group.

    results = spawn_workers(fn, world_size=2, args=(path,))

Each worker is a spawned process (not forked: the parent may run OpenMP or
CUDA already) that joins the distributed environment (a ``file://`` store in
a temporary directory, gloo on CPU), initializes one tensor-parallel group
of all ``world_size`` ranks, runs ``fn(rank, *args)`` and sends its result
back pickled by value. When any worker fails, the others are terminated at
once (they may be blocked in a collective waiting for it) and
:class:`WorkerError` carries the failing rank and its error; the job never
hangs on a dead rank.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["WorkerError", "spawn_workers"]


class WorkerError(RuntimeError):
    """A worker failed: ``rank``, and its error as ``message`` (one line:
    the exception's type and text) and ``details`` (its traceback)."""

    def __init__(self, rank: int, message: str, details: str = ""):
        super().__init__(f"rank {rank}: {message}")
        self.rank, self.message, self.details = rank, message, details


def _worker(fn, rank, world_size, init_method, backend, timeout_s, args, results):
    # Runs in the child process.
    import datetime

    from vllm.distributed import parallel_state as ps

    try:
        ps.init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method=init_method,
            backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        ps.initialize_model_parallel(world_size)
        value = fn(rank, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        message = f"{type(e).__name__}: {e}".splitlines()[0]
        results.put((rank, "error", (message, traceback.format_exc())))
    finally:
        # The group may be broken already (another rank failed).
        with contextlib.suppress(Exception):
            ps.destroy_distributed_environment()


def spawn_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each run in its own
    process inside a tensor-parallel group of ``world_size`` ranks.

    ``fn`` must be importable by name (a module-level function) and its
    arguments and result picklable. ``backend``: default gloo without CUDA,
    NCCL with it. ``timeout_s`` bounds the whole run and each collective.
    Raises :class:`WorkerError` for the first rank that fails (or dies, or
    the timeout), after terminating every worker.
    """
    import multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="vllm-dist-") as tmp:
        init_method = "file://" + os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    init_method,
                    backend,
                    timeout_s,
                    args,
                    results,
                ),
                daemon=True,
            )  # fmt: skip
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, world_size, timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(10)


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            for rank, proc in enumerate(procs):
                if rank not in values and proc.exitcode not in (None, 0):
                    raise WorkerError(
                        rank, f"the worker died (exit code {proc.exitcode})"
                    ) from None
            if time.monotonic() > deadline:
                waiting = sorted(set(range(world_size)) - set(values))
                raise WorkerError(
                    waiting[0], f"no result after {timeout_s:.0f} s"
                ) from None
            continue
        if status == "error":
            message, details = payload
            raise WorkerError(rank, message, details)
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(world_size)]
