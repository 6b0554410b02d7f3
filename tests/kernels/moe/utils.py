# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for the MoE tests: this tree's ``FusedMoE`` NVFP4 layer, the
checkpoints' decode and the fold reference; re-exported, the BF16 experts,
their NVFP4 ModelOpt tensors and the error measure.

Two ways to a prepared layer: this tree's ``FusedMoE`` (``make_nvfp4_layer``,
with its weight loader, reloads and state dicts), or vLLM's modular-kernel
interface alone (flashinfer_b12x_utils.py): the experts built and called as
vLLM's oracle builds and calls them, which runs the same in vLLM 0.33.0 with
this branch. The b12x test's helpers live in flashinfer_b12x_utils.py and
moe_reference.py, new files in upstream's test tree (whose
``tests/kernels/moe/utils.py`` is its own, with other names)."""

from __future__ import annotations

import torch

from tests.kernels.moe.flashinfer_b12x_utils import (
    bf16_experts,
    dequantized_experts,
    quantize_experts_modelopt,
)
from tests.kernels.moe.moe_reference import rel_rms_error
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    dequantize_nvfp4,
    global_scale_from_modelopt,
)

__all__ = [
    "bf16_experts",
    "dequantized_checkpoint_layer",
    "dequantized_experts",
    "fold_reference",
    "load_nvfp4_experts",
    "make_nvfp4_layer",
    "quantize_experts_modelopt",
    "rel_rms_error",
]


def fold_reference(scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Test-side whole-tensor fold of linear [E, R, C] FP8 scales:
    fp8(clamp(float(scale) * scale_2 of its row group)), scale_2 [E] or [E, G]."""
    e, r, c = scale.shape
    groups = scale_2.reshape(e, -1).shape[1]
    f = scale.float().view(e, groups, r // groups, c) * scale_2.view(e, groups, 1, 1)
    return f.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(e, r, c)


def dequantized_checkpoint_layer(ckpt, layer_idx: int, gated: bool):
    """Float32 [w13 ([gate; up]) [E, 2I or I, H], w2 [E, H, I]] decoded from an
    ``NVFP4MoECheckpoint``'s own tensors (its exact function)."""
    parts = {}
    for _, e, proj, suffix, t in ckpt.iter_layer_tensors(layer_idx):
        parts[(e, proj, suffix)] = t
    projs = ("gate_proj", "up_proj") if gated else ("up_proj",)

    def deq(e, proj):
        return dequantize_nvfp4(
            parts[(e, proj, "weight")], parts[(e, proj, "weight_scale")],
            global_scale_from_modelopt(parts[(e, proj, "weight_scale_2")]),
        )  # fmt: skip

    experts = range(ckpt.num_experts)
    w13 = torch.stack([torch.cat([deq(e, p) for p in projs]) for e in experts])
    w2 = torch.stack([deq(e, "down_proj") for e in experts])
    return w13, w2


def make_nvfp4_layer(
    e,
    topk,
    k,
    n,
    gated,
    backend,
    device="cpu",
    max_num_tokens=256,
    quant_mode="w4a4",
    **experts_kwargs,
):
    """This tree's FusedMoE NVFP4 layer in checkpoint layout ([w1; w3], no
    load-time placement), for :func:`load_nvfp4_experts` to copy tensors
    into. (Imported here: vLLM 0.33.0, where the rest of this module runs
    too, has no ``FusedMoE`` class.)"""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    return FusedMoE(
        num_experts=e,
        top_k=topk,
        hidden_size=k,
        intermediate_size=n,
        activation="silu" if gated else "relu2",
        quant_config=ModelOptNvFp4Config.for_mode(quant_mode),
        moe_backend=backend,
        params_dtype=torch.bfloat16,
        device=device,
        place_w3w1_at_load=False,  # load_nvfp4_experts copies checkpoint layout
        experts_kwargs=experts_kwargs,
        max_num_tokens=max_num_tokens,
    )


def load_nvfp4_experts(layer: torch.nn.Module, tensors: dict) -> None:
    """Copy ModelOpt tensors into the layer's parameters (checkpoint layout)."""
    with torch.no_grad():
        for name, value in tensors.items():
            param = getattr(layer, name)
            param.copy_(value.reshape(param.shape).to(param.device))
