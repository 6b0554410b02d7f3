# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run upstream vLLM's own gates on the source branches' series.

    python tools/upstream_gates.py [--release V ...]    # in .venv-gates

On the files the series adds or changes (git diff v<V>..nvfp4moe in
build/source/vllm-<V>, from tools/build_source_branch.py), from the tree, as
upstream's .pre-commit-config.yaml hooks run them: ruff check, ruff format,
typos, mypy (tools/pre_commit/mypy.py 3.11) and its check_spdx_header,
check_forbidden_imports, check_torch_cuda, check_init_lazy_imports and
check_test_tethering scripts; then a Signed-off-by of its author on every
commit, and the Buildkite step kernels-moe-test's source_file_dependencies
covering every file the series adds or changes. A hook's finding that the
same hook prints at the tag (the same file and text, any line) is upstream's
and does not fail the gate. Prints each gate's result with its new findings;
exit 1 if any gate fails, 2 on an error.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

try:
    from tools import build_source_branch as bsb
except ImportError:  # run as `python tools/upstream_gates.py`
    import build_source_branch as bsb

__all__ = ["STEP", "gates"]

STEP = (".buildkite/test_areas/kernels.yaml", "kernels-moe-test")


def _hooks(py: list[str], changed: list[str]) -> dict[str, list[str]]:
    """Each hook's command line, with the files its ``types``/``files`` pass."""
    tethered = [f for f in changed if f.startswith(("tests/", ".buildkite/"))]
    script = [sys.executable, "tools/pre_commit/{}.py"]
    return {
        "ruff check": ["ruff", "check", "--output-format", "concise", *py],
        "ruff format": ["ruff", "format", "--check", *py],
        "typos": ["typos", "--force-exclude", "--format", "brief", *changed],
        "mypy": [*script, "3.11", *py],
        "check_spdx_header": [*script, *py],
        "check_forbidden_imports": [*script, *py],
        "check_torch_cuda": [*script, *py],
        "check_init_lazy_imports": [*script, *py],
        "check_test_tethering": [*script, *tethered],
    }


def _findings(tree: Path, rev: str, changed: list[str]) -> dict[str, list[str]]:
    """{hook: the lines it printed when failing} at ``rev``, on those of
    ``changed`` that exist there."""
    bsb.git(tree, "checkout", "-q", rev)
    files = [f for f in changed if (tree / f).is_file()]
    py = [f for f in files if f.endswith(".py")]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    out = {}
    for name, cmd in _hooks(py, files).items():
        cmd = [c.format(name) if c.endswith("{}.py") else c for c in cmd]
        env = {**os.environ, "PATH": path}
        run = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
        said = (run.stdout + run.stderr).splitlines() if run.returncode else []
        out[name] = [line for line in said if line.strip()]
    return out


def _key(line: str) -> str:  # a finding without its position
    return re.sub(r":\d+(:\d+)?:", ":", line).strip()


def gates(tree: Path, version: str) -> list[tuple[str, list[str], int]]:
    """[(gate, its findings new on the branch, findings upstream's own
    lines already had at the tag)] on ``tree``'s series."""
    tag = f"v{version}"
    diff = bsb.git(tree, "diff", "--name-only", "--diff-filter=AM", tag, bsb.BRANCH)
    changed = diff.split()
    try:
        before = _findings(tree, tag, changed)
        after = _findings(tree, bsb.BRANCH, changed)
    finally:
        bsb.git(tree, "checkout", "-q", bsb.BRANCH)
    results = []
    for name, lines in after.items():
        old = {_key(line) for line in before[name]}
        new = [line for line in lines if _key(line) not in old]
        results.append((name, new, len(lines) - len(new)))
    log = bsb.git(
        tree,
        "log",
        "--format=%h %s|%an <%ae>|%(trailers:key=Signed-off-by,valueonly)",
        f"{tag}..{bsb.BRANCH}",
    )
    fields = [line.split("|") for line in log.splitlines() if line.count("|") == 2]
    unsigned = [
        f"not signed off: {c}" for c, who, signed in fields if who not in signed
    ]
    results.append(("Signed-off-by", unsigned, 0))
    steps = yaml.safe_load((tree / STEP[0]).read_text())["steps"]
    (step,) = [s for s in steps if s.get("key") == STEP[1]]
    deps = step.get("source_file_dependencies", [])
    missed = [
        f"not covered: {f}"
        for f in changed
        if f != STEP[0] and not any(f.startswith(d) for d in deps)
    ]
    results.append((f"{STEP[1]} dependencies", missed, 0))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="upstream_gates", description=__doc__.splitlines()[0]
    )
    p.add_argument("--release", action="append", help="default: 0.34.0 and 0.33.0")
    args = p.parse_args(argv)
    failed = 0
    try:
        for v in args.release or ["0.34.0", "0.33.0"]:
            tree = bsb.ROOT / "build" / "source" / f"vllm-{v}"
            if not (tree / ".git").is_dir():
                raise bsb.SourceError(
                    f"no {tree}: run tools/build_source_branch.py first"
                )
            for name, new, old in gates(tree, v):
                failed += bool(new)
                also = f" ({old} lines also at the tag: upstream's)" if old else ""
                print(f"vllm {v} {name}: {'FAILED' if new else 'passed'}{also}")
                print("".join(f"    {line}\n" for line in new), end="")
    except (bsb.SourceError, OSError, ValueError, yaml.YAMLError) as exc:
        print(f"upstream_gates: {exc}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
