# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/upstream, run with its environment active but a piece missing,
fails every test and skips none (its conftest's pytest_runtest_setup): here
the installed vllm is this repository's own, not the fork, and the
unmodified tree does not exist."""

import os
import subprocess
import sys
from pathlib import Path

UPSTREAM_TESTS = Path(__file__).resolve().parent / "upstream"


def test_a_missing_piece_fails_every_test_inside_the_upstream_environment(tmp_path):
    env = {
        **os.environ,
        "VLLM_UPSTREAM_RELEASE": "0.34.0",
        "VLLM_FORK_UPSTREAM_TREE": str(tmp_path / "no-such-tree"),
    }
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-o", "addopts=", "test_upstream_test_layout.py"],
        cwd=UPSTREAM_TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "skipped" not in summary and "passed" not in summary, summary
    assert "cannot run vLLM 0.34.0's tests" in run.stdout, run.stdout[-2000:]
