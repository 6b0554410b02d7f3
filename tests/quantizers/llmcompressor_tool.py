# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny MoE model quantized by llm-compressor 0.14.0.1 (compressed-tensors
0.19.0) on CPU, its in-memory function recorded, its checkpoint written.

What runs on CPU, and what it needs there:

* ``oneshot`` calibrates on CPU ("No accelerator available! Compressing
  model on CPU instead") but needs a tokenizer for its calibration data, and
  a model loaded from a directory (it re-reads ``config.json`` from
  ``name_or_path``): :func:`~tests.quantizers.tiny_moe.write_tiny_moe`
  saves one with a word-level tokenizer. It linearizes the fused
  transformers 5 experts itself (``linearize_moe``: one ``Linear`` per
  expert and projection, ``experts.<e>.gate_proj``...), with every expert
  calibrated on every token (``moe_calibrate_all_experts``).
* The quantized model's forward runs on CPU: each ``Linear``'s wrapped
  forward (``set_forward_quantized``) fake-quantizes its input with the
  scheme's NVFP4 input quantizer (local block scales, the calibrated
  ``input_global_scale``) and its weight with the calibrated weight scales,
  in BF16. The experts' forward (``LinearExperts2D.forward``) takes the
  routes directly: that is the tool's function recorded here.
* ``save_pretrained(save_compressed=True)`` writes ``nvfp4-pack-quantized``
  (``weight_packed``, ``weight_scale``, ``weight_global_scale`` and, for
  W4A4, ``input_global_scale``, the global scales in the quantization
  direction), the experts under their linearized names.

