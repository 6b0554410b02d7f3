# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The repository's own habits: the pre-commit hooks and the CI workflow run
what they say, and the tree passes them (ruff check and ruff format)."""

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed")

ROOT = Path(__file__).resolve().parents[1]


def test_pre_commit_runs_ruff_check_and_format_as_upstream():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    (repo,) = config["repos"]
    assert repo["repo"] == "https://github.com/astral-sh/ruff-pre-commit"
    assert repo["rev"].startswith("v") and repo["rev"][1:].count(".") == 2
    assert [h["id"] for h in repo["hooks"]] == ["ruff-check", "ruff-format"]
    assert "--fix" in repo["hooks"][0]["args"]
    assert "manual" in config["default_stages"]  # what CI runs


def test_ci_workflow_runs_ci_run_on_ubuntu_with_python_311():
    workflow = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())
    tests = workflow["jobs"]["tests"]
    assert tests["runs-on"] == "ubuntu-latest"
    python = [
        s
        for s in tests["steps"]
        if s.get("uses", "").startswith("actions/setup-python")
    ]
    assert python[0]["with"]["python-version"] == "3.11"
    assert tests["steps"][-1]["run"] == "bash .ci/run"
    hooks = workflow["jobs"]["pre-commit"]["steps"][-1]
    assert hooks["uses"].startswith("pre-commit/action@")
    assert "--all-files" in hooks["with"]["extra_args"]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_tree_is_ruff_clean(command):
    # What the pre-commit hooks check, so that .ci/run enforces it too.
    result = subprocess.run(
        ["ruff", *command, "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
