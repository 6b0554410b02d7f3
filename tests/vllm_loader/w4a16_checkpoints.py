# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Synthetic W4A16 (weight-only) NVFP4 MoE checkpoints: ``nvfp4_checkpoint.py``'s
tensors with the quantization config the W4A16 exports write.

  "modelopt-mixed"      ``hf_quant_config.json`` ``quant_algo:
                        MIXED_PRECISION``, each layer's experts
                        ``W4A16_NVFP4`` in ``quantized_layers`` (NVIDIA's
                        Qwen3.6-35B-A3B-NVFP4 release)
  "modelopt"            ``quant_algo: W4A16_NVFP4`` alone
  "compressed-tensors"  ``input_activations: null`` in every config group
                        (llm-compressor's NVFP4A16)

The activation scales ``nvfp4_checkpoint`` writes stay in the files, as some
ModelOpt W4A16 exports carry one: a W4A16 method ignores them.
"""

import json
from pathlib import Path

from nvfp4_checkpoint import MoEPreset, write_checkpoint

__all__ = ["SCHEMES", "write_w4a16_checkpoint"]

SCHEMES = ("modelopt-mixed", "modelopt", "compressed-tensors")


def write_w4a16_checkpoint(
    out: str | Path,
    preset: MoEPreset,
    num_layers: int,
    scheme: str,
    seed: int = 0,
) -> Path:
    """Write ``preset``'s shapes (``num_layers`` MoE layers) as a W4A16
    checkpoint of ``scheme`` in ``out``; returns ``out``."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    fmt = "compressed-tensors" if scheme == "compressed-tensors" else "modelopt"
    out = write_checkpoint(out, preset, num_layers, fmt, seed=seed)
    path = out / (
        "config.json" if fmt == "compressed-tensors" else "hf_quant_config.json"
    )
    config = json.loads(path.read_text())
    if scheme == "compressed-tensors":
        for group in config["quantization_config"]["config_groups"].values():
            group["input_activations"] = None
    elif scheme == "modelopt":
        config["quantization"]["quant_algo"] = "W4A16_NVFP4"
    else:
        experts = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
        config["quantization"]["quant_algo"] = "MIXED_PRECISION"
        config["quantization"]["quantized_layers"] = {
            f"model.layers.{i}.mlp.experts": experts for i in range(num_layers)
        }
    path.write_text(json.dumps(config, indent=1))
    return out