Imports llm-compressor and compressed-tensors at the top: import this
module only where they are installed (``quantizer_env.tool_problem``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier

from tests.quantizers.quantizer_env import LLMCOMPRESSOR
from tests.quantizers.tiny_moe import (
    CALIBRATION_SAMPLES,
    CALIBRATION_TOKENS,
    INPUT_STDS,
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

__all__ = ["SCHEMES", "quantize_with_llmcompressor"]

#: llm-compressor preset scheme -> the experts' mode.
SCHEMES = {"NVFP4": "w4a4", "NVFP4A16": "w4a16"}
# Left in BF16, as llm-compressor's MoE examples do: the routers (and
# Qwen3.5's shared-expert gate, a 1-row Linear), the head, the vision tower.
_IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", "re:.*visual.*"]


def _expert_linears(experts) -> Iterator[torch.nn.Linear]:
    for e in range(experts.num_experts):
        yield from (experts[e].gate_proj, experts[e].up_proj, experts[e].down_proj)


def _as_quantized(experts):
    return contextlib.nullcontext()


@contextlib.contextmanager
def _bf16_activations(experts):
    """The experts' forward without the input quantizer (each Linear's
    scheme with ``input_activations`` None, as NVFP4A16's): weights still
    fake-quantized as calibrated."""
    saved = [(m, m.quantization_scheme) for m in _expert_linears(experts)]
    try:
        for m, scheme in saved:
            m.quantization_scheme = scheme.model_copy(
                update={"input_activations": None}
            )
        yield
    finally:
        for m, scheme in saved:
            m.quantization_scheme = scheme


@contextlib.contextmanager
def _global_scale_one(experts):
    """The experts' forward with every ``input_global_scale`` 1."""
    saved = [
        (m, m.input_global_scale.detach().clone()) for m in _expert_linears(experts)
    ]
    try:
        with torch.no_grad():
            for m, _ in saved:
                m.input_global_scale.fill_(1.0)
        yield
    finally:
        with torch.no_grad():
            for m, value in saved:
                m.input_global_scale.copy_(value)


@contextlib.contextmanager
def _gate_up_swapped(experts):
    """Each expert's gate_proj and up_proj modules exchanged."""
    mlps = [experts[e] for e in range(experts.num_experts)]
    try:
        for mlp in mlps:
            mlp.gate_proj, mlp.up_proj = mlp.up_proj, mlp.gate_proj
        yield
    finally:
        for mlp in mlps:
            mlp.gate_proj, mlp.up_proj = mlp.up_proj, mlp.gate_proj


@contextlib.contextmanager
def _bf16_gate_up_swapped(experts):
    with _bf16_activations(experts), _gate_up_swapped(experts):
        yield


def _dequantized(linear: torch.nn.Linear) -> torch.Tensor:
    """The tool's own fake quantization of the weight (its calibrated block
    scales and global scale), in float32 rather than the BF16 its forward
    casts to."""
    scheme = linear.quantization_scheme
    weight = linear.weight.detach().float()
    return forward_quantize(linear, weight, "weight", scheme.weights).float()


@torch.no_grad()
def _layer_reference(experts, spec: TinyMoE, w4a4: bool) -> LayerReference:
    w13 = torch.stack(
        [
            torch.cat(
                [_dequantized(experts[e].gate_proj), _dequantized(experts[e].up_proj)]
            )
            for e in range(experts.num_experts)
        ]
    )
    w2 = torch.stack(
        [_dequantized(experts[e].down_proj) for e in range(experts.num_experts)]
    )
    ref = LayerReference(w13, w2)
    variants = {TOOL: _as_quantized, GATE_UP_SWAPPED: _gate_up_swapped}
    if w4a4:
        variants[BF16_ACTIVATIONS] = _bf16_activations
        variants[BF16_GATE_UP_SWAPPED] = _bf16_gate_up_swapped
        variants[GLOBAL_SCALE_ONE] = _global_scale_one
    # Every input std in one forward: the activation quantizer's blocks lie
    # within a token and its global scale is static, so batching the tokens
    # changes nothing but how often the weights are fake-quantized (most of
    # the forward's time on CPU).
    inputs = [expert_inputs(spec, std) for std in INPUT_STDS]
    x = torch.cat([i.x for i in inputs])
    ids = torch.cat([i.topk_ids for i in inputs])
    weights = torch.cat([i.topk_weights for i in inputs])
    ref.outputs = {std: {} for std in INPUT_STDS}
    for name, context in variants.items():
        with context(experts):
            out = experts(x, ids, weights)
        for std, part in zip(INPUT_STDS, out.split(len(x) // len(inputs)), strict=True):
            ref.outputs[std][name] = part
    for outs in ref.outputs.values():
        if not w4a4:
            outs[BF16_ACTIVATIONS] = outs[TOOL]
            outs[BF16_GATE_UP_SWAPPED] = outs[GATE_UP_SWAPPED]
    return ref


def quantize_with_llmcompressor(
    spec: TinyMoE, model_dir: Path, scheme: str, out_dir: Path, shard: bool
) -> QuantizedCase:
    """Quantize the model saved at ``model_dir`` with ``oneshot`` and the
    preset ``scheme`` (:data:`SCHEMES`), record its experts' references, and
    write the compressed checkpoint to ``out_dir`` (in 1 MB shards with
    ``model.safetensors.index.json`` when ``shard``)."""
    start = time.perf_counter()
    model, tokenizer = load_tiny_moe(spec, model_dir)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=_IGNORE)
    oneshot(
        model=model,
        dataset=Dataset.from_dict({"text": calibration_texts()}),
        tokenizer=tokenizer,
        recipe=recipe,
        max_seq_length=CALIBRATION_TOKENS,
        num_calibration_samples=CALIBRATION_SAMPLES,
    )
    layers = {
        layer: _layer_reference(
            model.get_submodule(spec.experts_module(layer)),
            spec,
            SCHEMES[scheme] == "w4a4",
        )
        for layer in range(spec.num_layers)
    }
    kwargs = {"max_shard_size": "1MB"} if shard else {}
    model.save_pretrained(out_dir, save_compressed=True, **kwargs)
    seconds = time.perf_counter() - start
    return QuantizedCase(
        LLMCOMPRESSOR, spec, scheme, SCHEMES[scheme], out_dir, shard, layers, seconds
    )
