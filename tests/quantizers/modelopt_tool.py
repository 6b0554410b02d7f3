# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny MoE model quantized by NVIDIA ModelOpt 0.47.0 on CPU, its function
recorded through ModelOpt's own NVFP4 quantize/dequantize, its checkpoint
exported with ``export_hf_checkpoint``.

What runs on CPU, and what does not:

* ``mtq.quantize`` (max calibration) runs on CPU. The fused transformers 5
  experts become ``_QuantFusedExperts``: one weight quantizer per expert
  (gate and up share it, hence one global scale), and ONE input quantizer
  per projection shared by all experts of the layer (one input scale).
* The quantized forward does not run on CPU: the NVFP4 fake quantization
  refuses ("amax must be a CUDA tensor for dynamic block quantization").
  ModelOpt's ``NVFP4QTensor.quantize`` / ``dequantize`` do run on CPU, so
  the tool's function recorded here is built from them: each expert's weight
  quantized and dequantized with its calibrated per-tensor scale (the
  export's arithmetic), and for W4A4 the activation quantized and
  dequantized in front of each GEMM at the calibrated input scale
  (``get_activation_scaling_factor``, the exported ``input_scale``), in the
  experts' own order: FC1 on [gate; up], ``silu(gate) * up`` rounded to
  BF16 (the model's dtype), FC2, the router-weighted sum in float32.
* ``export_hf_checkpoint`` runs on CPU (its dummy forward runs with the
  quantizers off) given ``config.architectures``: per expert ``weight``
  (uint8), ``weight_scale`` (E4M3), ``weight_scale_2`` and, for W4A4,
  ``input_scale`` (0-d float32, dequantization direction),
  ``hf_quant_config.json`` (``MIXED_PRECISION`` with ``quantized_layers``
  when modules differ, e.g. FP8 attention beside NVFP4 experts).
* ModelOpt warns that transformers 5.17 is newer than it was tested with;
  its ``hf`` extra (transformers < 5.15) is not installed, llm-compressor
  needs >= 5.15.

Imports ModelOpt at the top: import this module only where it is installed
(``quantizer_env.tool_problem``).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import modelopt.torch.quantization as mtq
import torch
import torch.nn.functional as F
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.qtensor import NVFP4QTensor

from tests.quantizers.quantizer_env import MODELOPT
from tests.quantizers.tiny_moe import (
    INPUT_STDS,
    ExpertInputs,
    TinyMoE,
    calibration_texts,
    expert_inputs,
    load_tiny_moe,
)
from tests.quantizers.tool_reference import (
    BF16_ACTIVATIONS,
    BF16_GATE_UP_SWAPPED,
    GATE_UP_SWAPPED,
    GLOBAL_SCALE_ONE,
    TOOL,
    LayerReference,
    QuantizedCase,
)

__all__ = ["SCHEMES", "quantize_with_modelopt"]

#: Scheme -> (the experts' mode, their hf_quant_config algorithm, whether
#: attention is FP8). The MIXED_PRECISION ones: NVFP4 experts (W4A16 as in
#: NVIDIA's Qwen3.6-35B-A3B release, or W4A4) beside FP8 attention.
SCHEMES = {
    "NVFP4": ("w4a4", "NVFP4", False),
    "W4A16_NVFP4": ("w4a16", "W4A16_NVFP4", False),
    "MIXED_PRECISION-W4A16": ("w4a16", "W4A16_NVFP4", True),
    "MIXED_PRECISION-NVFP4": ("w4a4", "NVFP4", True),
}
_BLOCK = 16
_CALIBRATION_BATCH = 4


def _config(scheme: str) -> dict:
    """The ``mtq.quantize`` config: ModelOpt's preset for the experts'
    algorithm, plus (MIXED_PRECISION) its FP8 preset's numerics for every
    attention projection's weight and input quantizers, appended so they
    take precedence over the preset's wildcards."""
    mode, _, fp8_attention = SCHEMES[scheme]
    preset = mtq.NVFP4_DEFAULT_CFG if mode == "w4a4" else mtq.W4A16_NVFP4_CFG
    cfg = copy.deepcopy(preset)
    if fp8_attention:
        fp8 = {
            e["quantizer_name"]: e["cfg"]
            for e in mtq.FP8_DEFAULT_CFG["quant_cfg"]
            if "cfg" in e
        }
        cfg["quant_cfg"] = [
            *cfg["quant_cfg"],
            *(
                {"quantizer_name": f"*self_attn.*{q}", "cfg": fp8[f"*{q}"]}
                for q in ("weight_quantizer", "input_quantizer")
            ),
        ]
    return cfg


def _fake_quant(x: torch.Tensor, scale_2: torch.Tensor | float) -> torch.Tensor:
    """ModelOpt's NVFP4 quantize + dequantize of ``x`` [..., K] with the
    per-tensor scale ``scale_2`` (dequantization direction), float32."""
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32)
    q, block_scale, scale_2 = NVFP4QTensor.quantize(
        x.float(), _BLOCK, weights_scaling_factor_2=scale_2
    )
    return q.dequantize(
        dtype=torch.float32,
        scale=block_scale,
        double_scale=scale_2,
        block_sizes={-1: _BLOCK},
    )


def _dequantized_weights(experts, name: str) -> torch.Tensor:
    """[E, N, K] float32: each expert's slice of the fused weight ``name``
    quantized and dequantized with its own calibrated weight quantizer."""
    weight = getattr(experts, name).detach()
    quantizers = getattr(experts, f"{name}_weight_quantizers")
    return torch.stack(
        [
            _fake_quant(
                weight[e],
                NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizers[e]),
            )
            for e in range(weight.shape[0])
        ]
    )


