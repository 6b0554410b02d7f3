# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The test session runs torch on one intra-op thread, and so do the
processes it starts.

The tests are many small tensor operations, and every parallel operation
waits for its slowest thread: when another process holds a core, that wait
(a scheduler time slice) dwarfs the work, as the bounded preparation found
(the commands that prepare weights run it on one thread:
``vllm.entrypoints.process_policy``). With two CPU-bound processes beside
them on a 2-core machine, the interrupted-preparation and interrupted-reload cases of
``tests/kernels/moe/test_nvfp4_moe_prep_state.py`` took 248 s on torch's two
threads and 48 s on one (2026-12-01). No result depends on the thread
count; tests about thread settings set their own.

``VLLM_TEST_TORCH_THREADS=N`` runs them on N threads instead (0: torch's
default).
"""

import os

import pytest

_THREADS = int(os.environ.get("VLLM_TEST_TORCH_THREADS", "1"))

if _THREADS:
    # Before torch is imported (here or in a process started later): the
    # OpenMP pool of spawned ranks and command-line runs is sized from it.
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


def pytest_configure(config):
    if _THREADS:
        import torch

        torch.set_num_threads(_THREADS)


@pytest.fixture
def two_threads():
    """Torch on two intra-op threads for one test, then the session's count
    again: for tests that check a setting is changed and restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
