# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run upstream's own tests on the tag and on the series, compared per test.

    python tools/compare_upstream_tests.py [--release V] [--quick]  # in .venv

SELECTION (--quick: QUICK) and the series' own test files, run from tests/ of
build/source/vllm-<V> at v<V> and at nvfp4moe (junit XML in
build/source/compare/<V>/). A regression: passed at the tag and anything else
on the branch; ran at the tag and skipped on it; new and failing; a failing
own test of an earlier commit. Prints every id whose outcome changed; exit 1
on a regression, 2 on an error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

import build_source_branch as bsb
from fork_manifest import load_manifest
from tool_cli import ToolError, command, parser

__all__ = ["QUICK", "SELECTION", "compare", "outcomes", "regressions"]

# Relative to tests/: the files that touch NVFP4, b12x or FlashInfer MoE, and
# the reload, weight-loading and quantization tests the series could break.
QUICK = (
    "kernels/moe/test_b12x.py",
    "kernels/moe/test_flashinfer*.py",
    "kernels/moe/test_nvfp4_moe.py",
    "kernels/moe/test_moe_kernel_oracle.py",
    "kernels/moe/test_moe_weight_loading_padded.py",
    "kernels/moe/test_trtllm_nvfp4_moe.py",
    "model_executor/model_loader/test_direct_reload.py",
)
SELECTION = QUICK + (
    "model_executor/model_loader/test_reload*.py",
    "model_executor/test_utils.py",
    "model_executor/test_weight_utils.py",
    "quantization/test_modelopt.py",
    "quantization/test_compressed_tensors.py",
)
BAD, KINDS = ("failed", "error"), ("passed", "failed", "error", "skipped")


def outcomes(junit: Path) -> dict[str, str]:
    """{test id: passed | failed | error | skipped}, the call's, from junit XML."""
    found: dict[str, str] = {}
    for case in ET.parse(junit).iter("testcase"):
        test = "::".join(filter(None, (case.get("classname"), case.get("name"))))
        said = [
            {"failure": "failed"}.get(c.tag, c.tag)
            for c in case
            if c.tag in ("failure", "error", "skipped")
            and not c.get("message", "").startswith("failed on teardown")
        ]
        if found.get(test, "passed") == "passed":  # a second element: teardown's
            found[test] = (said or ["passed"])[0]
    return found


def regressions(tag: dict[str, str], rev: dict[str, str]) -> list[str]:
    """ "! id: tag -> rev" for a regression, "  id: ..." for another change."""
    lines = []
    for test in sorted(tag.keys() | rev.keys()):
        a, b = tag.get(test, "absent"), rev.get(test, "absent")
        new_bad = a == "absent" and b not in ("skipped", "passed")
        bad = a == "passed" or (a in BAD and b == "skipped") or new_bad
        lines += [f"{'!' if bad else ' '} {test}: {a} -> {b}"] if a != b else []
    return lines


def _run(tree: Path, rev: str, files: list[str], junit: Path) -> dict[str, str]:
    bsb.git(tree, "checkout", "-q", rev)
    tests = tree / "tests"
    found = sorted({str(p.relative_to(tests)) for f in files for p in tests.glob(f)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    cmd += ["--continue-on-collection-errors", f"--junitxml={junit}", *found]
    # The sdist's vllm.egg-info (no "+cpu") is first on sys.path under pytest.
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    subprocess.run(cmd, cwd=tests, env=env, stdout=subprocess.DEVNULL)
    if not junit.is_file():
        raise ToolError(f"pytest wrote no {junit} at {rev} in {tree}")
    return outcomes(junit)


def _counts(found: dict[str, str]) -> str:
    said = ", ".join(f"{list(found.values()).count(k)} {k}" for k in KINDS)
    return f"{len(found)} tests: {said}"


def compare(tree: Path, version: str, selection: Sequence, out: Path) -> int:
    """Print the tag-to-branch changes of ``tree``, and each earlier commit's
    own test files' failures; the number of regressions."""
    tag, start, bad = f"v{version}", time.monotonic(), 0
    revs = bsb.git(tree, "rev-list", "--reverse", f"{tag}..{bsb.BRANCH}").split()
    out.mkdir(parents=True, exist_ok=True)

    def own(rev: str) -> list[str]:  # its test files, relative to tests/
        diff = bsb.git(tree, "diff", "--name-only", tag, rev, "--", "tests/*.py")
        return [f.removeprefix("tests/") for f in diff.split()]

    try:
        for i, rev in enumerate(revs[:-1], start=1):  # its own tests pass
            where = f"vllm {version} commit {i} {rev[:10]}"
            if not (files := own(rev)):
                print(f"{where}: no tests of its own")
                continue
            got = _run(tree, rev, files, out / f"commit{i}.xml")
            lines = [f"! {t}: {o}" for t, o in sorted(got.items()) if o in BAD]
            bad += len(lines)
            print(f"{where}: its own {_counts(got)}", *lines, sep="\n", flush=True)
        files = [*selection, *own(bsb.BRANCH)]
        base = _run(tree, tag, files, out / f"{tag}.xml")
        got = _run(tree, bsb.BRANCH, files, out / f"{bsb.BRANCH}.xml")
        lines = regressions(base, got)
        bad += sum(line.startswith("!") for line in lines)
        print(f"vllm {version} {tag}: {_counts(base)}")
        print(f"vllm {version} {bsb.BRANCH}: {_counts(got)}")
        print("\n".join(lines) or "  no outcome changed", flush=True)
    finally:
        bsb.git(tree, "checkout", "-q", bsb.BRANCH)
    print(f"vllm {version}: {time.monotonic() - start:.0f} s, {bad} regressions")
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--quick", action="store_true", help="QUICK, not SELECTION")
    args = p.parse_args(argv)

    def body() -> int:
        versions = args.release or list(load_manifest().releases)
        trees = {v: bsb.source_tree(v) for v in versions}  # before any switch
        bad = 0
        try:
            for v, tree in trees.items():
                bsb.switch_install(tree, v)
                selection = QUICK if args.quick else SELECTION
                bad += compare(tree, v, selection, bsb.BUILD / "compare" / v)
        finally:  # back to the tree the README installs
            if (bsb.BUILD / "vllm-0.34.0" / ".git").is_dir():
                bsb.switch_install(bsb.BUILD / "vllm-0.34.0", "0.34.0")
        return 1 if bad else 0

    return command("compare_upstream_tests", body)


if __name__ == "__main__":
    sys.exit(main())
