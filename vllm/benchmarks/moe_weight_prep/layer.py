# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The layer a run prepares: a FusedMoE of a preset's shapes and one rank's
shard, in either quant mode, holding a copy of the layer's tensors."""

from __future__ import annotations

import torch

from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.shard import RankShard

__all__ = ["make_layer"]


def make_layer(
    preset: MoEModelPreset,
    shard: RankShard,
    device: torch.device,
    tensors: dict[str, torch.Tensor],
    cap: int,
    global_scale_mode: str = "alpha",
    quant_mode: str = "w4a4",
) -> torch.nn.Module:
    """A FusedMoE layer of ``shard`` of ``preset`` (emulated b12x: the kernel
    backend's own preparation, on any device) in ``quant_mode`` ("w4a4" or
    "w4a16"), holding a copy of ``tensors`` (checkpoint layout, [w1; w3]:
    the layer does not reorder at load); its preparation capped at ``cap``
    bytes, W4A4's global scales handled as ``global_scale_mode`` ("alpha" or
    "fold"). Tensors the layer has no parameter for (W4A16: the activation
    scales) are left out."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    experts_kwargs: dict = {"max_transient_bytes": cap}
    if quant_mode == "w4a4":
        experts_kwargs["global_scale_mode"] = global_scale_mode
    layer = FusedMoE(
        num_experts=preset.num_experts,
        top_k=preset.top_k,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        activation=preset.activation,
        quant_config=ModelOptNvFp4Config.for_mode(quant_mode),
        moe_backend="flashinfer_b12x_emulated",
        device=device,
        **shard.layer_kwargs(),
        place_w3w1_at_load=False,
        experts_kwargs=experts_kwargs,
    )
    with torch.no_grad():
        for name, value in tensors.items():
            param = getattr(layer, name, None)
            if param is not None:
                param.copy_(value)
    return layer
