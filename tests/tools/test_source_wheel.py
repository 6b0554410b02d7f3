# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A wheel built from each source branch (`pip wheel`, the release wheel's
compiled parts) holds the Python files of the fork wheel of that release
(tools/build_fork_wheel.py) byte for byte: one source of truth, two ways to
ship it. Only ``vllm/_version.py`` differs, written by each build (the same
version string; the tuple and commit id setuptools-scm writes).

Runs after the source command and the fork command (README), when the fork
wheels are in dist/; skipped before. About 3 minutes per release."""

import os
import re
import subprocess
import sys
import zipfile

import pytest

from build_source_branch import BRANCH, git, precompiled
from tool_cli import ROOT

pytestmark = pytest.mark.skipif(
    not any((ROOT / "dist").glob("vllm-*+nvfp4moe-*.whl")),
    reason="needs the fork wheels in dist/ (README: the fork command)",
)


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0"])
def test_a_wheel_from_the_source_branch_holds_the_fork_wheels_python_files(
    version, tmp_path
):
    tree = ROOT / "build" / "source" / f"vllm-{version}"
    release = next(tree.parent.glob(f"vllm-{version}-*.whl"), None)
    fork = next((ROOT / "dist").glob(f"vllm-{version}+nvfp4moe-*.whl"), None)
    assert (tree / ".git").is_dir() and release, "run tools/build_source_branch.py"
    assert fork, "run tools/build_fork_wheel.py"
    checkout = tmp_path / "tree"  # the branch, leaving the tree as it is
    git(tree, "worktree", "add", "-q", "--detach", str(checkout), BRANCH)
    try:
        env = precompiled(release, fork.name.split("-")[1])
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
        cmd += ["--no-build-isolation", "-w", str(tmp_path), str(checkout)]
        subprocess.run(cmd, env={**os.environ, **env}, check=True)
    finally:
        git(tree, "worktree", "remove", "--force", str(checkout))
    (built,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(built) as a, zipfile.ZipFile(fork) as b:
        pa = sorted(n for n in a.namelist() if n.endswith(".py"))
        pb = sorted(n for n in b.namelist() if n.endswith(".py"))
        assert pa == pb and len(pa) > 3000
        differ = [n for n in pa if a.read(n) != b.read(n)]
        assert differ == ["vllm/_version.py"]
        said = [
            re.search(rb"__version__ = version = (.*)", z.read(differ[0]))
            for z in (a, b)
        ]
        assert said[0].group(1) == said[1].group(1) == f"'{version}+nvfp4moe'".encode()
