# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's own reload tests (test_reload.py, test_direct_reload.py,
test_reload_moe_kernels.py from the 0.34.0 source release) on CPU with the
fork and with unmodified 0.34.0: the same outcome per test id
(upstream_reload_tests.py runs them)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from upstream_reload_tests import reload_test_outcomes, source_tree_problem

from upstream_env import UPSTREAM_VERSION, unmodified_tree, unmodified_tree_problem

pytestmark = pytest.mark.skipif(
    UPSTREAM_VERSION == "0.33.0",
    reason="the reload tests named are 0.34.0's (0.33.0 has no direct reload)",
)


@pytest.fixture(scope="module")
def runs():
    if problem := unmodified_tree_problem() or source_tree_problem():
        pytest.fail(problem, pytrace=False)  # the environment is active here
    return reload_test_outcomes()


def _summary(outcomes: dict) -> dict[str, int]:
    return dict(Counter(r["outcome"] for r in outcomes.values()))


@pytest.mark.slow
def test_upstreams_reload_tests_same_outcome_per_id(runs, upstream_measurements):
    fork, upstream = runs["fork"], runs["unmodified"]
    assert (
        Path(upstream["vllm_file"])
        .resolve()
        .is_relative_to(unmodified_tree().resolve())
    ), upstream["vllm_file"]
    assert "site-packages" in fork["vllm_file"], fork["vllm_file"]
    upstream_measurements(
        f"upstream's reload tests, unmodified {UPSTREAM_VERSION}",
        _summary(upstream["outcomes"]),
    )
    upstream_measurements("upstream's reload tests, fork", _summary(fork["outcomes"]))
    # Collected at all: upstream's files imported under both.
    assert len(upstream["outcomes"]) > 50, upstream["output"]
    differ = {
        test: (upstream["outcomes"].get(test, {}).get("outcome"), r["outcome"])
        for test, r in fork["outcomes"].items()
        if upstream["outcomes"].get(test, {}).get("outcome") != r["outcome"]
    }
    missing = sorted(set(upstream["outcomes"]) - set(fork["outcomes"]))
    assert differ == {} and missing == [], (differ, missing)
