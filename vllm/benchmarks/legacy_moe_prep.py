# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Baselines only: faithful models of the earlier NVFP4 MoE weight preparation.

Nothing on the production path imports this module; benchmarks compare the
bounded preparation against it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
    swizzled_blockscale_shape,
)

__all__ = [
    "clone_chunk_reorder",
    "float_chunk_fold_",
    "split_cat_halves",
    "legacy_fold",
    "legacy_preparation_steps",
    "legacy_swizzle",
    "split_cat_reorder",
]


def split_cat_halves(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """A NEW tensor with the two halves of ``t`` along ``dim`` swapped,
    built with split + cat: ``[a; b] -> [b; a]``. Also the tests' independent
    reference for the in-place reorder."""
    first, second = t.chunk(2, dim=dim)
    return torch.cat([second, first], dim=dim).contiguous()


def split_cat_reorder(
    weight: torch.Tensor, scale: torch.Tensor, dim: int = -2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-change reorder: returns NEW tensors ``cat([w3, w1], dim)``.

    Peak: one full copy of ``weight`` and of ``scale`` alive beside the
    originals.
    """
    return split_cat_halves(weight, dim), split_cat_halves(scale, dim)


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


def legacy_swizzle(scale: torch.Tensor) -> torch.Tensor:
    """Pre-change swizzle of [E, R, C] scales: an explicit zero-padded copy of
    the whole tensor, then a permuted contiguous copy (2x the scale's size
    alive beside the original)."""
    e, r, c = scale.shape
    rp, cp = swizzled_blockscale_shape(r, c)
    padded = torch.zeros((e, rp, cp), dtype=torch.uint8, device=scale.device)
    padded[:, :r, :c] = scale.view(torch.uint8)
    return swizzle_blockscale(padded).view(torch.float8_e4m3fn)


def legacy_fold(scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Pre-change fold on the whole (swizzled) tensor:
    ``(scale.float() * scale_2) -> fp8`` with one global scale per expert
    (for w13, w1's: a different w3 scale was dropped with a warning).
    Float32 temporaries of 4x the scale's size, twice."""
    e = scale.shape[0]
    per_expert = scale_2.reshape(e, -1)[:, 0].view(e, 1, 1)
    folded = scale.float() * per_expert
    return folded.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def float_chunk_fold_(
    scale: torch.Tensor, scale_2: torch.Tensor, chunk_bytes: int = 2 << 20
) -> torch.Tensor:
    """The first bounded fold (before the lookup tables), in place: whole
    experts at a time through a float32 buffer of ``chunk_bytes``:
    ``fp8(clamp(float(scale) * scale_2))``, ``scale_2`` [E] or [E, G] (G row
    groups). Assumes one expert's float32 copy fits the buffer."""
    e, r, c = scale.shape
    groups = scale_2.reshape(e, -1).shape[1]
    segs = scale.view(e, groups, (r // groups) * c)
    factors = scale_2.reshape(e, groups, 1).float()
    per = max(1, chunk_bytes // (4 * r * c))
    buf = torch.empty(per * r * c, dtype=torch.float32, device=scale.device)
    for first in range(0, e, per):
        src = segs[first : first + per]
        tmp = buf[: src.numel()].view(src.shape)
        tmp.copy_(src)  # FP8 -> float32: most of this fold's time
        tmp.mul_(factors[first : first + per])
        tmp.clamp_(-448.0, 448.0)
        src.copy_(tmp)
    return scale


def legacy_preparation_steps(
    tensors: dict[str, torch.Tensor], gated: bool
) -> list[tuple[str, Callable[[], None]]]:
    """The pre-change b12x preparation as named steps over ``tensors`` (the
    layer's parameters by name), each replacing the entries it rewrites, so
    old tensors are freed as in a layer whose parameters are replaced:
    ``reorder`` (split + cat), ``swizzle`` (padded + permuted copies),
    ``fold`` (float32 whole-tensor products)."""

    def reorder() -> None:
        if gated:
            w, s = split_cat_reorder(tensors["w13_weight"], tensors["w13_weight_scale"])
            tensors["w13_weight"], tensors["w13_weight_scale"] = w, s
            del w, s

    def swizzle() -> None:
        for name in ("w13_weight_scale", "w2_weight_scale"):
            tensors[name] = legacy_swizzle(tensors[name])

    def fold() -> None:
        for name in ("w13", "w2"):
            tensors[f"{name}_weight_scale"] = legacy_fold(
                tensors[f"{name}_weight_scale"], tensors[f"{name}_weight_scale_2"]
            )
            tensors[f"{name}_weight_scale_2"] = torch.ones_like(
                tensors[f"{name}_weight_scale_2"]
            )

    return [("reorder", reorder), ("swizzle", swizzle), ("fold", fold)]
