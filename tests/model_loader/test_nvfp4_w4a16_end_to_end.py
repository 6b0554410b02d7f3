# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 checkpoints end to end: written in each format, read, prepared in
place for b12x and run through its emulation, against a BF16 MoE on the
checkpoint's exact dequantized weights; W4A4 checkpoints as before."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_moe
from tests.kernels.moe.utils import (
    dequantized_checkpoint_layer,
    rel_rms_error,
    split_cat_halves,
)
from tests.kernels.utils import bytes_of
from tests.model_loader.nvfp4_ckpt_utils import make_layer
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
    NVFP4MoECheckpoint,
)

E, H, I, TOPK, T = 8, 256, 128, 2, 64  # noqa: E741 (the facts file's names)
BACKEND = "flashinfer_b12x_emulated"
#: Expert weight std: the middle of real checkpoints' 0.005-0.05.
STD = 0.02
#: Relative RMS of the layer output against the BF16 MoE on the checkpoint's
#: exact (float32) dequantized weights. The W4A16 layout holds the
#: checkpoint's codes and block scales exactly (at this magnitude no block
#: scale is flushed: they are about 64-448 before the power-of-two factor), and
#: the per-expert alphas are exact; both sides take BF16 activations and
#: accumulate in FP32, so they differ where float32 products round differently
#: and hence, rarely, in a BF16 rounding of the intermediate or the output
#: (<= 2^-9 ~ 0.002 relative each). Tolerance 0.01.
TOL = 0.01

WAYS = {
    "modelopt": (MODELOPT, {}),
    "modelopt-mixed-precision": (MODELOPT, {"per_layer": True}),
    "compressed-tensors": (COMPRESSED_TENSORS, {}),
}


def _experts(gated: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * I if gated else I
    w13 = torch.randn(E, rows, H, generator=gen) * STD
    w2 = torch.randn(E, H, I, generator=gen) * STD
    return w13.bfloat16(), w2.bfloat16()


def _inputs():
    # FC1 outputs of unit variance: SiLU works in its non-linear range, so a
    # gate/up swap is visible.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen) / (STD * H**0.5)
    return x.bfloat16(), torch.randn(T, E, generator=gen)


def _write(path, fmt, gated, quant_mode, **kwargs):
    cfg = {
        "hidden_size": H,
        "num_experts": E,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": I,
        "num_hidden_layers": 2,
    }
    layers = {i: _experts(gated, seed=10 + i) for i in (0, 1)}
    block, prefix = ("mlp", "model.layers") if gated else ("mixer", "backbone.layers")
    write_nvfp4_moe_checkpoint(
        path,
        layers,
        cfg,
        fmt=fmt,
        gated=gated,
        block=block,
        prefix=prefix,
        quant_mode=quant_mode,
        shared_w13_global_scale=True,
        **kwargs,
    )
    return NVFP4MoECheckpoint(path)


def _prepared(ckpt, idx, gated, **kwargs):
    layer = make_layer(gated, quant_config=ckpt.quant_config(idx), **kwargs)
    ckpt.load_layer(layer, idx)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_w4a16_checkpoint_runs_within_bf16_tolerance(tmp_path, way, gated):
    fmt, kwargs = WAYS[way]
    ckpt = _write(tmp_path, fmt, gated, "w4a16", **kwargs)
    layer = _prepared(ckpt, 1, gated)
    assert layer.quant_method.quant_config.is_weight_only
    assert layer.weight_prep_state.status is PrepStatus.PREPARED
    # Prepared in place: the packed weights live in the loaded parameters.
    pw = layer.quant_method.experts.prepared
    for packed, param in ((pw.w13, layer.w13_weight), (pw.w2, layer.w2_weight)):
        assert packed.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    x, logits = _inputs()
    act = "silu" if gated else "relu2"
    dw13, dw2 = dequantized_checkpoint_layer(ckpt, 1, gated)
    ref = torch_moe(x, dw13, dw2, logits, TOPK, renormalize=True, activation=act)
    out = layer(x, logits)
    err = rel_rms_error(out, ref)
    assert err < TOL, err
    # Negative controls: the halves of w13 swapped (gate and up, or the two
    # halves of a non-gated expert's rows), and the global scale dropped
    # from one expert's w2 (its alpha), each miss by far.
    swapped = torch_moe(x, split_cat_halves(dw13, 1), dw2, logits, TOPK, True, act)
    assert rel_rms_error(out, swapped) > 20 * TOL
    unscaled = dw2.clone()
    unscaled[0] /= ckpt_scale_2(ckpt, 1, 0)
    wrong = torch_moe(x, dw13, unscaled, logits, TOPK, True, act)
    assert rel_rms_error(out, wrong) > 20 * TOL


def ckpt_scale_2(ckpt, idx, expert):
    """Expert ``expert``'s down_proj weight_scale_2 (ModelOpt direction)."""
    for _, _, proj, suffix, t in ckpt.iter_layer_tensors(
        idx, range(expert, expert + 1)
    ):
        if proj == "down_proj" and suffix == "weight_scale_2":
            return t.float().item()
    raise AssertionError("no down_proj weight_scale_2")


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_mixed_checkpoint_runs_each_layer_in_its_mode(tmp_path, fmt):
    ckpt = _write(tmp_path, fmt, True, {0: "w4a16", 1: "w4a4"})
    x, logits = _inputs()
    for idx, weight_only in ((0, True), (1, False)):
        kwargs = {} if weight_only else {"experts_kwargs": {"bf16_activations": True}}
        layer = _prepared(ckpt, idx, True, **kwargs)
        assert layer.quant_method.quant_config.is_weight_only is weight_only
        assert layer.quant_method.experts.weight_only is weight_only
        dw13, dw2 = dequantized_checkpoint_layer(ckpt, idx, True)
        ref = torch_moe(x, dw13, dw2, logits, TOPK, renormalize=True)
        assert rel_rms_error(layer(x, logits), ref) < TOL


@pytest.mark.parametrize("fmt", [MODELOPT, COMPRESSED_TENSORS])
def test_w4a4_checkpoint_prepares_as_before(tmp_path, fmt):
    # The reader's W4A4 path is unchanged: the same bytes as a layer built
    # with the default config and loaded tensor by tensor from the file.
    ckpt = _write(tmp_path, fmt, True, "w4a4")
    assert ckpt.quant_config(0).quant_mode == "w4a4"
    a = _prepared(ckpt, 0, True)
    b = make_layer()
    for name, e, proj, suffix, t in ckpt.iter_layer_tensors(0):
        shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
        param = getattr(b, f"{'w2' if shard == 'w2' else 'w13'}_{suffix}")
        b.weight_loader(param, t, name, shard, e)
    b.quant_method.process_weights_after_loading(b)
    for name, p in a.named_parameters():
        assert torch.equal(bytes_of(p), bytes_of(getattr(b, name))), name
