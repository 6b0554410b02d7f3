# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Synthetic NVFP4 MoE layers of real model shapes, for benchmarks.

Random E2M1 codes with block and global scales of the magnitudes real
ModelOpt checkpoints have; nothing is downloaded.
"""

from __future__ import annotations

import torch

from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset

__all__ = ["SYNTHETIC_WEIGHT_STD", "synthetic_layer_tensors", "synthetic_w13"]


def _random_bytes(n: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    # int64 random_ fills 8 bytes per draw: much faster than uint8 randint.
    words = torch.empty(-(-n // 8), dtype=torch.int64, device=device)
    words.random_(generator=gen)
    return words.view(torch.uint8)[:n]


def _random_scales(shape, device, gen) -> torch.Tensor:
    # Block scales as a ModelOpt checkpoint has them: block amax / tensor amax
    # * 448, for Gaussian weights mostly 64..448: float8_e4m3fn bytes
    # 0x68..0x7E (64 is 0x68, 448 is 0x7E).
    raw = torch.randint(
        0x68, 0x7F, shape, dtype=torch.uint8, device=device, generator=gen
    )
    return raw.view(torch.float8_e4m3fn)


#: Nominal expert weight std of the synthetic layers (real checkpoints have
#: about 0.005-0.05); each expert's is drawn from [0.5, 1.5] times it.
SYNTHETIC_WEIGHT_STD = 0.02


def _global_scales(n: int, device, gen) -> torch.Tensor:
    """ModelOpt ``weight_scale_2`` = amax / (448 * 6) of Gaussian experts,
    amax ~ 5 std (the largest of about a million draws)."""
    std = SYNTHETIC_WEIGHT_STD * (0.5 + torch.rand(n, device=device, generator=gen))
    return 5 * std / (448 * 6)


def synthetic_w13(
    preset: MoEModelPreset,
    tp_size: int,
    device: torch.device,
    seed: int,
    num_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``w13_weight`` [E, rows, H/2] uint8 and ``w13_weight_scale``
    [E, rows, H/16] float8_e4m3fn (finite, positive) of the preset's shapes
    (E: ``num_experts``, default all of the preset's)."""
    rows = preset.w13_rows(tp_size)
    e, h = num_experts or preset.num_experts, preset.hidden_size
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = _random_bytes(e * rows * (h // 2), device, gen).view(e, rows, h // 2)
    return weight, _random_scales((e, rows, h // 16), device, gen)


def synthetic_layer_tensors(
    preset: MoEModelPreset,
    tp_size: int,
    device: torch.device,
    seed: int,
    num_experts: int | None = None,
) -> dict[str, torch.Tensor]:
    """One MoE layer's ModelOpt NVFP4 parameters with random contents, keyed
    by FusedMoE parameter name (checkpoint layout): random codes, block and
    global scales of the magnitudes real checkpoints have (see
    ``_random_scales`` and ``SYNTHETIC_WEIGHT_STD``). w1 and w3 share a global
    scale, as ModelOpt exports them (and so the legacy fold is comparable).
    ``num_experts``: this rank's experts under expert parallelism (default
    all of the preset's); ``tp_size`` divides I."""
    e, h = num_experts or preset.num_experts, preset.hidden_size
    i = preset.intermediate_size_per_partition(tp_size)
    shards = 2 if preset.is_gated else 1
    w13, s13 = synthetic_w13(preset, tp_size, device, seed, e)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    g13 = _global_scales(e, device, gen).view(e, 1)
    g2 = _global_scales(e, device, gen)
    return {
        "w13_weight": w13,
        "w13_weight_scale": s13,
        "w13_weight_scale_2": g13.expand(e, shards).contiguous(),
        "w13_input_scale": torch.ones(e, shards, device=device),
        "w2_weight": _random_bytes(e * h * (i // 2), device, gen).view(e, h, i // 2),
        "w2_weight_scale": _random_scales((e, h, i // 16), device, gen),
        "w2_weight_scale_2": g2,
        "w2_input_scale": torch.ones(e, device=device),
    }
