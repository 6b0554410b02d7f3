# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/compare_upstream_tests.py's reading of pytest's junit XML (the
call's outcome, CUDA-only teardown errors aside) and its verdict per test id,
on junit files pytest itself writes."""

import shutil
import subprocess
import sys
import textwrap

import pytest

from compare_upstream_tests import compare, outcomes, regressions
from tool_cli import ToolError

TESTS = """
import pytest

@pytest.fixture
def cuda_cleanup():
    yield
    raise RuntimeError("Cannot access accelerator device when none is available.")

@pytest.fixture
def broken_setup():
    raise RuntimeError("no model download")

def test_pass():
    pass

def test_fail():
    assert False

def test_pass_then_teardown_error(cuda_cleanup):
    pass

def test_fail_then_teardown_error(cuda_cleanup):
    assert False

def test_setup_error(broken_setup):
    pass

@pytest.mark.skip(reason="SM120 only")
def test_skip():
    pass
"""


@pytest.fixture(scope="module")
def junit(tmp_path_factory):
    root = tmp_path_factory.mktemp("upstream")
    (root / "test_x.py").write_text(textwrap.dedent(TESTS))
    xml = root / "out.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    subprocess.run(
        [*cmd, f"--junitxml={xml}", "test_x.py"], cwd=root, capture_output=True
    )
    return xml


def test_the_calls_outcome_counts_not_a_teardown_error(junit):
    assert outcomes(junit) == {
        "test_x::test_pass": "passed",
        "test_x::test_fail": "failed",
        "test_x::test_pass_then_teardown_error": "passed",
        "test_x::test_fail_then_teardown_error": "failed",
        "test_x::test_setup_error": "error",
        "test_x::test_skip": "skipped",
    }
    # The file does hold a second element for the failing one (pytest's way).
    assert junit.read_text().count('name="test_fail_then_teardown_error"') == 2


@pytest.mark.parametrize(
    "before,after,regression",
    [
        ("passed", "failed", True),
        ("passed", "error", True),
        ("passed", "skipped", True),
        ("passed", "absent", True),  # gone
        ("failed", "skipped", True),  # newly skipped
        ("error", "skipped", True),
        ("absent", "failed", True),  # new and failing
        ("absent", "error", True),
        ("failed", "passed", False),
        ("error", "failed", False),
        ("skipped", "passed", False),
        ("skipped", "absent", False),  # upstream's module-level skip, reworked
        ("absent", "passed", False),
        ("absent", "skipped", False),  # a new GPU-only case, skipped with its reason
    ],
)
def test_which_changes_are_regressions(before, after, regression):
    tag = {} if before == "absent" else {"t": before}
    rev = {} if after == "absent" else {"t": after}
    (line,) = regressions({**tag, "same": "passed"}, {**rev, "same": "passed"})
    assert line == f"{'!' if regression else ' '} t: {before} -> {after}"


def _commit(tree, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(textwrap.dedent(text))
    who = ["-c", "user.name=T", "-c", "user.email=t@x", "-c", "commit.gpgsign=false"]
    for args in (["add", "-A"], [*who, "commit", "-qm", message]):
        subprocess.run(["git", "-C", str(tree), *args], check=True)


@pytest.mark.parametrize("broken", [None, "own", "upstream"])
def test_a_series_is_compared_on_its_tree_at_the_tag_and_on_the_branch(
    tmp_path, capsys, broken
):
    """A tiny source tree: a tag, a commit with a test of its own, the tip;
    ``broken`` names the test the series breaks."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    tree = tmp_path / "vllm-9.9.0"
    subprocess.run(["git", "init", "-q", "-b", "main", str(tree)], check=True)
    _commit(tree, {"tests/test_up.py": "def test_up():\n    pass\n"}, "release")
    subprocess.run(["git", "-C", str(tree), "tag", "v9.9.0"], check=True)
    own = "assert False" if broken == "own" else "pass"
    _commit(tree, {"tests/test_own.py": f"def test_own():\n    {own}\n"}, "PR 1")
    up = "assert False" if broken == "upstream" else "pass  # PR 2 edits it"
    _commit(tree, {"tests/test_up.py": f"def test_up():\n    {up}\n"}, "PR 2")
    subprocess.run(["git", "-C", str(tree), "branch", "nvfp4moe"], check=True)
    bad = compare(tree, "9.9.0", ["test_up.py"], tmp_path / "out")
    said = capsys.readouterr().out
    # a failing own test counts at its commit and, new and failing, at the tip
    assert bad == {None: 0, "own": 2, "upstream": 1}[broken], said
    assert "commit 1" in said and "its own 1 tests: " in said
    if broken == "upstream":
        assert "! test_up::test_up: passed -> failed" in said
    if broken == "own":  # at the tip, test_own is new and failing too
        assert "! test_own::test_own: failed" in said
    assert subprocess.run(
        ["git", "-C", str(tree), "symbolic-ref", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip() in ("nvfp4moe", "main")


def test_every_tree_is_checked_before_the_install_is_switched(monkeypatch, capsys):
    import build_source_branch as bsb
    import compare_upstream_tests

    def source_tree(version):
        if version == "0.33.0":
            raise ToolError("no build/source/vllm-0.33.0: run it")
        return bsb.BUILD / f"vllm-{version}"

    switched = []
    monkeypatch.setattr(bsb, "source_tree", source_tree)
    monkeypatch.setattr(bsb, "switch_install", lambda *a: switched.append(a))
    monkeypatch.setattr(compare_upstream_tests, "compare", lambda *a: 0)
    argv = ["--release", "0.34.0", "--release", "0.33.0"]
    assert compare_upstream_tests.main(argv) == 2
    assert "no build/source/vllm-0.33.0: run it" in capsys.readouterr().err
    assert switched == []
