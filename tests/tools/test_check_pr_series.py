# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/check_pr_series.py on a tiny source tree (a tag, two PR commits on
nvfp4moe): a PR whose new test fails at its parent and passes at the PR is
ok; a new test that passes at the parent, and lines over a band, are not."""

import shutil
import subprocess
import textwrap

import pytest

import build_source_branch as bsb
import check_pr_series
from check_pr_series import FIRST_PR_FILES, check_release

if shutil.which("git") is None:
    pytest.skip("git is not installed", allow_module_level=True)

(FIRST,) = FIRST_PR_FILES
MODULE = FIRST.removesuffix(".py").replace("/", ".")


def _commit(tree, files: dict[str, str], message: str) -> None:
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(textwrap.dedent(text))
    who = ["-c", "user.name=T", "-c", "user.email=t@x", "-c", "commit.gpgsign=false"]
    for args in (["add", "-A"], [*who, "commit", "-qm", message]):
        subprocess.run(["git", "-C", str(tree), *args], check=True)


def test_each_pr_is_checked_at_its_parent_and_at_itself(tmp_path, monkeypatch):
    tree = tmp_path / "vllm-9.9.0"
    subprocess.run(["git", "init", "-q", "-b", "nvfp4moe", str(tree)], check=True)
    _commit(tree, {"vllm/__init__.py": "", FIRST: "def f():\n    return 1\n"}, "v")
    subprocess.run(["git", "-C", str(tree), "tag", "v9.9.0"], check=True)
    # PR 1: its test reads what it changes (fails at the parent)
    test_f = f"from {MODULE} import f\n\n\ndef test_f():\n    assert f() == 2\n"
    _commit(tree, {FIRST: "def f():\n    return 2\n", "tests/test_f.py": test_f}, "1")
    # PR 2: three lines, and a test that passes without them
    pr2 = {"vllm/g.py": "a = 1\nb = 2\nc = 3\n"}
    _commit(tree, {**pr2, "tests/test_g.py": "def test_g():\n    pass\n"}, "2")
    monkeypatch.setattr(bsb, "source_tree", lambda version: tree)
    monkeypatch.setattr(check_pr_series, "LIMITS", {"first": 1, "each": 2, "stack": 3})
    first, second = check_release("9.9.0")
    assert first["problems"] == [], first
    assert first["new_tests"] == {"test_f::test_f": ["failed", "passed"]}
    assert (first["vllm_lines_added"], second["stack_lines_added"]) == (1, 4)
    assert second["problems"] == [
        "adds 3 lines under vllm/ (at most 2)",
        "the stack so far adds 4 lines (at most 3)",
        "test_g::test_g passes at the parent",
    ]
    # the tree is only read
    assert bsb.git(tree, "status", "--porcelain", "--untracked-files=all") == ""
