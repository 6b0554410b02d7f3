# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a run checks: the layer count asked for, and that two preparations
give the same bytes."""

from __future__ import annotations

import torch

from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset

__all__ = [
    "check_num_layers",
    "same_bytes",
]


def check_num_layers(preset: MoEModelPreset, num_layers: int | None) -> int:
    """The number of layers to run (``None``: all of ``preset``'s), or the
    command line's ValueError; the job checks it before spawning ranks."""
    layers = preset.num_moe_layers if num_layers is None else num_layers
    if not 1 <= layers <= preset.num_moe_layers:
        raise ValueError(
            f"--num-layers must be in [1, {preset.num_moe_layers}] for "
            f"{preset.name}, got {layers}"
        )
    return layers


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` have the same shape and the same bytes (any dtypes)."""
    return tuple(a.shape) == tuple(b.shape) and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )
