# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared pieces of the NVFP4 MoE checkpoint tests: the small Qwen3.6-like
config, checkpoints written with the package's writer, the layer they load
into, the writer CLI's arguments for a small model."""

import functools
import json
from pathlib import Path

import torch

from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
from vllm.model_executor.model_loader.nvfp4_checkpoint_writer import (
    random_bf16_experts,
    write_nvfp4_moe_checkpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import MODELOPT

__all__ = [
    "BACKEND",
    "E",
    "EXPERTS",
    "H",
    "I",
    "TOPK",
    "W4A4",
    "W4A16",
    "make_layer",
    "params_bytes",
    "quant_json",
    "qwen_config",
    "write_ckpt",
    "write_layers",
    "writer_cli_args",
]

E, H, I, TOPK = 8, 256, 128, 2  # noqa: E741 (the facts file's names)
BACKEND = "flashinfer_b12x_emulated"
W4A4, W4A16 = "w4a4", "w4a16"
#: The routed experts of decoder layer ``{}`` (Qwen3.6's names).
EXPERTS = "model.layers.{}.mlp.experts"


def qwen_config(e=E, h=H, i=I, layers=2):
    return {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_experts": e,
        "num_experts_per_tok": TOPK,
        "moe_intermediate_size": i,
    }


def write_ckpt(path, fmt=MODELOPT, gated=True, e=E, h=H, i=I, **kwargs):
    """Layers 0 and 1 of random BF16 experts (seeds 0 and 1), written as an
    NVFP4 checkpoint; returns the BF16 experts per layer."""
    layers = {idx: random_bf16_experts(e, h, i, gated, seed=idx) for idx in (0, 1)}
    write_nvfp4_moe_checkpoint(
        path, layers, qwen_config(e, h, i), fmt=fmt, gated=gated, **kwargs
    )
    return layers


@functools.cache
def _bf16_layer(idx: int):
    return random_bf16_experts(E, H, I, True, seed=idx)


def write_layers(path, fmt=MODELOPT, layers=(0, 1, 2), **kwargs):
    """Layers ``layers`` of a three-layer model (random gated BF16 experts,
    seed = the layer's index) written as an NVFP4 checkpoint; returns
    ``path``."""
    chosen = {idx: _bf16_layer(idx) for idx in layers}
    write_nvfp4_moe_checkpoint(path, chosen, qwen_config(layers=3), fmt=fmt, **kwargs)
    return path


def make_layer(gated=True, place=None, e=E, *, quant_config=None, mode=W4A4, **kw):
    """A FusedMoE of the checkpoints' shape on the emulated b12x backend:
    ``quant_config``, or ModelOpt's config for ``mode``; ``place`` is
    ``place_w3w1_at_load``. ``h``, ``i``, ``top_k`` and ``device`` (default
    the checkpoints' H, I, TOPK and "cpu") give its hidden and intermediate
    sizes, its experts per token and its device; other keywords go to
    FusedMoE."""
    h, i = kw.pop("h", H), kw.pop("i", I)
    return FusedMoE(
        num_experts=e,
        top_k=kw.pop("top_k", TOPK),
        hidden_size=h,
        intermediate_size=i,
        activation="silu" if gated else "relu2",
        quant_config=quant_config or ModelOptNvFp4Config.for_mode(mode),
        moe_backend=BACKEND,
        device=kw.pop("device", "cpu"),
        place_w3w1_at_load=place,
        **kw,
    )


def params_bytes(layer) -> dict[str, torch.Tensor]:
    return {
        n: bytes_of(p.detach().contiguous()).clone()
        for n, p in layer.named_parameters()
    }


def quant_json(path: Path) -> dict:
    """The quantization section a checkpoint declares (hf_quant_config.json,
    else config.json's quantization_config)."""
    hf = path / "hf_quant_config.json"
    if hf.exists():
        return json.loads(hf.read_text())["quantization"]
    return json.loads((path / "config.json").read_text())["quantization_config"]


def writer_cli_args(
    out, *extra, layers=1, experts=4, hidden=128, intermediate=64
) -> list[str]:
    """The writer CLI's arguments for a small model (top 2) into ``out``,
    ``extra`` first."""
    return [
        str(out),
        *extra,
        "--num-layers",
        str(layers),
        "--num-experts",
        str(experts),
        "--top-k",
        "2",
        "--hidden-size",
        str(hidden),
        "--intermediate-size",
        str(intermediate),
    ]
