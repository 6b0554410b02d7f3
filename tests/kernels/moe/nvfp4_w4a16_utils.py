# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared pieces of the W4A16 preparation tests: random packed tensors, a
ModelOpt W4A16 layer on the emulated b12x backend, checkpoint tensors and the
reference's packed bytes of them."""

import dataclasses

import torch

from tests.kernels.moe.utils import (
    bf16_experts,
    quantize_experts_modelopt,
)
from tests.kernels.utils import bytes_of
from tests.model_loader.nvfp4_ckpt_utils import make_layer
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
    W4A16PackedWeights,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_global_scale,
    w4a16_pack_blockscale,
    w4a16_pack_weight,
    w4a16_scale_exponent,
)

__all__ = [
    "BACKEND",
    "LAYERS",
    "LAYER_IDS",
    "PACKED_FIELDS",
    "MiB",
    "expected_packed",
    "packed_bytes",
    "prepare",
    "rand_scale",
    "rand_weight",
    "router_inputs",
    "w3w1",
    "w4a16_layer",
    "w4a16_tensors",
]

BACKEND = "flashinfer_b12x_emulated"
MiB = 1 << 20
#: What the W4A16 kernel reads of a prepared layer: the tensors of
#: ``experts.prepared``.
PACKED_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(W4A16PackedWeights)
    if f.type in ("torch.Tensor", torch.Tensor)
)


def rand_weight(e, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=gen)


def rand_scale(e, n, k, seed, top=0x60):
    gen = torch.Generator().manual_seed(seed)
    b = torch.randint(0, top, (e, n, k // 16), dtype=torch.uint8, generator=gen)
    return b.view(torch.float8_e4m3fn)


def w4a16_layer(
    e, h, i, gated, *, cap=None, place_w3w1=True, top_k=2, experts_kwargs=(), **kw
):
    """A FusedMoE with ModelOpt's W4A16 config on the emulated b12x
    backend; ``cap``: its preparation's ``max_transient_bytes`` (added to
    ``experts_kwargs``); other keywords go to FusedMoE."""
    kw.setdefault("device", None)  # torch's default device
    experts_kwargs = dict(experts_kwargs)
    if cap is not None:
        experts_kwargs["max_transient_bytes"] = cap
    return make_layer(
        gated,
        place_w3w1,
        e,
        h=h,
        i=i,
        top_k=top_k,
        mode="w4a16",
        experts_kwargs=experts_kwargs,
        **kw,
    )


def w4a16_tensors(e, h, i, gated, seed, std=0.02):
    w1, w2 = bf16_experts(e, i, h, gated=gated, seed=seed)
    # Real checkpoint magnitudes: expert weights of std ``std``.
    return quantize_experts_modelopt(
        w1.float() * std * h**0.5, w2.float() * std * i**0.5, gated
    )


def prepare(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def w3w1(t, i):
    """Checkpoint tensors with w13 as [w3; w1] (what the layer's loader
    places for b12x; a layer made with place_w3w1 takes them as they are)."""
    out = dict(t)
    out["w13_weight"] = torch.roll(t["w13_weight"], i, dims=1)
    scale = torch.roll(t["w13_weight_scale"].view(torch.uint8), i, dims=1)
    out["w13_weight_scale"] = scale.view(torch.float8_e4m3fn)
    out["w13_weight_scale_2"] = t["w13_weight_scale_2"].flip(1)
    return out


def expected_packed(t, gated, i):
    """The reference's packed weights of checkpoint tensors ([w1; w3])."""
    x13 = w4a16_scale_exponent(t["w13_weight_scale"])
    x2 = w4a16_scale_exponent(t["w2_weight_scale"])
    e = t["w13_weight"].shape[0]
    s13 = t["w13_weight_scale_2"].reshape(e, -1)
    return {
        "w13": w4a16_pack_weight(t["w13_weight"]),
        "w13_scale": w4a16_pack_blockscale(t["w13_weight_scale"], x13),
        "w13_global_scale": w4a16_global_scale(s13[:, 0], x13),
        "w2": w4a16_pack_weight(t["w2_weight"]),
        "w2_scale": w4a16_pack_blockscale(t["w2_weight_scale"], x2),
        "w2_global_scale": w4a16_global_scale(t["w2_weight_scale_2"], x2),
    }


def router_inputs(tokens, h, e, seed):
    """BF16 activations [tokens, h] and float32 router logits [tokens, e]
    from one generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen).bfloat16()
    return x, torch.randn(tokens, e, generator=gen)


def packed_bytes(layer) -> dict[str, torch.Tensor]:
    pw = layer.quant_method.experts.prepared
    return {f: bytes_of(getattr(pw, f).contiguous()).clone() for f in PACKED_FIELDS}


# (E, H, I, gated): I = 96 (a [w3; w1] rotation of 96 rows: the half swap);
# relu2 with I = 64 (one tile of rows).
LAYERS = [(4, 256, 128, True), (3, 192, 96, True), (3, 128, 64, False)]
LAYER_IDS = ["E4_H256_I128_silu", "E3_H192_I96_silu", "E3_H128_I64_relu2"]
