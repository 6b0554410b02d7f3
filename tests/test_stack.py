# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The series as built on each release (build/source/vllm-<V>, nvfp4moe): its
size per PR within vLLM's bands, as each PR page quotes it, and its own tests
in upstream's tests/ passing from the tree as upstream's CI runs them.

Each PR's tests failing at its parent is `tools/check_pr_series.py`'s check
(about 3 minutes for both releases on 2 quiet cores): run it after changing the
series, and quote it on the PR pages."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from check_pr_series import LIMITS, added_lines, pr_commits
from fork_manifest import load_manifest

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "build" / "source"
MANIFEST = load_manifest()
RELEASES = list(MANIFEST.releases)


def _tree(version: str):
    tree = SOURCE / f"vllm-{version}"
    if not (tree / ".git").is_dir():
        pytest.fail(f"no {tree}: the test command runs tools/build_source_branch.py")
    return tree


@pytest.mark.parametrize("version", RELEASES)
def test_each_pr_within_the_bands_and_quoted_on_its_page(version):
    tree = _tree(version)
    commits = pr_commits(tree, version)
    assert [title for _, title in commits] == [pr.title for pr in MANIFEST.prs]
    total = 0
    for k, ((sha, _), pr) in enumerate(zip(commits, MANIFEST.prs, strict=True)):
        lines = sum(added_lines(tree, sha).values())
        total += lines
        assert lines <= (LIMITS["first"] if k == 0 else LIMITS["each"]), pr.id
        page = (REPO / pr.doc).read_text()
        quoted = re.search(rf"{re.escape(version)}: \+(\d+)", page)
        assert quoted and int(quoted[1]) == lines, (pr.doc, version, lines)
    assert total <= LIMITS["stack"]


def _stack_tests(tree, version) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(tree), "diff", "--name-only", f"v{version}", "nvfp4moe"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [p for p in out if p.startswith("tests/") and "/test_" in p]


@pytest.mark.parametrize("version", RELEASES)
def test_the_series_own_tests_pass_in_its_tree(version, tmp_path):
    tree = _tree(version)
    files = [p.removeprefix("tests/") for p in _stack_tests(tree, version)]
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = subprocess.run(
        [*cmd, f"--junitxml={junit}", *files],
        cwd=tree / "tests",
        env=env,
        capture_output=True,
        text=True,
    )
    cases = list(ET.parse(junit).iter("testcase"))
    passed = [c for c in cases if not len(c)]
    skipped = [c.find("skipped") for c in cases if c.find("skipped") is not None]
    assert run.returncode == 0, run.stdout[-3000:]
    assert len(passed) >= 11, run.stdout[-2000:]
    # Only the b12x kernel cases skip here, saying why.
    assert all("SM120" in s.get("message", "") for s in skipped)
