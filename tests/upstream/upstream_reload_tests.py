# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's own weight-reload tests, from the release's source tree, run
on CPU twice: with the installed fork and with the unmodified release
(its tree first on ``PYTHONPATH``); their outcomes per test id.

The source release: ``$VLLM_UPSTREAM_SOURCE`` (an unpacked
``vllm-<release>.tar.gz``, or the source branch's tree), default
``build/source/vllm-<release>`` as ``tools/build_source_branch.py`` leaves
it. Only its ``tests/`` files are read: the reload test files and the
helpers they import (``tests/conftest.py``, ``tests/utils.py``,
``tests/models/utils.py`` and the packages' ``__init__.py``), copied into a
temporary tree at their paths, run from its ``tests/`` as upstream's CI runs
them (``cd tests && pytest model_executor/model_loader/<file>``). A call's
outcome counts; a teardown failure after it (upstream's autouse fixtures
need an accelerator) is noted, not counted.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from upstream_env import REPO_ROOT, UPSTREAM_VERSION, unmodified_tree
from upstream_test_tree import run_pytest

__all__ = [
    "RELOAD_TESTS",
    "SOURCE_ENV",
    "reload_test_outcomes",
    "source_tree",
    "source_tree_problem",
]

SOURCE_ENV = "VLLM_UPSTREAM_SOURCE"
#: Upstream's reload tests (0.34.0), relative to tests/.
RELOAD_TESTS = (
    "model_executor/model_loader/test_reload.py",
    "model_executor/model_loader/test_direct_reload.py",
    "model_executor/model_loader/test_reload_moe_kernels.py",
)
_SUPPORT = (
    "__init__.py",
    "ci_envs.py",
    "conftest.py",
    "utils.py",
    "models/__init__.py",
    "models/registry.py",
    "models/utils.py",
    "model_executor/__init__.py",
    "model_executor/model_loader/__init__.py",
)
# Both runs of the three files, each importing vLLM and its test conftest.
_TIMEOUT_S = 1500


def source_tree() -> Path:
    """The unpacked source release (see the module doc)."""
    default = f"build/source/vllm-{UPSTREAM_VERSION}"
    tree = Path(os.environ.get(SOURCE_ENV) or default)
    return tree if tree.is_absolute() else REPO_ROOT / tree


def source_tree_problem() -> str | None:
    """Why the source release's tests cannot be read, or None: a missing
    tree or file, or a tree of another release (its ``PKG-INFO`` or
    ``vllm/_version.py``)."""
    tree = source_tree()
    missing = [
        p for p in (*_SUPPORT, *RELOAD_TESTS) if not (tree / "tests" / p).is_file()
    ]
    if missing:
        return (
            f"no vLLM {UPSTREAM_VERSION} source tree with its tests at {tree} "
            f"(missing tests/{missing[0]}): run `python tools/build_source_branch.py` "
            f"or set {SOURCE_ENV} to an unpacked vllm-{UPSTREAM_VERSION}.tar.gz"
        )
    for name, pattern in (
        ("PKG-INFO", r"^Version:\s*(\S+)"),
        ("vllm/_version.py", r"__version__\s*=.*?['\"]([^'\"]+)['\"]"),
    ):
        path = tree / name
        if path.is_file():
            match = re.search(pattern, path.read_text(), re.MULTILINE)
            found = match.group(1) if match else "?"
            if not found.startswith(UPSTREAM_VERSION):
                return f"{path} says {found}, not {UPSTREAM_VERSION}"
            return None
    return f"{tree} has neither PKG-INFO nor vllm/_version.py to tell its release"


def _lay_out(root: Path) -> None:
    for rel in (*_SUPPORT, *RELOAD_TESTS):
        dst = root / "tests" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_tree() / "tests" / rel, dst)
    # Pins the rootdir (upstream's settings are in its pyproject.toml, which
    # the run does not need).
    (root / "pytest.ini").write_text("[pytest]\n")


def reload_test_outcomes() -> dict[str, Any]:
    """``{"fork": run, "unmodified": run}``, each ``{"returncode", "output"
    (its end), "vllm_file", "outcomes": {test id: record}}`` (records as
    tests/upstream/pytest_outcomes.py writes them)."""
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="upstream-reload-tests-") as tmp:
        root = Path(tmp)
        _lay_out(root)
        for who, path in (("fork", ()), ("unmodified", (unmodified_tree().resolve(),))):
            run = run_pytest(root, ["-q", *RELOAD_TESTS], _TIMEOUT_S, pythonpath=path)
            runs[who] = {
                "returncode": run.returncode,
                "output": run.output,
                "vllm_file": run.record.get("vllm_file"),
                "outcomes": run.record["outcomes"],
            }
    return runs
