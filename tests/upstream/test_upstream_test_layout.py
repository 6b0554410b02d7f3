# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the branch's reworked kernel test,
tests/kernels/moe/test_flashinfer_b12x_moe.py, takes from this repository
(its new helper modules), and that every vllm name it and they import
resolves in the installed fork and is the release's or the branch's. The
test itself runs from vLLM's source tree as upstream's CI runs it, with
upstream's own helper modules (README, "vLLM from source";
tools/compare_upstream_tests.py compares its outcomes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fork_manifest import load_manifest  # tools/, on sys.path (pytest.ini)
from upstream_env import (
    REPO_ROOT,
    UPSTREAM_VERSION,
    unmodified_tree,
    unmodified_tree_problem,
)
from upstream_test_tree import (
    UPSTREAMS_OWN,
    VllmName,
    modules_of_test,
    name_origin,
    resolve_installed,
    vllm_names,
)

TEST = "tests/kernels/moe/test_flashinfer_b12x_moe.py"
#: The tests.* modules it imports: new files in upstream's tree.
HELPERS = (
    "tests/kernels/moe/flashinfer_b12x_utils.py",
    "tests/kernels/moe/moe_reference.py",
)


def test_it_takes_its_new_helper_modules_and_upstreams_own():
    modules = modules_of_test(TEST)
    assert modules == [TEST, *HELPERS]
    # Upstream's own helper module is imported, not followed: the source tree
    # holds upstream's; this repository's file of that name is not it.
    assert "from tests.kernels.moe.utils import" in (REPO_ROOT / TEST).read_text()
    assert "tests/kernels/moe/utils.py" in UPSTREAMS_OWN


@pytest.fixture(scope="module")
def manifest():
    return load_manifest()


@pytest.fixture(scope="module")
def unmodified() -> Path:
    if problem := unmodified_tree_problem():
        pytest.skip(problem)
    return unmodified_tree()


def test_its_vllm_names_are_the_releases_or_the_branchs(
    unmodified: Path, manifest, upstream_measurements
):
    names = vllm_names(modules_of_test(TEST))
    assert names
    unknown = [n for n in names if name_origin(n, unmodified, manifest) is None]
    assert not unknown, f"neither {UPSTREAM_VERSION}'s nor the branch's: {unknown}"
    unresolved = {n: p for n in names if (p := resolve_installed(n))}
    assert not unresolved, f"not in the installed fork: {unresolved}"
    branch = sorted(
        f"{n.module}.{n.name}"
        for n in names
        if name_origin(n, unmodified, manifest) == "branch"
    )
    upstream_measurements("branch names the test imports", ", ".join(branch))


def test_a_name_the_release_lacks_is_neither_and_does_not_resolve(
    unmodified: Path, manifest, tmp_path: Path
):
    # The negative control of the check above, on a file importing a name
    # from a module the release and the branch share, a name of the branch's new
    # module, and one nobody has.
    (tmp_path / "t.py").write_text(
        "from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig\n"
        "from vllm.model_executor.layers.fused_moe.config import no_such_name\n"
        "import vllm.model_executor.layers.fused_moe.experts."
        "flashinfer_b12x_call as call\n"
        "call.is_flashinfer_b12x_moe_available\n"
    )
    names = vllm_names(["t.py"], root=tmp_path)
    config = "vllm.model_executor.layers.fused_moe.config"
    call = "vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call"
    origins = {(n.module, n.name): name_origin(n, unmodified, manifest) for n in names}
    assert origins == {
        (config, "FusedMoEConfig"): UPSTREAM_VERSION,
        (config, "no_such_name"): None,
        (call, ""): "branch",
        (call, "is_flashinfer_b12x_moe_available"): "branch",
    }
    missing = VllmName(config, "no_such_name", "t.py:2")
    assert resolve_installed(missing) == f"{config} has no no_such_name"
    assert resolve_installed(VllmName(f"{config}_nope", "", "t.py:0"))
