# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmark's busy processes (``--busy-cores``) end within seconds of
their parent's death by SIGTERM or SIGKILL."""

import signal

import pytest

from tests.distributed.process_survival import (
    SURVIVAL_LIMIT_S,
    kill_parent_and_time_survivors,
)

BUSY_PARENT = """
    import multiprocessing, time
    from vllm.benchmarks.moe_weight_prep.busy_cores import busy_cores
    with busy_cores(1):
        for child in multiprocessing.active_children():
            print("busy", child.pid, flush=True)
        time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_busy_processes_die_with_their_parent(tmp_path, sig):
    took = kill_parent_and_time_survivors(BUSY_PARENT, 1, sig, tmp_path)
    assert not isinstance(took, str) and took < SURVIVAL_LIMIT_S, took
