# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The unpacked vLLM releases the opt-in tests read, or a skip with the reason.

A release ``V`` is looked for in ``$VLLM_FORK_RELEASE_TREES/vllm-V`` (a folder
of unpacked source releases) and in ``build/fork/V/upstream`` (what
tools/build_fork_wheel.py leaves). With ``VLLM_FORK_RELEASE_TREES`` set, a
missing release fails the test instead of skipping it.
"""

import functools
import os
from pathlib import Path

import pytest

from fork_branch import branch_texts
from tool_cli import ROOT

__all__ = ["ENV", "release_texts", "release_tree"]

ENV = "VLLM_FORK_RELEASE_TREES"


def release_tree(version: str) -> Path:
    folder = os.environ.get(ENV)
    candidates = [ROOT / "build" / "fork" / version / "upstream"]
    if folder:
        candidates.insert(0, Path(folder) / f"vllm-{version}")
    for tree in candidates:
        if (tree / "vllm" / "envs.py").is_file():
            return tree
    where = " or ".join(str(c) for c in candidates)
    if folder:
        pytest.fail(f"{ENV} is set but vLLM {version} is not unpacked at {where}")
    pytest.skip(
        f"vLLM {version} is not unpacked at {where}: run "
        f"python tools/build_fork_wheel.py, or set {ENV} to a folder of them"
    )


@functools.cache
def _texts(tree: Path, version: str) -> dict[str, str]:
    return branch_texts(tree, version)


def release_texts(version: str) -> tuple[Path, dict[str, str]]:
    """The release's tree and the branch applied to it in memory (once a run)."""
    tree = release_tree(version)
    return tree, _texts(tree, version)
