# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real NVFP4 MoE checkpoint as the layer source of ``vllm bench moe-weight-prep``."""

from __future__ import annotations

import torch

from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.shard import RankShard

__all__ = [
    "checkpoint_quant_modes",
    "checkpoint_source",
]


def checkpoint_quant_modes(path: str) -> dict[int, str]:
    """MoE layer index -> ``"w4a4"`` or ``"w4a16"``, as the checkpoint at
    ``path`` declares them."""
    from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
        NVFP4MoECheckpoint,
    )

    ckpt = NVFP4MoECheckpoint(path)
    return {i: ckpt.quant_mode(i) for i in ckpt.moe_layers}


def checkpoint_source(
    path: str, shard: RankShard, device: torch.device, quant_mode: str = "w4a4"
):
    """A preset describing the checkpoint's MoE geometry, and a function that
    loads ``shard`` of its i-th MoE layer of mode ``quant_mode`` (``"w4a4"`` or
    ``"w4a16"``: a mixed checkpoint's layers of the other mode are left out),
    into a layer built with the config the checkpoint declares for it; its
    parameters by name, checkpoint layout. ValueError when the checkpoint
    has no MoE layer of that mode."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
        NVFP4MoECheckpoint,
    )

    ckpt = NVFP4MoECheckpoint(path)
    layers = [i for i in ckpt.moe_layers if ckpt.quant_mode(i) == quant_mode]
    if not layers:
        found = sorted({ckpt.quant_mode(i) for i in ckpt.moe_layers})
        raise ValueError(
            f"{ckpt.model_dir}: no {quant_mode} MoE layers (its MoE layers are "
            f"{' and '.join(found)}): pass --quant-mode {found[0]}"
        )
    preset = MoEModelPreset(
        name=ckpt.model_dir.name,
        hf_id=f"{ckpt.model_dir} ({ckpt.format})",
        num_moe_layers=len(layers),
        hidden_size=ckpt.hidden_size,
        num_experts=ckpt.num_experts,
        top_k=ckpt.top_k,
        intermediate_size=ckpt.intermediate_size,
        activation=ckpt.activation,
    )
    shard.check(preset)  # validates --tp
    # The layers carry the checkpoint's routing where FusedMoE can compute it
    # (the preparation does not depend on it: a router it cannot compute,
    # DeepSeek-V3's say, leaves the default).
    try:
        routing = {"renormalize": ckpt.routing.renormalize}
    except ValueError:
        routing = {}

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        layer = FusedMoE(
            num_experts=preset.num_experts,
            top_k=preset.top_k,
            hidden_size=preset.hidden_size,
            intermediate_size=preset.intermediate_size,
            activation=preset.activation,
            quant_config=ckpt.quant_config(layers[i]),
            moe_backend="flashinfer_b12x_emulated",
            device=device,
            **shard.layer_kwargs(),
            **routing,
            place_w3w1_at_load=False,
        )
        # No bar per tensor: the job's bar counts layers already.
        ckpt.load_layer(layer, layers[i])
        return {n: p.data for n, p in layer.named_parameters()}

    return preset, layer_tensors
