# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cached hardware facts of the current platform (vLLM's names)."""

from __future__ import annotations

from functools import cache

__all__ = ["num_compute_units"]


@cache
def num_compute_units(device_id: int | None = 0) -> int:
    """The number of compute units of the current device (NVIDIA SMs)."""
    from vllm.platforms import current_platform

    return current_platform.num_compute_units(device_id)
