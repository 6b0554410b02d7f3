# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's reworked kernel test, tests/kernels/moe/test_flashinfer_b12x_moe.py,
in upstream's test layout (upstream_test_tree.py) inside the release with
this branch built in: it collects; without an SM120/SM121 GPU its kernel
cases skip, the reason naming SM120/SM121 and the kernel gate's own; its
CPU cases pass, or skip where upstream's ``FusedMoEConfig`` refuses a
non-gated layer off CUDA; and every vllm name it and its helper modules
import resolves in the installed fork and is the release's or the branch's."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from fork_manifest import load_manifest  # tools/, on sys.path (pytest.ini)
from upstream_env import (
    REPO_ROOT,
    SLICE_VLLM,
    UPSTREAM_VERSION,
    unmodified_tree,
    unmodified_tree_problem,
)
from upstream_test_tree import (
    STAND_INS,
    ChildRun,
    VllmName,
    lay_out,
    modules_of_test,
    name_origin,
    resolve_installed,
    run_pytest,
    vllm_names,
)

TEST = "tests/kernels/moe/test_flashinfer_b12x_moe.py"
#: The tests.* modules it imports: new files in upstream's tree.
HELPERS = (
    "tests/kernels/moe/flashinfer_b12x_utils.py",
    "tests/kernels/moe/moe_reference.py",
)
#: The kernel cases' parameter id (the experts class FlashInferB12xExperts).
KERNEL_ID = "flashinfer_b12x"
KERNEL_REASON = "SM120/SM121 only"
#: Upstream's FusedMoEConfig off CUDA, XPU and ROCm (the test's _config).
CONFIG_REFUSAL = (
    "vLLM's FusedMoEConfig refuses this layer here: is_act_and_mul=False is "
    "supported only for CUDA"
)
# The file's cases: W4A4 SiLU and ReLU^2 (4 shapes x 2 expert counts x 3
# top-k, x 2 backends: 48 each), W4A16 (2 shapes x 2 x {silu, relu2}, x 2
# backends: 16) and the constructor check (2 classes, both CPU): 114, of
# which 56 are the kernel's. The CPU cases refused by upstream's config are
# the non-gated ones: 24 ReLU^2 W4A4 and 4 W4A16 relu2 emulated cases.
EXPECTED = {"kernel skipped": 56, "cpu passed": 30, "cpu refused": 28}
# The child imports vLLM (~20 s on 2 cores) and runs 58 CPU cases (~40 s).
_CHILD_TIMEOUT_S = 900


def _params(nodeid: str) -> list[str]:
    return nodeid.partition("[")[2].removesuffix("]").split("-")


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> ChildRun:
    root = tmp_path_factory.mktemp("upstream-tests")
    lay_out(root, modules_of_test(TEST))
    return run_pytest(
        root, ["-q", "-rs", TEST.removeprefix("tests/")], _CHILD_TIMEOUT_S
    )


def test_layout_holds_the_test_and_its_new_helper_modules(tmp_path: Path):
    modules = modules_of_test(TEST)
    assert modules == [TEST, *HELPERS]
    lay_out(tmp_path, modules)
    for rel in modules:
        assert (tmp_path / rel).read_text() == (REPO_ROOT / rel).read_text()
    for rel in STAND_INS:
        assert "raise ImportError" in (tmp_path / rel).read_text()
    # This repository's tests/kernels/moe/utils.py is not upstream's: a test
    # importing it cannot be laid out.
    with pytest.raises(ValueError, match="upstream's own files"):
        lay_out(tmp_path, [TEST, "tests/kernels/moe/utils.py"])


@pytest.mark.slow
def test_kernel_cases_skip_naming_sm120_and_cpu_cases_run(
    layout_run: ChildRun, upstream_measurements
):
    record = layout_run.record
    assert layout_run.returncode == 0, layout_run.output
    vllm_file = Path(record["vllm_file"]).resolve()
    assert not vllm_file.is_relative_to(SLICE_VLLM), vllm_file
    assert not record["deselected"]
    outcomes = record["outcomes"]
    assert sorted(outcomes) == sorted(record["collected"])
    tree = ast.parse((REPO_ROOT / TEST).read_text())
    functions = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    }
    assert {n.partition("::")[2].partition("[")[0] for n in outcomes} == functions

    gate = record["b12x_gate"]
    assert gate, "this machine can run the kernel: the skips are not tested"
    tally: Counter[str] = Counter()
    for nodeid, result in outcomes.items():
        outcome, reason = result["outcome"], result["reason"]
        if KERNEL_ID in _params(nodeid):
            assert outcome == "skipped", (nodeid, outcome, reason)
            assert KERNEL_REASON in reason and gate in reason, (nodeid, reason)
            tally["kernel skipped"] += 1
        elif outcome == "passed":
            tally["cpu passed"] += 1
        else:
            assert outcome == "skipped", (nodeid, outcome, reason)
            assert reason.startswith(CONFIG_REFUSAL), (nodeid, reason)
            assert "relu2" in nodeid, nodeid
            tally["cpu refused"] += 1
    upstream_measurements("fork layout outcomes", dict(tally))
    assert dict(tally) == EXPECTED, tally


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
