# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run upstream's own tests on the tag and on each commit of the series.

    python tools/compare_upstream_tests.py [--release V ...] [--out DIR]

In each tree of tools/build_source_branch.py (build/source/vllm-<V>, its
editable install switched to it), from tests/ as upstream's CI runs them:
SELECTION, plus every test file the series adds or changes, once per
revision (v<V>, then each commit up to nvfp4moe, checked out in place),
junit XML each (DIR/<V>/<rev>.xml). Per test id, the call's outcome (a
teardown error after it, CPU-only upstream fixtures, does not count). A
regression: passed on the tag and failed/errored, newly skipped, or gone on
a commit; or a test new on the branch that fails. Prints every id whose
outcome changed; exit 1 on a regression, 2 on an error.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

try:
    from tools import build_source_branch as bsb
except ImportError:  # run as `python tools/compare_upstream_tests.py`
    import build_source_branch as bsb

__all__ = ["SELECTION", "compare", "outcomes", "regressions"]

# Relative to tests/: what the series touches or could break, run on CPU.
SELECTION = (
    "kernels/moe/test_b12x.py",
    "kernels/moe/test_flashinfer_b12x_moe.py",
    "kernels/moe/test_nvfp4_moe.py",
    "kernels/moe/test_flashinfer.py",
    "kernels/moe/test_flashinfer_moe.py",
    "kernels/moe/test_flashinfer_cutedsl_layout.py",
    "kernels/moe/test_moe_kernel_oracle.py",
    "kernels/moe/test_moe_weight_loading_padded.py",
    "kernels/moe/test_trtllm_nvfp4_moe.py",
    "model_executor/model_loader/test_reload*.py",
    "model_executor/model_loader/test_direct_reload.py",
    "model_executor/test_utils.py",
    "model_executor/test_weight_utils.py",
    "quantization/test_modelopt.py",
    "quantization/test_compressed_tensors.py",
)
BAD = {"failed", "error"}


def outcomes(junit: Path) -> dict[str, str]:
    """{test id: passed | failed | error | skipped} from pytest's junit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        test = "::".join(filter(None, (case.get("classname"), case.get("name"))))
        kinds = [
            c.tag
            for c in case
            if c.tag in ("failure", "error", "skipped")
            and not c.get("message", "").startswith("failed on teardown")
        ]
        got = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
        if test not in found or found[test] == "passed":  # the call's, once
            found[test] = got
    return found


def regressions(tag: dict, rev: dict) -> list[str]:
    """Every id whose outcome changed, "id: tag -> rev", regressions marked !"""
    lines = []
    for test in sorted(tag.keys() | rev.keys()):
        a, b = tag.get(test, "absent"), rev.get(test, "absent")
        bad = (a == "passed" and b != "passed") or (a != "skipped" and b == "skipped")
        bad = bad or (a == "absent" and b in BAD)
        if a != b:
            lines.append(f"{'!' if bad else ' '} {test}: {a} -> {b}")
    return lines


def _run(tree: Path, rev: str, files: list[str], junit: Path) -> dict[str, str]:
    bsb.git(tree, "checkout", "-q", rev)
    found = sorted(
        {
            str(p.relative_to(tree / "tests"))
            for f in files
            for p in (tree / "tests").glob(f)
        }
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors"]
    subprocess.run(
        [*cmd, f"--junitxml={junit}", *found],
        cwd=tree / "tests",
        stdout=subprocess.DEVNULL,
    )
    if not junit.is_file():
        raise bsb.SourceError(f"pytest wrote no {junit} at {rev} in {tree}")
    return outcomes(junit)


def compare(tree: Path, version: str, out: Path) -> int:
    """Print the comparison of ``tree``'s revisions; the number of regressions."""
    tag = f"v{version}"
    revs = bsb.git(tree, "rev-list", "--reverse", f"{tag}..{bsb.BRANCH}").split()
    own = bsb.git(tree, "diff", "--name-only", tag, bsb.BRANCH, "--", "tests/")
    files = [
        *SELECTION,
        *(f[len("tests/") :] for f in own.split() if f.endswith(".py")),
    ]
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    try:
        start = time.monotonic()
        base = _run(tree, tag, files, out / f"{tag}.xml")
        for i, rev in enumerate(revs, start=1):
            got = _run(tree, rev, files, out / f"{bsb.BRANCH}~{len(revs) - i}.xml")
            lines = regressions(base, got)
            bad += sum(line.startswith("!") for line in lines)
            counts = {
                k: list(got.values()).count(k)
                for k in ("passed", "failed", "error", "skipped")
            }
            print(
                f"vllm {version} {tag} -> commit {i}/{len(revs)} {rev[:12]}: {len(got)} ran {counts}"
            )
            print("\n".join(lines) or "  no outcome changed")
        print(f"vllm {version}: {time.monotonic() - start:.0f} s, {bad} regressions")
    finally:
        bsb.git(tree, "checkout", "-q", bsb.BRANCH)
    return bad


def _switch(tree: Path, version: str) -> None:
    """The editable install follows ``tree`` (a no-op where it already does)."""
    where = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__file__)"],
        capture_output=True,
        text=True,
        cwd="/",
    ).stdout.strip()
    if Path(where) != tree.resolve() / "vllm" / "__init__.py":
        wheel = next(tree.parent.glob(f"vllm-{version}-*.whl"))
        bsb.install(tree, wheel, version, requirements=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="compare_upstream_tests", description=__doc__.splitlines()[0]
    )
    p.add_argument("--release", action="append", help="default: 0.34.0 and 0.33.0")
    p.add_argument(
        "--out", type=Path, default=bsb.ROOT / "build" / "source" / "compare"
    )
    args = p.parse_args(argv)
    build = bsb.ROOT / "build" / "source"
    trees = {v: build / f"vllm-{v}" for v in args.release or ["0.34.0", "0.33.0"]}
    bad = 0
    try:
        for v, tree in trees.items():
            if not (tree / ".git").is_dir() or not any(build.glob(f"vllm-{v}-*.whl")):
                raise bsb.SourceError(
                    f"no {tree}: run tools/build_source_branch.py first"
                )
            _switch(tree, v)
            bad += compare(tree, v, args.out / v)
    except bsb.SourceError as exc:
        print(f"compare_upstream_tests: {exc}", file=sys.stderr)
        return 2
    finally:  # back to the tree the README installs
        if (build / "vllm-0.34.0" / ".git").is_dir():
            _switch(build / "vllm-0.34.0", "0.34.0")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
