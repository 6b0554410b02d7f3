# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/upstream: tests that run inside vLLM 0.34.0 or 0.33.0 itself,
installed from a fork wheel, on CPU.

Run them from this directory, in the environment README.md's '## Tests
inside vLLM 0.34.0 and 0.33.0 (CPU)' builds: ``VLLM_UPSTREAM_RELEASE=<release>
python -m pytest`` with that release's fork installed. This directory's
pytest.ini (importlib import mode, only this directory on ``sys.path``)
keeps the repository root, and with it this tree's own ``vllm/`` slice, off
``sys.path``, so ``import vllm`` loads the installed one. Where the upstream
environment is not active (upstream_env.environment_active: the slice's own
venv, or ``pytest tests`` from the root, whose ``pythonpath = ["."]`` puts
the slice first) every test here is collected and skipped with the reason;
nothing from vllm or flashinfer is imported then. Where it is active, a
missing piece (the installed vllm is not the fork of the expected release,
the unmodified release tree is absent) fails every test. The header of the
run names the release it ran against.

Fixtures: the CPU stand-ins (cpu_stand_ins.py) each undone after the test,
a one-rank vLLM context, the runner of snippets against the unmodified
release, its preparation reports (one subprocess per session for the small
shape, one for the Qwen3.6 layer), and ``upstream_measurements``, printed
at the end of the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import cpu_stand_ins
from upstream_env import (
    UPSTREAM_COMMAND,
    UPSTREAM_VERSION,
    environment_active,
    installed_vllm_problem,
    installed_vllm_version,
    run_unmodified_json,
    unmodified_tree,
    unmodified_tree_problem,
)

_HERE = Path(__file__).resolve().parent
_MEASUREMENTS: list[tuple[str, str]] = []


def _environment_problem() -> str | None:
    return installed_vllm_problem() or unmodified_tree_problem()


def pytest_report_header(config: pytest.Config) -> list[str]:
    active = "active" if environment_active() else "not active"
    return [
        f"upstream release expected: vLLM {UPSTREAM_VERSION} (environment {active})",
        f"installed vllm: {installed_vllm_version()}; unmodified tree: "
        f"{unmodified_tree()}",
    ]


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    problem = _environment_problem()
    if problem is None or environment_active():
        return  # inside the upstream environment: pytest_runtest_setup fails
    skip = pytest.mark.skip(
        reason=f"needs the vLLM {UPSTREAM_VERSION} fork installed: {problem}; "
        f"run {UPSTREAM_COMMAND}"
    )
    for item in items:
        if item.path.is_relative_to(_HERE):
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Inside the upstream environment a missing piece is a failure.
    if not item.path.is_relative_to(_HERE) or not environment_active():
        return
    if problem := _environment_problem():
        pytest.fail(
            f"the upstream environment is active but cannot run vLLM "
            f"{UPSTREAM_VERSION}'s tests: {problem}",
            pytrace=False,
        )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.section("upstream release")
    terminalreporter.write_line(
        f"ran against vLLM {UPSTREAM_VERSION}: installed {installed_vllm_version()}, "
        f"unmodified tree {unmodified_tree()}"
    )
    if _MEASUREMENTS:
        terminalreporter.section("upstream measurements")
        for key, value in _MEASUREMENTS:
            terminalreporter.write_line(f"{key}: {value}")


@pytest.fixture
def upstream_measurements(
    record_property: Callable[[str, object], None],
) -> Callable[[str, object], None]:
    """``record(key, value)``: printed in the run's summary section
    'upstream measurements' and recorded as a JUnit property of the test."""

    def record(key: str, value: object) -> None:
        _MEASUREMENTS.append((key, str(value)))
        record_property(key, value)
        print(f"{key}: {value}")

    return record


@pytest.fixture
def tensor_cuda_on_cpu() -> Iterator[None]:
    """``tensor.cuda()`` returns the tensor (upstream's swizzle ends in it)."""
    with cpu_stand_ins.tensor_cuda_returns_self():
        yield


