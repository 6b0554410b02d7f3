# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Environment variables this slice of vLLM reads, read when accessed.

import vllm.envs as envs
envs.VLLM_MOE_PREP_CPU_THREADS
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["environment_variables"]


def _non_negative_int(name: str, default: int) -> Callable[[], int]:
    def read() -> int:
        text = os.environ.get(name, "").strip()
        if not text:
            return default
        try:
            value = int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
        return value

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # Intra-op threads the bounded NVFP4 MoE weight preparation uses on CPU
    # (0: torch's current setting). One by default: the chunked steps issue
    # many short operations, and each parallel one waits for its slowest
    # thread; when another process shares the cores (tensor-parallel workers
    # preparing at the same moment) that wait dominated (measured in
    # docs/design/nvfp4_moe_weight_preparation.md, "Threads").
    "VLLM_MOE_PREP_CPU_THREADS": _non_negative_int("VLLM_MOE_PREP_CPU_THREADS", 1),
    # 1: a prepared MoE layer also checksums its parameters' bytes and checks
    # them at every forward and re-preparation (catches param.data.copy_, which
    # the version counter misses). A debug mode: it reads every weight.
    "VLLM_MOE_PREP_VERIFY": _non_negative_int("VLLM_MOE_PREP_VERIFY", 0),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
