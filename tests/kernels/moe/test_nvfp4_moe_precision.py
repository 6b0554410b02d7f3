# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Precision of the prepared layer against its checkpoint, at the weight
magnitudes real experts have: global scales kept as alphas (exact) vs folded
into FP8 block scales (upstream's contract)."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe
from tests.kernels.moe.utils import (
    dequantized_checkpoint_layer,
    rel_rms_error,
    split_cat_halves,
)
from tests.model_loader.nvfp4_ckpt_utils import make_layer
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
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
# checkpoint's exact (float32) dequantized weights, BF16-activation emulation.
#
# Shared gate/up global scales, "alpha": the prepared weights decode to the
# checkpoint's exactly; the two sides differ only in where float32 products
# round and hence, rarely, in a BF16 rounding of the intermediate or the
# output (<= 2^-9 ~ 0.002 each). Tolerance 0.01 [measured <= 1e-4; the fold
# mode: 0.046 at std 1.0, 0.14 at 0.02, 0.72 at 0.005].
SHARED_TOL = 0.01
# Different gate/up global scales, "alpha": w1_alpha is the gate's scale and
# the ratio s_up / s_gate rides on w2_alpha (SiLU-and-mul is linear in up);
# no block scale is rewritten, so the layer computes the checkpoint's
# function up to BF16 roundings, and the tolerance is the same 0.01
# [measured 0.0032 at ratios 1.37 and 0.6, std 0.005-1.0: the emulation's
# BF16 intermediate rounds at act * s_gate / s_up, the reference's at act,
# <= 2^-9 each; with the ratio folded into the block scales instead (the
# earlier scheme) 0.026-0.031].
DIFFERING_TOL = SHARED_TOL
#: s_up / s_gate of the even and of the odd experts.
UP_GATE_RATIOS = (1.37, 0.6)


def _experts(std: float, seed: int, ratios: tuple[float, ...] | None = None):
    """w13 [E, 2I, H] ([gate; up]) and w2 [E, H, I] of weight std ``std``;
    with ``ratios``, expert e's up amax is ``ratios[e % len]`` times its gate
    amax (so are its global scales)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * std
    w2 = torch.randn(E, H, I, generator=gen) * std
    if ratios is not None:
        gate, up = w13[:, :I], w13[:, I:]
        target = torch.tensor([ratios[e % len(ratios)] for e in range(E)])
        amax = w13.abs().amax(dim=2)  # [E, 2I]
        factor = target * amax[:, :I].amax(1) / amax[:, I:].amax(1)
        up.mul_(factor.view(E, 1, 1))
        assert gate.data_ptr() == w13.data_ptr()
    return w13.bfloat16(), w2.bfloat16()


def _inputs(std: float):
    # FC1 outputs of unit variance whatever the weight magnitude: SiLU works
    # in its non-linear range, so a gate/up swap is visible.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen) / (std * H**0.5)
    return x.bfloat16(), torch.randn(T, E, generator=gen)


def _prepared(ckpt, mode: str) -> FusedMoE:
    layer = make_layer(
        experts_kwargs={"bf16_activations": True, "global_scale_mode": mode},
    )
    ckpt.load_layer(layer, 0)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _errors(tmp_path, fmt, std, shared, ratios=None):
    w13, w2 = _experts(std, seed=int(1000 * std) + shared, ratios=ratios)
    cfg = {
        "hidden_size": H,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": I,
    }
    write_nvfp4_moe_checkpoint(
        tmp_path, {0: (w13, w2)}, cfg, fmt=fmt, shared_w13_global_scale=shared
    )
    ckpt = NVFP4MoECheckpoint(tmp_path)
    x, logits = _inputs(std)
    dw13, dw2 = dequantized_checkpoint_layer(ckpt, 0, gated=True)
    ref = torch_moe(x, dw13, dw2, logits, TOPK, renormalize=True)
    swapped = torch_moe(x, split_cat_halves(dw13, 1), dw2, logits, TOPK, True)
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


def _checkpoint_w13_block_scales(ckpt) -> torch.Tensor:
    """Layer 0's w13 block scales [E, 2I, H/16] ([gate; up]) as stored."""
    parts = {
        (e, proj): t
        for _, e, proj, suffix, t in ckpt.iter_layer_tensors(0)
        if suffix == "weight_scale"
    }
    return torch.stack(
        [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(E)]
    )


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
@pytest.mark.parametrize("std", [1.0, 0.02, 0.005])
def test_differing_gate_up_scales_are_exact_in_alpha_mode(tmp_path, fmt, std):
    err, swapped, ckpt = _errors(
        tmp_path, fmt, std, shared=False, ratios=UP_GATE_RATIOS
    )
    layer = _prepared(ckpt, "alpha")
    # The checkpoint has the ratios asked for (BF16 rounding of the amax:
    # <= 2^-8 relative); columns [w3, w1] as the loader placed them.
    s2 = layer.w13_weight_scale_2
    ratio = s2[:, 0] / s2[:, 1]
    want = torch.tensor([UP_GATE_RATIOS[e % 2] for e in range(E)])
    torch.testing.assert_close(ratio, want, rtol=1 / 128, atol=0)
    assert err["alpha"] < DIFFERING_TOL, err
    # w1_alpha is the gate's own scale; w2_alpha carries the ratio and FC2's
    # input scale.
    kernel = layer.quant_method.experts.prepared
    assert torch.equal(kernel.w1_alpha, s2[:, 1])
    assert torch.equal(
        kernel.w2_alpha, layer.w2_weight_scale_2 * ratio * kernel.fc2_input_scale
    )
    # Nothing rewritten: the prepared block scales are the checkpoint's own,
    # reordered to [up; gate] and swizzled, byte for byte.
    stored = split_cat_halves(_checkpoint_w13_block_scales(ckpt), 1)
    assert torch.equal(
        layer.w13_weight_scale.view(torch.uint8),
        swizzle_blockscale(stored).view(torch.uint8),
    )
    # Negative controls: gate and up swapped; the ratio dropped from w2_alpha
    # (up's scale lost: 37% / 40% off on every expert); the fold at real
    # magnitudes.
    assert swapped > 20 * DIFFERING_TOL, swapped
    x, logits = _inputs(std)
    dw13, dw2 = dequantized_checkpoint_layer(ckpt, 0, gated=True)
    ref = torch_moe(x, dw13, dw2, logits, TOPK, renormalize=True)
    kernel.w2_alpha.copy_(layer.w2_weight_scale_2)
    dropped = rel_rms_error(layer(x, logits), ref)
    assert dropped > 10 * DIFFERING_TOL, dropped
    if std <= 0.02:
        assert err["fold"] > 2 * DIFFERING_TOL, err
