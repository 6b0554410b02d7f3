# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A pytest plugin for a child pytest run (``-p pytest_outcomes``): writes
what the run collected and how each case ended, as JSON, to the file
``$PYTEST_OUTCOMES_FILE`` at the end of the session.

The JSON: ``collected`` (every node id collected, deselected ones included,
in collection order), ``deselected`` (node ids), ``outcomes`` ({node id:
{"outcome": "passed" | "failed" | "skipped" | "error", "reason": the skip
reason or the end of the failure's text, "teardown_failed": the end of a
teardown failure after the call, if any}}: the call's outcome, a teardown
failure after it does not change it), ``vllm_file`` (the ``__file__``
of the vllm the run imported, or None) and ``b12x_gate`` (the reason
``is_flashinfer_b12x_moe_available()`` gives there, "" where the kernel can
run; None where the branch's module is not importable).

Harness only: it lives outside the test tree it observes, so the tree stays
as upstream's would be."""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import pytest

__all__ = ["OUTCOMES_ENV"]

#: Where the plugin writes its JSON.
OUTCOMES_ENV = "PYTEST_OUTCOMES_FILE"

_B12X_CALL = "vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call"
_collected: list[str] = []
_deselected: list[str] = []
_outcomes: dict[str, dict[str, str]] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # First of the hooks: every item, before -k / --deselect remove some.
    _collected.extend(item.nodeid for item in items)


def pytest_deselected(items: list[pytest.Item]) -> None:
    _deselected.extend(item.nodeid for item in items)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _outcomes.get(report.nodeid)
    if report.when == "teardown" and report.failed and entry is not None:
        # The call's outcome stands (upstream's CPU-unaware autouse fixtures
        # fail at teardown without an accelerator); the failure is noted.
        entry["teardown_failed"] = str(report.longrepr)[-300:]
        return
    if report.when == "call" or report.skipped or report.failed:
        if entry is not None and entry["outcome"] != "passed":
            return  # a setup failure or skip stays what the case ended as
        if report.skipped:
            _outcomes[report.nodeid] = {
                "outcome": "skipped",
                "reason": _skip_reason(report),
            }
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
            _outcomes[report.nodeid] = {
                "outcome": outcome,
                "reason": str(report.longrepr)[-2000:],
            }
        else:
            _outcomes[report.nodeid] = {"outcome": "passed", "reason": ""}


def _b12x_gate() -> str | None:
    try:
        call = importlib.import_module(_B12X_CALL)
    except ImportError:
        return None
    support = call.is_flashinfer_b12x_moe_available()
    return "" if support else str(support.reason)


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    if not path:
        return
    vllm = sys.modules.get("vllm")
    data: dict[str, Any] = {
        "collected": _collected,
        "deselected": _deselected,
        "outcomes": _outcomes,
        "vllm_file": getattr(vllm, "__file__", None),
        "b12x_gate": _b12x_gate() if vllm is not None else None,
    }
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