def _experts_function(
    inputs: ExpertInputs,
    w13: torch.Tensor,
    w2: torch.Tensor,
    a13: torch.Tensor | float | None,
    a2: torch.Tensor | float | None,
    swapped: bool = False,
) -> torch.Tensor:
    """The experts' function on ``inputs`` with dequantized weights ``w13``
    [E, 2I, H] ([gate; up]) and ``w2`` [E, H, I]; activations quantized at
    the input scales ``a13`` / ``a2`` (None: left BF16). BF16 [T, H]."""
    out = torch.zeros(inputs.x.shape, dtype=torch.float32)
    tokens = torch.arange(inputs.x.shape[0]).repeat_interleave(inputs.topk_ids.shape[1])
    ids, weights = inputs.topk_ids.reshape(-1), inputs.topk_weights.reshape(-1)
    for e in ids.unique().tolist():
        sel = ids == e
        x = inputs.x[tokens[sel]].float()  # [n, H]
        if a13 is not None:
            x = _fake_quant(x, a13)
        gate, up = (x @ w13[e].t()).chunk(2, dim=-1)  # [n, I] each
        if swapped:
            gate, up = up, gate
        act = (F.silu(gate) * up).bfloat16().float()
        if a2 is not None:
            act = _fake_quant(act, a2)
        out.index_add_(0, tokens[sel], (act @ w2[e].t()) * weights[sel].unsqueeze(1))
    return out.bfloat16()


def _input_scale(quantizer) -> torch.Tensor | None:
    """The calibrated input scale ModelOpt exports (``amax / (6 * 448)``), or
    None when the quantizer is off (weight-only)."""
    scale = NVFP4QTensor.get_activation_scaling_factor(quantizer)
    return None if scale is None else scale.float()


@torch.no_grad()
def _layer_reference(experts, spec: TinyMoE) -> LayerReference:
    w13 = _dequantized_weights(experts, "gate_up_proj")
    w2 = _dequantized_weights(experts, "down_proj")
    a13 = _input_scale(experts.gate_up_proj_input_quantizer)
    a2 = _input_scale(experts.down_proj_input_quantizer)
    ref = LayerReference(w13, w2)
    for std in INPUT_STDS:
        inputs = expert_inputs(spec, std)
        outs = {
            TOOL: _experts_function(inputs, w13, w2, a13, a2),
            GATE_UP_SWAPPED: _experts_function(inputs, w13, w2, a13, a2, swapped=True),
            BF16_ACTIVATIONS: _experts_function(inputs, w13, w2, None, None),
            BF16_GATE_UP_SWAPPED: _experts_function(
                inputs, w13, w2, None, None, swapped=True
            ),
        }
        if a13 is not None:
            # Global scale 1 (quantization direction) is scale_2 = 1.
            outs[GLOBAL_SCALE_ONE] = _experts_function(inputs, w13, w2, 1.0, 1.0)
        ref.outputs[std] = outs
    return ref


def quantize_with_modelopt(
    spec: TinyMoE, model_dir: Path, scheme: str, out_dir: Path, shard: bool
) -> QuantizedCase:
    """Quantize the model saved at ``model_dir`` with ``mtq.quantize`` and the
    config of ``scheme`` (:data:`SCHEMES`), calibrated on the tokenized
    calibration texts, record its experts' references, and export the
    checkpoint to ``out_dir`` (in 1 MB shards when ``shard``)."""
    start = time.perf_counter()
    model, tokenizer = load_tiny_moe(spec, model_dir)
    ids = tokenizer(calibration_texts(), return_tensors="pt").input_ids

    def forward_loop(m):
        for batch in ids.split(_CALIBRATION_BATCH):
            m(input_ids=batch)

    model = mtq.quantize(model, _config(scheme), forward_loop)
    layers = {
        layer: _layer_reference(model.get_submodule(spec.experts_module(layer)), spec)
        for layer in range(spec.num_layers)
    }
    kwargs = {"max_shard_size": "1MB"} if shard else {}
    export_hf_checkpoint(model, export_dir=out_dir, **kwargs)
    mode = SCHEMES[scheme][0]
    seconds = time.perf_counter() - start
    return QuantizedCase(MODELOPT, spec, scheme, mode, out_dir, shard, layers, seconds)
