# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real NVFP4 MoE checkpoint as the layer source of ``vllm bench moe-weight-prep``."""

from __future__ import annotations

import torch

from vllm.benchmarks.moe_model_presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep_ranks import RankShard

__all__ = [
    "checkpoint_source",
]


def checkpoint_source(path: str, shard: RankShard, device: torch.device):
    """A preset describing the checkpoint's MoE geometry, and a function that
    loads ``shard`` of its i-th MoE layer."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
        NVFP4MoECheckpoint,
    )

    ckpt = NVFP4MoECheckpoint(path)
    preset = MoEModelPreset(
        name=ckpt.model_dir.name,
        hf_id=f"{ckpt.model_dir} ({ckpt.format})",
        num_moe_layers=len(ckpt.moe_layers),
        hidden_size=ckpt.hidden_size,
        num_experts=ckpt.num_experts,
        top_k=ckpt.top_k,
        intermediate_size=ckpt.intermediate_size,
        activation=ckpt.activation,
    )
    shard.check(preset)  # validates --tp

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        layer = FusedMoE(
            num_experts=preset.num_experts, top_k=preset.top_k,
            hidden_size=preset.hidden_size,
            intermediate_size=preset.intermediate_size,
            activation=preset.activation, quant_config=ModelOptNvFp4Config(),
            moe_backend="flashinfer_b12x_emulated", device=device,
            **shard.layer_kwargs(), place_w3w1_at_load=False,
        )  # fmt: skip
        # No bar per tensor: the job's bar counts layers already.
        ckpt.load_layer(layer, ckpt.moe_layers[i])
        return {n: p.data for n, p in layer.named_parameters()}

    return preset, layer_tensors
