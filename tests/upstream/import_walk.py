# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Import every module of a package in one process and record which import
and which fail: the body of the import-walk snippets of test_imports.py."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from typing import Any

__all__ = ["FIRST_IMPORTS", "walk_imports"]

#: Imported before the walk. vLLM 0.33.0's
#: ``fused_moe/experts/flashinfer_b12x_moe.py`` imported first hits a
#: circular import; through the NVFP4 oracle it does not.
FIRST_IMPORTS = ("vllm.model_executor.layers.fused_moe.oracle.nvfp4",)


def walk_imports(
    package: str = "vllm.model_executor", first: tuple[str, ...] = FIRST_IMPORTS
) -> dict[str, Any]:
    """Import ``first``, then every module under ``package`` in
    ``pkgutil.walk_packages`` order (which itself imports each subpackage to
    list it). Returns ``{"ok": [names], "failed": {name: "ExcType: message"},
    "first": {name: None or "ExcType: message"}}``. Every exception
    (``SystemExit`` too, not KeyboardInterrupt) is recorded, not raised. A
    module that failed once is not retried: a later import may succeed on a
    half-set ``sys.modules`` and would be misleading (without llguidance,
    for one, a fresh import of the NVFP4 oracle fails, yet the oracle imports
    later in the walk)."""
    first_errors: dict[str, str | None] = {}
    for name in first:
        try:
            importlib.import_module(name)
            first_errors[name] = None
        except (Exception, SystemExit) as e:  # recorded, not raised
            first_errors[name] = f"{type(e).__name__}: {e}"
    ok: list[str] = []
    failed: dict[str, str] = {}

    def onerror(name: str) -> None:
        exc = sys.exc_info()[1]
        failed[name] = f"{type(exc).__name__}: {exc}"

    try:
        root = importlib.import_module(package)
    except (Exception, SystemExit) as e:  # recorded, not raised
        failed[package] = f"{type(e).__name__}: {e}"
        return {"ok": ok, "failed": failed, "first": first_errors}
    for info in pkgutil.walk_packages(root.__path__, package + ".", onerror=onerror):
        if info.name in failed:
            continue
        try:
            importlib.import_module(info.name)
        except (Exception, SystemExit) as e:  # recorded, not raised
            failed[info.name] = f"{type(e).__name__}: {e}"
        else:
            ok.append(info.name)
    return {
        "ok": sorted(ok),
        "failed": dict(sorted(failed.items())),
        "first": first_errors,
    }
