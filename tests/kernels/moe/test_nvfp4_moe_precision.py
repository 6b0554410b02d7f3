# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Precision of the prepared layer against its checkpoint, at the weight
magnitudes real experts have: global scales kept as alphas (exact) vs folded
into FP8 block scales (upstream's contract)."""

import pytest
import torch

from tests.kernels.moe.utils import dequantized_checkpoint_layer, rel_rms_error
from vllm.benchmarks.legacy_moe_prep import split_cat_halves
from vllm.model_executor.layers.fused_moe import fused_moe
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)

E, H, I, TOPK, T = 8, 256, 128, 2, 64  # noqa: E741
STDS = [1.0, 0.02, 0.005]

# Tolerances, relative RMS of the layer output against the BF16 MoE on the
# checkpoint's exact (float32) dequantized weights, weights-only emulation.
#
# Shared gate/up global scales, "alpha": the prepared weights decode to the
# checkpoint's exactly; the two sides differ only in where float32 products
# round and hence, rarely, in a BF16 rounding of the intermediate or the
# output (<= 2^-9 ~ 0.002 each). Tolerance 0.01 [measured <= 1e-4; the fold
# mode: 0.046 at std 1.0, 0.14 at 0.02, 0.72 at 0.005].
SHARED_TOL = 0.01
# Different gate/up global scales: the smaller half's block scales are
# multiplied by the ratio (< 1) and rounded again to E4M3: a relative error
# uniform in +-2^-4 (3 mantissa bits) per block, RMS 2^-4 / sqrt(3) ~ 0.036,
# on one of the two FC1 halves only; through the gated product and FC2 about
# 0.036 / sqrt(2) ~ 0.025. Tolerance 0.05 [measured 0.026-0.031 at std
# 0.005-1.0; the fold mode: 0.043-0.73].
DIFFERING_TOL = 0.05


def _experts(std: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * std
    w2 = torch.randn(E, H, I, generator=gen) * std
    return w13.bfloat16(), w2.bfloat16()


def _inputs(std: float):
    # FC1 outputs of unit variance whatever the weight magnitude: SiLU works
    # in its non-linear range, so a gate/up swap is visible.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen) / (std * H**0.5)
    return x.bfloat16(), torch.randn(T, E, generator=gen)


def _prepared(ckpt, mode: str) -> FusedMoE:
    layer = FusedMoE(
        num_experts=E, top_k=TOPK, hidden_size=H, intermediate_size=I,
        quant_config=ModelOptNvFp4Config(), moe_backend="flashinfer_b12x_emulated",
        device="cpu", experts_kwargs={"weights_only": True, "global_scale_mode": mode},
    )  # fmt: skip
    ckpt.load_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _errors(tmp_path, fmt, std, shared):
    w13, w2 = _experts(std, seed=int(1000 * std) + shared)
    cfg = {"hidden_size": H, "num_experts": E, "num_experts_per_tok": TOPK,
           "moe_intermediate_size": I}  # fmt: skip
    write_nvfp4_moe_checkpoint(tmp_path, {0: (w13, w2)}, cfg, fmt=fmt,
                               shared_w13_global_scale=shared)  # fmt: skip
    ckpt = NVFP4MoECheckpoint(tmp_path)
    x, logits = _inputs(std)
    dw13, dw2 = dequantized_checkpoint_layer(ckpt, 0, gated=True)
    ref = fused_moe(x, dw13, dw2, logits, TOPK, renormalize=True)
    swapped = fused_moe(x, split_cat_halves(dw13, 1), dw2, logits, TOPK, True)
    out = {m: _prepared(ckpt, m)(x, logits) for m in ("alpha", "fold")}
    return (
        {m: rel_rms_error(o, ref) for m, o in out.items()},
        rel_rms_error(out["alpha"], swapped),
        ckpt,
    )


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("std", STDS)
def test_alpha_mode_computes_the_checkpoints_function(tmp_path, fmt, std):
    err, swapped, ckpt = _errors(tmp_path, fmt, std, shared=True)
    # ModelOpt-style global scales (amax / (448 * 6)), not powers of two.
    layer = _prepared(ckpt, "alpha")
    s2 = layer.w13_weight_scale_2
    assert torch.equal(s2[:, 0], s2[:, 1])
    assert not torch.equal(s2, torch.exp2(torch.round(torch.log2(s2))))
    assert err["alpha"] < SHARED_TOL, err
    # Negative controls: gate and up swapped misses by far at every
    # magnitude; the fold misses at real-checkpoint magnitudes, where folded
    # block scales fall below 2^-6 (FP8 subnormals: 1-3 significant bits).
    assert swapped > 20 * SHARED_TOL, swapped
    if std <= 0.02:
        assert err["fold"] > 2 * SHARED_TOL, err


@pytest.mark.parametrize("std", [1.0, 0.02])
def test_differing_gate_up_scales_keep_a_bounded_error(tmp_path, std):
    err, swapped, ckpt = _errors(tmp_path, MODELOPT, std, shared=False)
    layer = _prepared(ckpt, "alpha")
    # One alpha per expert: the larger of its two global scales.
    s2 = layer.w13_weight_scale_2
    assert torch.equal(s2[:, 0], s2[:, 1])
    assert err["alpha"] < DIFFERING_TOL, err
    assert swapped > 10 * DIFFERING_TOL, swapped
    if std <= 0.02:
        assert err["fold"] > err["alpha"], err
