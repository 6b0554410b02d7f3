# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run upstream vLLM's own gates on the source branches' series.

    python tools/upstream_gates.py [--release V]    # in .venv-gates

HOOKS on the files the series adds or changes (a finding also printed at
v<V>, any line, is upstream's), a Signed-off-by on every commit, and STEP's
source_file_dependencies covering every changed file. Exit 1 if one fails.
The hooks run in a worktree of their own: build/source/vllm-<V> is only read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

import build_source_branch as bsb
from fork_manifest import load_manifest
from tool_cli import ToolError, command, parser

__all__ = ["HOOKS", "STEP", "gates"]

STEP = (".buildkite/test_areas/kernels.yaml", "kernels-moe-test")
# hook: its command and the files it takes: PY (the Python files), VLLM (those
# under vllm/), ALL, TESTS (tests/ and .buildkite/ files, as
# check_test_tethering's pattern) or NONE (it finds its own files).
PY, VLLM, ALL, TESTS, NONE = "py", "vllm", "all", "tests", "none"
_CHECKS = {"spdx_header": PY, "forbidden_imports": PY, "torch_cuda": PY}
_CHECKS |= {"init_lazy_imports": PY, "boolean_context_manager": PY}
_CHECKS |= {"trust_remote_code": VLLM, "test_tethering": TESTS}
_CHECKS |= {"buildkite_step_keys": NONE}
HOOKS = {
    "ruff check": (["ruff", "check", "--output-format", "concise"], PY),
    "ruff format": (["ruff", "format", "--check"], PY),
    "typos": (["typos", "--force-exclude", "--format", "brief"], ALL),
    "mypy": ([sys.executable, "tools/pre_commit/mypy.py", "3.11"], PY),
    "validate_config": ([sys.executable, "tools/pre_commit/validate_config.py"], ALL),
    **{
        f"check_{n}": ([sys.executable, f"tools/pre_commit/check_{n}.py"], kind)
        for n, kind in _CHECKS.items()
    },
}


def _findings(tree: Path, rev: str, changed: list[str]) -> dict[str, list[str]]:
    """{hook: what it printed if it failed} at ``rev``, on the files there."""
    bsb.git(tree, "checkout", "-q", "--detach", rev)
    files = [f for f in changed if (tree / f).is_file()]
    pick = {ALL: files, PY: [f for f in files if f.endswith(".py")], NONE: []}
    pick[VLLM] = [f for f in pick[PY] if f.startswith("vllm/")]
    pick[TESTS] = [f for f in files if f.startswith(("tests/", ".buildkite/"))]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = {}
    for name, (cmd, kind) in HOOKS.items():
        if kind != NONE and not pick[kind]:  # without files a hook takes all
            out[name] = []
            continue
        run = subprocess.run(
            [*cmd, *pick[kind]], cwd=tree, capture_output=True, text=True, env=env
        )
        said = (run.stdout + run.stderr).splitlines() if run.returncode else []
        out[name] = [s for s in said if s.strip()]
    return out


def _key(line: str) -> str:  # a finding, wherever its line moved
    return re.sub(r":\d+(:\d+)?:", ":", line).strip()


def gates(tree: Path, version: str) -> list[tuple[str, list[str], int]]:
    """[(gate, its findings new on the branch, how many were upstream's)]."""
    tag, branch = f"v{version}", bsb.BRANCH
    changed = bsb.git(tree, "diff", "--name-only", "--diff-filter=AM", tag, branch)
    with tempfile.TemporaryDirectory(dir=tree.parent) as scratch:
        work = Path(scratch) / "tree"
        bsb.git(tree, "worktree", "add", "-q", "--detach", str(work), tag)
        try:
            before = _findings(work, tag, changed.split())
            after = _findings(work, branch, changed.split())
        finally:
            bsb.git(tree, "worktree", "remove", "--force", str(work))
    results = []
    for name, lines in after.items():
        old = {_key(s) for s in before[name]}
        new = [s for s in lines if _key(s) not in old]
        results.append((name, new, len(lines) - len(new)))
    fmt = "%h %s|%an <%ae>|%(trailers:key=Signed-off-by,valueonly)"
    log = bsb.git(tree, "log", f"--format={fmt}", f"{tag}..{branch}").splitlines()
    commits = [s.split("|") for s in log if s.count("|") == 2]
    unsigned = [
        f"not signed off: {c}" for c, who, signed in commits if who not in signed
    ]
    try:
        steps = yaml.safe_load(bsb.git(tree, "show", f"{branch}:{STEP[0]}"))["steps"]
    except yaml.YAMLError as exc:
        raise ToolError(f"{tree / STEP[0]} on {branch}: {exc}") from None
    (deps,) = [s["source_file_dependencies"] for s in steps if s.get("key") == STEP[1]]
    missed = [
        f"not covered: {f}"
        for f in changed.split()
        if f != STEP[0] and not f.startswith(tuple(deps))
    ]
    return [*results, ("Signed-off-by", unsigned, 0), (f"{STEP[1]} deps", missed, 0)]


def main(argv: Sequence[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)

    def body() -> int:
        failed = 0
        for v in args.release or load_manifest().releases:
            for name, new, old in gates(bsb.source_tree(v), v):
                failed += bool(new)
                also = f" ({old} lines also at the tag: upstream's)" if old else ""
                print(f"vllm {v} {name}: {'FAILED' if new else 'passed'}{also}")
                print("".join(f"    {line}\n" for line in new), end="", flush=True)
        return 1 if failed else 0

    return command("upstream_gates", body)


if __name__ == "__main__":
    sys.exit(main())
