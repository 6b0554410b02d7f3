# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Nothing outlives its parent: the launcher's workers and its temporary
store directory end within seconds of the parent's death by SIGTERM or
SIGKILL (the benchmark's busy processes: ``tests/benchmarks/test_busy_cores.py``);
the launcher's rank and group arguments are checked before anything starts.

Each lifetime test runs a parent process that starts its children and prints
their pids, kills that parent and measures how long the children (and the
``vllm-dist-*`` directory, under a private TMPDIR) survive it.
"""

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.distributed.process_survival import (
    START_TIMEOUT_S,
    SURVIVAL_LIMIT_S,
    kill_parent_and_time_survivors,
)
from vllm.distributed import parallel_state as ps
from vllm.distributed.launcher import spawn_workers
from vllm.utils.process_lifetime import removed_even_if_killed, watch_lifeline


def _report_and_wait(rank, hold_the_gil):
    # One write of a whole line (atomic on a pipe): two workers share the
    # parent's stdout, and print() writes its pieces separately, which
    # interleaved them once ("workerworker  10  2807328072").
    os.write(1, f"worker {rank} {os.getpid()}\n".encode())
    if hold_the_gil:
        # One C call that never releases the GIL: no Python thread of this
        # process runs again, only the kernel can end it.
        sum(range(10**15))
    while True:
        time.sleep(1)


LAUNCHER_PARENT = """
    from tests.distributed.test_process_lifetime import _report_and_wait
    from vllm.distributed.launcher import spawn_workers
    spawn_workers(_report_and_wait, 2, args=({hold},), timeout_s=600)
"""


@pytest.mark.parametrize(
    "sig, hold_the_gil",
    [(signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["SIGTERM", "SIGKILL, workers holding the GIL"],
)
def test_workers_and_their_store_die_with_their_parent(tmp_path, sig, hold_the_gil):
    script = LAUNCHER_PARENT.format(hold=hold_the_gil)
    took = kill_parent_and_time_survivors(
        script, 2, sig, tmp_path, watch=["vllm-dist-*"]
    )
    assert not isinstance(took, str) and took < SURVIVAL_LIMIT_S, took
    assert list(tmp_path.iterdir()) == []


def test_a_directory_is_removed_after_its_owner_is_killed(tmp_path):
    script = f"""
        import os, time
        from vllm.utils.process_lifetime import removed_even_if_killed
        with removed_even_if_killed({str(tmp_path / "d")!r}) as d:
            os.mkdir(d)
            open(os.path.join(d, "store"), "w").close()
            print("parent", os.getpid(), flush=True)
            time.sleep(600)
    """
    took = kill_parent_and_time_survivors(
        script, 1, signal.SIGKILL, tmp_path, watch=["d"]
    )
    assert not isinstance(took, str) and took < SURVIVAL_LIMIT_S, took


def test_a_directory_is_removed_when_the_block_ends(tmp_path):
    with removed_even_if_killed(tmp_path / "d") as d:
        os.mkdir(d)
        (Path(d) / "f").write_text("x")
    assert not (tmp_path / "d").exists()


def _wait_on_lifeline_only(lifeline):
    # No parent-death signal here: the lifeline thread alone must end it.
    watch_lifeline(lifeline)
    while True:
        time.sleep(1)


def test_the_lifeline_alone_ends_a_child_when_the_parent_side_closes():
    ctx = multiprocessing.get_context("spawn")
    lifeline, keep_alive = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_wait_on_lifeline_only, args=(lifeline,), daemon=True)
    proc.start()
    lifeline.close()
    try:
        time.sleep(0.5)
        assert proc.is_alive()
        keep_alive.close()
        proc.join(START_TIMEOUT_S)
        assert proc.exitcode == 1
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


# --- ranks and groups ----------------------------------------------------------------


def _tp_view(rank):
    tp = ps.get_tp_group()
    summed = ps.get_tp_group().all_reduce(torch.tensor([rank + 1.0]))
    return tp.ranks, tp.rank_in_group, tp.world_size, summed.item()


def test_tensor_parallel_groups_smaller_than_the_world():
    # World 2, TP 1: two groups of one rank; an all-reduce sums nothing.
    results = spawn_workers(
        _tp_view, 2, tp_size=1, timeout_s=120, deadline_s=START_TIMEOUT_S
    )
    assert results == [([0], 0, 1, 1.0), ([1], 0, 1, 2.0)]


@pytest.mark.parametrize(
    "world_size, tp_size, message",
    [
        (0, None, "world_size must be an integer >= 1, got 0"),
        (2, 0, "tp_size must be an integer >= 1, got 0"),
        (2, 3, "tp_size 3 does not divide world_size 2"),
        (4, 3, "tp_size 3 does not divide world_size 4"),
        (2, True, "tp_size must be an integer >= 1, got True"),
    ],
)
def test_launcher_arguments_are_checked_before_spawning(world_size, tp_size, message):
    with pytest.raises(ValueError, match=message):
        spawn_workers(_tp_view, world_size, tp_size=tp_size)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("rank", [2, 3, -2])
def test_an_out_of_range_rank_at_init_is_refused(rank):
    with pytest.raises(
        ValueError, match=rf"rank must be in \[0, 2\) \(or -1\), got {rank}"
    ):
        ps.init_distributed_environment(
            world_size=2, rank=rank, distributed_init_method="file:///nonexistent"
        )
    assert not torch.distributed.is_initialized()