@pytest.fixture
def b12x_supported_device() -> Iterator[None]:
    """``FlashInferB12xExperts._supports_current_device()`` says yes."""
    with cpu_stand_ins.b12x_device_supported():
        yield


@pytest.fixture
def flashinfer_mma_layout() -> Iterator[None]:
    """The b12x experts call FlashInfer's ``convert_sf_to_mma_layout``
    directly (it runs on CPU; vLLM's wrapper may refuse without a toolkit)."""
    with cpu_stand_ins.flashinfer_mma_layout_bound():
        yield


@pytest.fixture
def cuda_device_properties() -> Iterator[None]:
    """``torch.cuda.get_device_properties`` answers for an SM120-like card
    (FlashInfer's host code sizes a workspace from its SM count)."""
    with cpu_stand_ins.cuda_device_properties():
        yield


@pytest.fixture
def b12x_prep_on_cpu(
    tensor_cuda_on_cpu: None, b12x_supported_device: None, flashinfer_mma_layout: None
) -> None:
    """Every stand-in the FLASHINFER_B12X weight preparation needs on CPU."""


@pytest.fixture
def one_rank_b12x_vllm(b12x_prep_on_cpu: None) -> Iterator[Any]:
    """A current CPU ``VllmConfig`` with ``moe_backend="flashinfer_b12x"`` and
    a one-rank gloo group (upstream_layers.one_rank_vllm); yields the config."""
    from upstream_layers import one_rank_vllm

    with one_rank_vllm("flashinfer_b12x") as config:
        yield config


@pytest.fixture
def unmodified_upstream() -> Callable[..., Any]:
    """``run(snippet, **kwargs)``: the snippet's global ``result`` after it
    ran against the unmodified release in a subprocess
    (upstream_env.run_unmodified_json); skips when that tree is absent."""
    if problem := unmodified_tree_problem():
        pytest.skip(problem)
    return run_unmodified_json


# The unmodified release's preparation of the small layer, both formats: gate/up
# global scales equal and differing (UP_GATE_RATIO), with the function the
# prepared bytes encode.
_SMALL_PREP = """\
from upstream_layers import UP_GATE_RATIO
from upstream_reports import prep_reports_on_cpu
cases = [("small", "modelopt"), ("small", "compressed-tensors")]
result = {
    "equal": prep_reports_on_cpu(cases, function=True),
    "differing": prep_reports_on_cpu(
        cases, function=True, up_gate_ratio=UP_GATE_RATIO
    ),
}
"""

# The unmodified release at the Qwen3.6-35B-A3B layer, both formats, measured.
_QWEN36_PREP = """\
from upstream_reports import prep_reports_on_cpu
result = prep_reports_on_cpu(
    [("qwen3.6-35b-a3b", "modelopt"), ("qwen3.6-35b-a3b", "compressed-tensors")],
    measure=True,
)
"""


def _by_format(reports: list[dict]) -> dict[str, dict]:
    return {r["checkpoint_format"]: r for r in reports}


@pytest.fixture(scope="session")
def unmodified_small_reports() -> dict[str, dict[str, dict]]:
    """The unmodified release's reports (upstream_layers.prepare_and_report with
    ``function=True``) for the small layer: ``[scales][format]``, scales
    "equal" (gate and up share a global scale) or "differing"
    (``UP_GATE_RATIO``). One subprocess for the session; skips without the
    unmodified tree."""
    if problem := unmodified_tree_problem():
        pytest.skip(problem)
    result = run_unmodified_json(_SMALL_PREP)
    return {scales: _by_format(reports) for scales, reports in result.items()}


@pytest.fixture(scope="session")
def unmodified_qwen36_reports() -> dict[str, dict]:
    """The unmodified release's measured reports for the Qwen3.6-35B-A3B layer,
    by checkpoint format (peak transient, digests of the prepared bytes).
    One subprocess for the session; skips without the unmodified tree."""
    if problem := unmodified_tree_problem():
        pytest.skip(problem)
    return _by_format(run_unmodified_json(_QWEN36_PREP))
