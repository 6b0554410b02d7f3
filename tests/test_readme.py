# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The README stays a short page whose commands are the ones CI and the tools
run, and whose series table says what the built series holds."""

import re
from pathlib import Path

from fork_manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _command(marker: str) -> str:
    found = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", README, re.S)
    assert found, f"README.md has no bash block after <!-- {marker} -->"
    return found.group(1).strip()


def test_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_the_test_command_builds_the_trees_then_runs_pytest():
    steps = [s.strip() for s in _command("test-command").split("&&")]
    assert steps[-2:] == ["python tools/build_source_branch.py", "pytest tests"]
    assert "pip install --no-deps -r requirements/cpu-torch.txt" in steps
    assert "<!-- test-command -->" in (REPO / ".ci" / "run").read_text()


def test_the_main_command_builds_the_trees_then_runs_the_benchmark():
    steps = [s.strip() for s in _command("main-command").split("&&")]
    assert steps[-2:] == [
        "python tools/build_source_branch.py",
        "python benchmarks/moe_weight_prep.py",
    ]
    assert _command("source-command") in _command("main-command")


def test_the_series_table_names_each_pr():
    for pr in load_manifest().prs:
        assert pr.title in README
        assert (REPO / pr.doc).is_file()
