# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The project's tests run vLLM's own code: the source tree the README's test
command builds (build/source/vllm-0.34.0, the series on branch nvfp4moe,
installed editable), or an unmodified release tree where a test compares.

tests/kernels/ holds the branch's definitions for upstream's own test files;
they run from the built trees (tests/test_stack.py), not from here.

The session runs torch on one intra-op thread, as do the processes it starts:
on a shared 2-core machine every parallel op otherwise waits for its slowest
thread. ``VLLM_TEST_TORCH_THREADS=N`` sets another count (0: torch's default).
"""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "build" / "source"
_THREADS = int(os.environ.get("VLLM_TEST_TORCH_THREADS", "1"))
if _THREADS:  # before torch is imported, here or in a process started later
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

collect_ignore = ["kernels"]


def pytest_configure(config):
    import torch

    if _THREADS:
        torch.set_num_threads(_THREADS)
    # `python -m pytest` puts the repository root first on sys.path, where the
    # fragments would win over an editable install's finder.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    import vllm

    # The repository's vllm/ (fragments, no __init__.py) must never be it.
    where = Path(vllm.__file__ or "").resolve()
    if not where.is_relative_to(REPO / "build"):
        raise pytest.UsageError(
            f"import vllm gives {where or 'the repository fragments'}, not a tree "
            "under build/: run tools/build_source_branch.py in this venv (README)"
        )
