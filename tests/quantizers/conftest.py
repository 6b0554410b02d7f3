# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/quantizers: checkpoints written by the real quantizers on CPU, read
and run by this tree.

Fixtures: ``quantized_case`` (each case quantized once per run, in a
session temporary directory; the tools are imported only here, when a case
is first asked for) and ``quantizer_measurements`` (printed at the end of the
run, in the section 'quantizer measurements').
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.quantizers.quantizer_env import LLMCOMPRESSOR, MODELOPT
from tests.quantizers.tiny_moe import MODELS, write_tiny_moe

_MEASUREMENTS: list[tuple[str, str]] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _MEASUREMENTS:
        terminalreporter.section("quantizer measurements")
        for key, value in _MEASUREMENTS:
            terminalreporter.write_line(f"{key}: {value}")


@pytest.fixture
def quantizer_measurements(
    record_property: Callable[[str, object], None],
) -> Callable[[str, object], None]:
    """``record(key, value)``: printed in the run's summary section
    'quantizer measurements' and recorded as a JUnit property of the test."""

    def record(key: str, value: object) -> None:
        _MEASUREMENTS.append((key, str(value)))
        record_property(key, value)

    return record


@pytest.fixture(scope="session")
def quantized_case(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    """``get(tool, model, scheme, shard)``: that tool's ``QuantizedCase`` of
    tiny model ``model`` (a name in ``tiny_moe.MODELS``) with ``scheme``,
    made once per run; each tiny model is written once. Nothing is fetched
    from the Hugging Face Hub (``HF_HUB_OFFLINE``, set before the tools are
    first imported, unless the environment says otherwise)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    models: dict[str, Path] = {}
    cases: dict[tuple[str, str, str, bool], Any] = {}

    def get(tool: str, model: str, scheme: str, shard: bool):
        key = (tool, model, scheme, shard)
        if key in cases:
            return cases[key]
        spec = MODELS[model]
        if model not in models:
            models[model] = write_tiny_moe(spec, tmp_path_factory.mktemp(model))
        out = tmp_path_factory.mktemp(f"{tool}-{model}-{scheme}")
        if tool == LLMCOMPRESSOR:
            from tests.quantizers.llmcompressor_tool import quantize_with_llmcompressor

            case = quantize_with_llmcompressor(spec, models[model], scheme, out, shard)
        elif tool == MODELOPT:
            from tests.quantizers.modelopt_tool import quantize_with_modelopt

            case = quantize_with_modelopt(spec, models[model], scheme, out, shard)
        else:
            raise ValueError(f"unknown tool {tool!r}")
        cases[key] = case
        return case

    return get
