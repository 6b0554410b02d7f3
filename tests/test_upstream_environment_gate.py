# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/upstream, run with its environment active but a piece missing,
fails every test and skips none (its conftest's pytest_runtest_setup): the
installed vllm is this repository's own, not the fork, and the unmodified
tree does not exist; or (a plugin standing in for the fork's install) only
the tree is missing."""

import os
import subprocess
import sys
from pathlib import Path

UPSTREAM_TESTS = Path(__file__).resolve().parent / "upstream"


# Loaded with -p before tests/upstream's conftest imports upstream_env's
# functions by name: the installed vllm counts as the fork.
_FORK_INSTALLED = f"""\
import sys
sys.path.insert(0, {str(UPSTREAM_TESTS)!r})
import upstream_env
upstream_env.installed_vllm_problem = lambda: None
"""


def _run_upstream_tests(tmp_path, *plugin: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "VLLM_UPSTREAM_RELEASE": "0.34.0",
        "VLLM_FORK_UPSTREAM_TREE": str(tmp_path / "no-such-tree"),
        "PYTHONPATH": os.pathsep.join(
            [str(tmp_path), os.environ.get("PYTHONPATH", "")]
        ),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin]
        + ["-o", "addopts=", "test_upstream_test_layout.py"],
        cwd=UPSTREAM_TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_missing_piece_fails_every_test_inside_the_upstream_environment(tmp_path):
    run = _run_upstream_tests(tmp_path)
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "skipped" not in summary and "passed" not in summary, summary
    assert "cannot run vLLM 0.34.0's tests" in run.stdout, run.stdout[-2000:]


def test_the_tree_alone_missing_fails_every_test_too(tmp_path):
    (tmp_path / "fork_installed.py").write_text(_FORK_INSTALLED)
    run = _run_upstream_tests(tmp_path, "-p", "fork_installed")
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "skipped" not in summary and "passed" not in summary, summary
    assert "no unmodified vLLM 0.34.0 tree at" in run.stdout, run.stdout[-2000:]
    assert "slice" not in run.stdout, run.stdout[-2000:]
