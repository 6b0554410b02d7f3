# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the installed FlashInfer provides (found without importing its
kernels' dependencies more than needed)."""

from __future__ import annotations

import functools
import importlib
import importlib.util

__all__ = ["has_flashinfer", "has_flashinfer_b12x_moe"]


@functools.cache
def has_flashinfer() -> bool:
    """Whether flashinfer-python is installed."""
    return importlib.util.find_spec("flashinfer") is not None


@functools.cache
def has_flashinfer_b12x_moe() -> bool:
    """Whether FlashInfer's CuteDSL SM12x fused MoE is available: its
    ``b12x_fused_moe`` and the scale-layout helper ``convert_sf_to_mma_layout``."""
    if not has_flashinfer():
        return False
    for module_name, attr in (
        ("flashinfer.fused_moe", "b12x_fused_moe"),
        ("flashinfer.cute_dsl.utils", "convert_sf_to_mma_layout"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return False
        if not hasattr(module, attr):
            return False
    return True
