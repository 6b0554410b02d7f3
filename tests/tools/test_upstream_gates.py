# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tools/upstream_gates.py on a tiny git tree with stand-in hooks: a finding
upstream's own lines already had at the tag does not fail a gate, a new one
does; an unsigned commit and a changed file outside the Buildkite step's
source_file_dependencies fail theirs; the tree itself is only read."""

import shutil
import sys
from pathlib import Path

import pytest

if shutil.which("git") is None:
    pytest.skip("git is not installed", allow_module_level=True)

import upstream_gates  # noqa: E402
from build_source_branch import BRANCH, git  # noqa: E402

# Prints "<file>:<line>: shout" for each line holding SHOUT; fails if any.
LINT = (
    "import sys\n"
    "hits = [f'{f}:{i}: shout' for f in sys.argv[1:]\n"
    "        for i, s in enumerate(open(f), 1) if 'SHOUT' in s]\n"
    "print(*hits, sep='\\n'); sys.exit(bool(hits))"
)
STEP = "steps:\n- key: kernels-moe-test\n  source_file_dependencies:\n  - vllm/\n"


def _commit(tree: Path, message: str, files: dict) -> None:
    for name, text in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    git(tree, "add", "-A")
    who = ["-c", "user.name=A", "-c", "user.email=a@x"]
    git(tree, *who, "commit", "-q", "-m", message)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    hooks = {"lint": ([sys.executable, "-c", LINT], upstream_gates.PY)}
    monkeypatch.setattr(upstream_gates, "HOOKS", hooks)
    git(tmp_path, "init", "-q", "-b", BRANCH)
    _commit(
        tmp_path, "v", {"vllm/a.py": "x = 1  # SHOUT\n", upstream_gates.STEP[0]: STEP}
    )
    git(tmp_path, "tag", "v9.9.0")
    return tmp_path


def _results(tree):
    return {name: new for name, new, _ in upstream_gates.gates(tree, "9.9.0")}


def test_upstreams_own_findings_pass_new_ones_fail(tree):
    # The old finding moves to another line; the gate still passes.
    _commit(
        tree, "edit\n\nSigned-off-by: A <a@x>", {"vllm/a.py": "y = 2\nx = 1  # SHOUT\n"}
    )
    assert _results(tree) == {
        "lint": [],
        "Signed-off-by": [],
        "kernels-moe-test deps": [],
    }
    _commit(tree, "new\n\nSigned-off-by: A <a@x>", {"vllm/b.py": "z = 3  # SHOUT\n"})
    assert _results(tree)["lint"] == ["vllm/b.py:1: shout"]


def test_the_tree_is_only_read(tree):
    # another user of the tree has the tag checked out, a file of theirs in it
    _commit(tree, "new\n\nSigned-off-by: A <a@x>", {"vllm/b.py": "z = 3  # SHOUT\n"})
    git(tree, "checkout", "-q", "--detach", "v9.9.0")
    (tree / "theirs.txt").write_text("x\n")
    assert _results(tree)["lint"] == ["vllm/b.py:1: shout"]
    assert git(tree, "rev-parse", "HEAD") == git(tree, "rev-parse", "v9.9.0")
    assert git(tree, "status", "--porcelain") == "?? theirs.txt"
    assert git(tree, "worktree", "list").count("\n") == 0  # none left behind


def test_unsigned_commits_and_uncovered_files_fail(tree):
    _commit(tree, "unsigned", {"vllm/c.py": "c = 1\n"})
    _commit(tree, "signed\n\nSigned-off-by: A <a@x>", {"tests/test_c.py": "t = 1\n"})
    got = _results(tree)
    (unsigned,) = got["Signed-off-by"]
    assert unsigned.startswith("not signed off: ") and unsigned.endswith(" unsigned")
    assert got["kernels-moe-test deps"] == ["not covered: tests/test_c.py"]


def test_a_finding_moved_to_another_line_and_column_is_upstreams(tree, monkeypatch):
    # As ruff's concise output: "<file>:<line>:<column>: <message>".
    lint = LINT.replace("{i}: shout'", '{i}:{s.index("SHOUT")}: shout\'')
    hooks = {"lint": ([sys.executable, "-c", lint], upstream_gates.PY)}
    monkeypatch.setattr(upstream_gates, "HOOKS", hooks)
    moved = {"vllm/a.py": "y = 2\nx = 11  # SHOUT\n", "vllm/b.py": "# SHOUT\n"}
    _commit(tree, "edit\n\nSigned-off-by: A <a@x>", moved)
    (lint_result, *_) = upstream_gates.gates(tree, "9.9.0")
    assert lint_result == ("lint", ["vllm/b.py:1:2: shout"], 1)


def test_a_vllm_only_hook_gets_the_vllm_files_and_runs_without_none(tree, monkeypatch):
    # It prints the files it was given (none: it would check the whole tree).
    said = (
        "import sys\nprint(*(sys.argv[1:] or ['every file']), sep='\\n')\nsys.exit(1)"
    )
    hooks = {"vllm-only": ([sys.executable, "-c", said], upstream_gates.VLLM)}
    monkeypatch.setattr(upstream_gates, "HOOKS", hooks)
    _commit(tree, "tests\n\nSigned-off-by: A <a@x>", {"tests/test_b.py": "b = 1\n"})
    assert upstream_gates.gates(tree, "9.9.0")[0] == ("vllm-only", [], 0)
    _commit(tree, "vllm\n\nSigned-off-by: A <a@x>", {"vllm/b.py": "b = 1\n"})
    assert upstream_gates.gates(tree, "9.9.0")[0] == ("vllm-only", ["vllm/b.py"], 0)
