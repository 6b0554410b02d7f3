# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Check each PR of the source series against vLLM's size bands and its own tests.

    python tools/check_pr_series.py [--release V] [--json FILE]  # in .venv

Per release, per commit of build/source/vllm-<V> (v<V>..nvfp4moe): the lines it
adds under vllm/ (``git diff --numstat``; tests, docs and CI files are not
counted), within LIMITS; and the test files it adds or changes run from tests/
as upstream's CI runs them, twice: at the commit, where every test the PR adds
passes, and at its parent with the PR's test files put in, where each of those
tests (the test functions the parent does not define) fails or errors. Exit 1
when a check fails, 2 on an error.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import build_source_branch as bsb
from compare_upstream_tests import outcomes
from fork_manifest import load_manifest
from tool_cli import command, parser

__all__ = ["LIMITS", "added_lines", "check_release", "pr_commits"]

# Added lines under vllm/ (the pr-checklist's bands: < 50 low, <= 250 medium).
LIMITS = {"first": 50, "each": 250, "stack": 600}
FIRST_PR_FILES = {"vllm/model_executor/layers/quantization/utils/flashinfer_fp4_moe.py"}


def pr_commits(tree: Path, version: str) -> list[tuple[str, str]]:
    """(sha, title) of each commit of the series, oldest first."""
    log = bsb.git(tree, "log", "--reverse", "--format=%H %s", f"v{version}..nvfp4moe")
    return [tuple(line.split(" ", 1)) for line in log.splitlines()]  # type: ignore


def added_lines(tree: Path, rev: str) -> dict[str, int]:
    """{path: lines added} under vllm/ by the commit ``rev``."""
    out = bsb.git(tree, "diff", "--numstat", f"{rev}^", rev, "--", "vllm/")
    return {p: int(a) for a, _, p in (ln.split("\t") for ln in out.splitlines())}


def _tests_of(tree: Path, rev: str) -> list[str]:
    """The files under tests/ the commit ``rev`` adds or changes."""
    out = bsb.git(tree, "diff", "--name-only", f"{rev}^", rev, "--", "tests/")
    return out.split()


def _pytest(tree: Path, files: list[str], junit: Path) -> dict[str, str]:
    """Outcomes of ``files`` (tests/ paths) run from ``tree``/tests, with that
    tree's vllm first on the path (VLLM_TARGET_DEVICE=cpu on a CPU machine)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    rel = [f.removeprefix("tests/") for f in files if Path(f).name.startswith("test_")]
    if not rel:  # pytest without files would collect all of tests/
        return {}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}", *rel]
    junit.unlink(missing_ok=True)
    subprocess.run(cmd, cwd=tree / "tests", env=env, capture_output=True)
    return outcomes(junit) if junit.is_file() else {}


def check_release(version: str) -> list[dict]:
    """One record per PR of ``version``'s series (see the module docstring)."""
    tree = bsb.source_tree(version)
    records, total = [], 0
    with tempfile.TemporaryDirectory(dir=tree.parent) as scratch:
        work, xml = Path(scratch) / "tree", Path(scratch) / "junit.xml"
        bsb.git(tree, "worktree", "add", "-q", "--detach", str(work), f"v{version}")
        try:
            for k, (sha, title) in enumerate(pr_commits(tree, version)):
                added = added_lines(tree, sha)
                total += sum(added.values())
                files = _tests_of(tree, sha)
                bsb.git(work, "checkout", "-q", "-f", f"{sha}^")
                bsb.git(work, "clean", "-q", "-fd", "--", "tests/")
                old = {f: _test_names(work / f) for f in files}
                bsb.git(work, "checkout", sha, "--", *files)  # the PR's tests
                at_parent = _pytest(work, files, xml)
                bsb.git(work, "checkout", "-q", "-f", sha)
                at_pr = _pytest(work, files, xml)
                new = sorted(t for t in at_pr if not _existed(t, old))
                records.append(
                    _verdict(k, title, added, total, new, at_pr, at_parent, version)
                )
        finally:
            bsb.git(tree, "worktree", "remove", "--force", str(work))
    return records


def _test_names(path: Path) -> set[str]:
    """The test functions a file defines (none if it does not exist)."""
    if not path.is_file():
        return set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _existed(test: str, old: dict[str, set[str]]) -> bool:
    """Whether the parent defines ``test`` (junit's module::name[params])."""
    module, _, name = test.partition("::")
    path = module.replace(".", "/") + ".py"
    return name.split("[")[0] in old.get(path, set())


def _verdict(k, title, added, total, new, at_pr, at_parent, version) -> dict:
    lines = sum(added.values())
    problems = []
    limit = LIMITS["first"] if k == 0 else LIMITS["each"]
    if lines > limit:
        problems.append(f"adds {lines} lines under vllm/ (at most {limit})")
    if total > LIMITS["stack"]:
        problems.append(
            f"the stack so far adds {total} lines (at most {LIMITS['stack']})"
        )
    if k == 0 and set(added) - FIRST_PR_FILES:
        problems.append(f"changes {sorted(set(added) - FIRST_PR_FILES)} under vllm/")
    if not new:
        problems.append("adds no test")
    problems += [
        f"{t} does not pass at the PR ({at_pr[t]})" for t in new if at_pr[t] != "passed"
    ]
    problems += [
        f"{t} passes at the parent"
        for t in new
        if at_parent.get(t, "error") in ("passed", "skipped")
    ]
    return {
        "release": version,
        "pr": k + 1,
        "title": title,
        "vllm_lines_added": lines,
        "vllm_files": added,
        "stack_lines_added": total,
        "new_tests": {t: [at_parent.get(t, "error"), at_pr[t]] for t in new},
        "problems": problems,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--json", type=Path, help="write the records here")
    args = p.parse_args(argv)

    def body() -> int:
        versions = args.release or list(load_manifest().releases)
        records = [r for v in versions for r in check_release(v)]
        for r in records:
            mark = "FAIL" if r["problems"] else "ok"
            parent = sum(a in ("failed", "error") for a, _ in r["new_tests"].values())
            print(
                f"{mark:4} vllm {r['release']} PR {r['pr']}: "
                f"+{r['vllm_lines_added']} lines under vllm/ "
                f"(stack {r['stack_lines_added']}), {len(r['new_tests'])} new tests: "
                f"{parent} fail at the parent, "
                f"{sum(b == 'passed' for _, b in r['new_tests'].values())} pass"
            )
            for problem in r["problems"]:
                print(f"     {problem}")
        if args.json:
            args.json.write_text(json.dumps(records, indent=1) + "\n")
        return 1 if any(r["problems"] for r in records) else 0

    return command("check_pr_series", body)


if __name__ == "__main__":
    sys.exit(main())
