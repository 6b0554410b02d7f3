# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether this interpreter has the real quantizers tests/quantizers runs.

Looks only at installed distributions' metadata: imports none of the tools,
so the slice's own suite (``pytest tests``) collects tests/quantizers and
skips it in milliseconds.
"""

from __future__ import annotations

import importlib.metadata

__all__ = [
    "LLMCOMPRESSOR",
    "MODELOPT",
    "QUANTIZERS_COMMAND",
    "TOOL_PINS",
    "tool_problem",
]

LLMCOMPRESSOR = "llm-compressor"
MODELOPT = "modelopt"

#: The releases the tests were written against (requirements/
#: quantizers-cpu.txt pins them); a tool's tests skip on any other.
TOOL_PINS: dict[str, dict[str, str]] = {
    LLMCOMPRESSOR: {"llmcompressor": "0.14.0.1", "compressed-tensors": "0.19.0"},
    MODELOPT: {"nvidia-modelopt": "0.47.0"},
}
#: transformers range of llm-compressor 0.14.0.1 (both tools run on it).
_TRANSFORMERS_RANGE = ((5, 15, 0), (5, 17, 0))

#: How to run these tests for real; every skip reason names it.
QUANTIZERS_COMMAND = (
    "the command in README.md, '## Checkpoints from the real quantizers (CPU)' "
    "(builds .venv-quantizers, then runs `pytest tests/quantizers`)"
)


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+", 1)[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if digits != part:
            break
        parts.append(int(digits))
    return tuple(parts)


def tool_problem(tool: str) -> str | None:
    """Why ``tool`` (:data:`LLMCOMPRESSOR` or :data:`MODELOPT`) cannot be run
    here, or None: its pinned distributions at their pinned versions and a
    transformers in llm-compressor's range."""
    for dist, want in TOOL_PINS[tool].items():
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return f"{dist} is not installed"
        if have != want:
            return f"{dist} is {have}; these tests are written against {want}"
    try:
        have = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "transformers is not installed"
    low, high = _TRANSFORMERS_RANGE
    if not low <= _release(have)[:3] <= high:
        return (
            f"transformers is {have}; llm-compressor 0.14.0.1 takes "
            f"{'.'.join(map(str, low))} to {'.'.join(map(str, high))}"
        )
    return None
