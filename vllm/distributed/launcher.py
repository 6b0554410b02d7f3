# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run a function in N worker processes that form one tensor-parallel group.

    results = spawn_workers(fn, world_size=2, args=(path,))

Each worker is a spawned process (not forked: the parent may run OpenMP or
CUDA already) that joins the distributed environment (a ``file://`` store in
a temporary directory, gloo on CPU), initializes tensor-parallel groups of
``tp_size`` ranks (default: one group of all ``world_size``), runs
``fn(rank, *args)`` and sends its result back pickled by value. When any
worker fails, the others are terminated at once (they may be blocked in a
collective waiting for it) and :class:`WorkerError` carries the failing rank
and its error; the job never hangs on a dead rank.

Nothing outlives the parent: if it dies by any signal (SIGTERM, SIGKILL),
the workers are killed within milliseconds and the temporary directory is
removed by a reaper (:mod:`vllm.utils.process_lifetime`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from vllm.utils.process_lifetime import die_with_parent, removed_even_if_killed
from vllm.utils.signal_utils import children_ignore_sigint

__all__ = ["WorkerError", "spawn_workers"]

#: How long finished workers get to exit on their own before being stopped.
_EXIT_GRACE_S = 30.0


class WorkerError(RuntimeError):
    """A worker failed: ``rank``, and its error as ``message`` (one line:
    the exception's type and text) and ``details`` (its traceback)."""

    def __init__(self, rank: int, message: str, details: str = ""):
        super().__init__(f"rank {rank}: {message}")
        self.rank, self.message, self.details = rank, message, details


def _worker(
    fn,
    rank,
    world_size,
    tp_size,
    init_method,
    backend,
    timeout_s,
    args,
    conn,
    parent_pid,
    lifeline,
):
    # Runs in the child process.
    die_with_parent(parent_pid, lifeline)
    import datetime

    from vllm.distributed import parallel_state as ps

    reported = False
    try:
        ps.init_distributed_environment(
            world_size=world_size,
            rank=rank,
            distributed_init_method=init_method,
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        ps.initialize_model_parallel(tp_size)
        # The run's deadline starts here, not at the spawn: starting a
        # process and importing torch take seconds on a loaded machine.
        conn.send_bytes(pickle.dumps(("ready", None)))
        value = fn(rank, *args)
        conn.send_bytes(pickle.dumps(("ok", value)))
        reported = True
        # Every rank done before any tears its groups down: a peer may still
        # be finishing the last collective (gloo's connect handshake of a
        # group made last), and would see this rank's sockets close under it
        # ("Connection closed by peer"). The result is sent first, so the
        # parent blames only a rank that failed or never finished; if a peer
        # fails instead, this barrier's own error is not reported, and the
        # parent ends the ranks waiting here.
        ps.get_world_group().barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        if not reported:
            message = f"{type(e).__name__}: {e}".splitlines()[0]
            conn.send_bytes(pickle.dumps(("error", (message, traceback.format_exc()))))
    finally:
        conn.close()
        # The group may be broken already (another rank failed).
        with contextlib.suppress(Exception):
            ps.destroy_distributed_environment()


def spawn_workers(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    tp_size: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
    deadline_s: float | None = None,
) -> list[Any]:
    """``[fn(0, *args), ..., fn(world_size - 1, *args)]``, each run in its own
    process; ranks [i * tp_size, (i + 1) * tp_size) form tensor-parallel
    group i (``tp_size`` default: ``world_size``, one group).

    ``fn`` must be importable by name (a module-level function) and its
    arguments and result picklable. ``backend``: default gloo without CUDA,
    NCCL with it. ``timeout_s`` bounds each collective (a rank waiting for
    one that hangs), the group's rendezvous at the start included;
    ``deadline_s``, if given, bounds each rank's ``fn``: it counts from the
    moment that rank has joined its groups, so starting the process and
    importing torch (seconds on a loaded machine) are not part of it. Raises
    :class:`WorkerError` for the first rank that fails (or dies, or misses
    the deadline: the lowest such rank), after terminating every worker.
    """
    import multiprocessing as mp

    for name, value in (("world_size", world_size), ("tp_size", tp_size)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    tp_size = world_size if tp_size is None else tp_size
    if world_size % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide world_size {world_size}")
    ctx = mp.get_context("spawn")
    # One pipe per worker (no queue: its locks are semaphores that the
    # resource tracker would report as leaked when a worker is killed).
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    # The workers' lifeline: they hold the read end, this process the write
    # end until it returns or dies.
    lifeline, keep_alive = ctx.Pipe(duplex=False)
    with contextlib.ExitStack() as stack:
        stack.callback(keep_alive.close)
        stack.callback(lifeline.close)
        tmp = stack.enter_context(
            removed_even_if_killed(tempfile.mkdtemp(prefix="vllm-dist-"))
        )
        init_method = "file://" + os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    tp_size,
                    init_method,
                    backend,
                    timeout_s,
                    args,
                    pipes[rank][1],
                    os.getpid(),
                    lifeline,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        # Ctrl-C is the parent's: it stops the workers in the finally below.
        with children_ignore_sigint():
            for proc in procs:
                proc.start()
        for _, send in pipes:
            send.close()  # the parent only reads
        lifeline.close()
        ok = False
        try:
            values = _collect(procs, [recv for recv, _ in pipes], deadline_s)
            ok = True
            return values
        finally:
            # After a success the workers are finishing on their own: let
            # them (a killed one leaves its semaphores to the resource
            # tracker); after a failure they may be blocked in a collective.
            for proc in procs:
                if ok:
                    proc.join(_EXIT_GRACE_S)
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(10)
            for recv, _ in pipes:
                recv.close()


def _collect(procs, conns, deadline_s: float | None) -> list[Any]:
    """Each rank's result from its pipe, in rank order. A rank sends
    ``("ready", None)`` once it has joined its groups, then ``("ok", value)``
    or ``("error", (message, details))``; ``deadline_s`` counts from its
    "ready"."""
    from multiprocessing.connection import wait

    world_size = len(procs)
    values: dict[int, Any] = {}
    ready_at: dict[int, float] = {}
    pending = dict(enumerate(conns))
    while pending:
        for conn in wait(list(pending.values()), timeout=0.2):
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:  # closed without a word: the process died
                procs[rank].join(1)
                raise WorkerError(
                    rank, f"the worker died (exit code {procs[rank].exitcode})"
                ) from None
            if status == "ready":
                ready_at[rank] = time.monotonic()
                continue
            del pending[rank]
            if status == "error":
                message, details = payload
                raise WorkerError(rank, message, details)
            values[rank] = payload
        if deadline_s is not None:
            now = time.monotonic()
            late = [
                r for r in pending if r in ready_at and now - ready_at[r] > deadline_s
            ]
            if late:
                raise WorkerError(
                    min(late), f"no result {deadline_s:g} s after joining the group"
                )
    return [values[rank] for rank in range(world_size)]
