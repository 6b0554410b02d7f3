# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The installed fork keeps the release's interfaces in every module the
branch edits, against the unmodified release's source: griffe's breaking
changes and the names upstream's own modules import
(fork_interfaces.py, whose checks these call on the installed fork).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from upstream_env import UPSTREAM_VERSION, unmodified_tree, unmodified_tree_problem


def _fork_interfaces():
    # Imported when a test runs (it needs griffe): the slice's own suite
    # collects this file without it.
    import fork_interfaces

    return fork_interfaces


_ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
_EXPERTS = "vllm/model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py"


@pytest.fixture(scope="module")
def trees() -> tuple[Path, Path, list[str]]:
    if problem := unmodified_tree_problem():
        pytest.fail(problem, pytrace=False)
    import vllm

    fork = Path(vllm.__file__).resolve().parents[1]  # site-packages
    fi = _fork_interfaces()
    paths = [p for p in fi.changed_paths(UPSTREAM_VERSION) if p.endswith(".py")]
    return unmodified_tree().resolve(), fork, paths


def test_changed_modules_keep_the_releases_signatures(trees, upstream_measurements):
    upstream, fork, paths = trees
    assert _ORACLE in paths and _EXPERTS in paths  # not a vacuous comparison
    found = _fork_interfaces().differences(upstream, fork, paths)
    upstream_measurements(
        f"interfaces, vLLM {UPSTREAM_VERSION}",
        f"{len(paths)} changed modules, {len(found)} differences",
    )
    assert found == []


def test_upstream_importers_find_their_names_in_the_fork(trees):
    upstream, fork, paths = trees
    assert _fork_interfaces().importer_differences(upstream, fork, paths) == []


def test_the_comparison_sees_a_dropped_parameter(trees, tmp_path):
    """Negative control: the release's own oracle module with one
    parameter of make_nvfp4_moe_quant_config removed is reported."""
    upstream, _, _ = trees
    changed = tmp_path / _ORACLE
    changed.parent.mkdir(parents=True)
    text = (upstream / _ORACLE).read_text()
    planted = text.replace(
        "    use_a16: bool = False,\n) -> FusedMoEQuantConfig:",
        ") -> FusedMoEQuantConfig:",
        1,
    )
    assert planted != text
    changed.write_text(planted)
    found = _fork_interfaces().differences(upstream, tmp_path, [_ORACLE])
    assert any("make_nvfp4_moe_quant_config" in d and "use_a16" in d for d in found), (
        found
    )
