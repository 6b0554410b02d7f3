# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/compare_upstream_tests.py's reading of pytest's junit XML (the
call's outcome, CUDA-only teardown errors aside) and its verdict per test id,
on junit files pytest itself writes."""

import subprocess
import sys
import textwrap

import pytest

from compare_upstream_tests import outcomes, regressions

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
