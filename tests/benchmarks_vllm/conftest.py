# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tests of benchmarks/moe_weight_prep.py against vLLM 0.34.0's own loader.

They need the vllm of `build/source/vllm-0.34.0` (the branch, installed
editable) and a worktree of its tag v0.34.0 at `build/release/vllm-0.34.0`
(the release), both made by tools/build_source_branch.py.
"""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RELEASE_TREE = REPO / "build" / "release" / "vllm-0.34.0"


@pytest.fixture(scope="session")
def release_tree() -> Path:
    if not (RELEASE_TREE / "vllm" / "__init__.py").is_file():
        pytest.fail(
            f"no vLLM 0.34.0 release worktree at {RELEASE_TREE}: run "
            "tools/build_source_branch.py (README)"
        )
    return RELEASE_TREE
