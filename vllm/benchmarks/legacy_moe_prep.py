# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Baselines only: faithful models of the earlier NVFP4 MoE weight preparation.

Nothing on the production path imports this module; benchmarks compare the
bounded preparation against it.
"""

from __future__ import annotations

import torch

__all__ = ["clone_chunk_reorder", "split_cat_reorder"]


def split_cat_reorder(
    weight: torch.Tensor, scale: torch.Tensor, dim: int = -2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-change reorder: returns NEW tensors ``cat([w3, w1], dim)``.

    Peak: one full copy of ``weight`` and of ``scale`` alive beside the
    originals.
    """
    w1, w3 = weight.chunk(2, dim=dim)
    s1, s3 = scale.chunk(2, dim=dim)
    return (
        torch.cat([w3, w1], dim=dim).contiguous(),
        torch.cat([s3, s1], dim=dim).contiguous(),
    )


def clone_chunk_reorder(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dim: int = -2,
    chunk_bytes: int = 64 << 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first in-place fix: for each chunk of about ``chunk_bytes`` of the
    first half, ``tmp = a.clone(); a.copy_(b); b.copy_(tmp)``.

    Chunks run along the dimensions before ``dim`` (whole rows of halves, at
    least one per chunk); a fresh temporary is allocated for every chunk.
    Moves about 1.5x the bytes of a memcpy and pays the allocator per chunk.
    """
    for t in (weight, scale):
        d = dim % t.dim()
        outer = 1
        for s in t.shape[:d]:
            outer *= s
        halves = t.view(outer, 2, -1)
        row_bytes = halves.shape[2] * t.element_size()
        step = max(1, chunk_bytes // max(row_bytes, 1))
        for start in range(0, outer, step):
            a = halves[start : start + step, 0]
            b = halves[start : start + step, 1]
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)
            del tmp  # at most one chunk alive: the 64 MiB bound it promised
    return weight, scale
