# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny Qwen3-MoE of real magnitudes whose experts are quantized to NVFP4 as
ModelOpt quantizes them, written as a ModelOpt checkpoint for vLLM, and the
same model in transformers with the checkpoint's experts decoded: the
reference vLLM's logits are compared with.

    bf16 = bf16_model()                 transformers Qwen3MoeForCausalLM, seeded
        |  calibrate on CALIBRATION tokens: per expert, the amax of its routed
        |  inputs and of its SwiGLU output (down_proj's input)
        v
    q = quantize(bf16)                  per expert: E2M1 codes (low nibble
        |                               first), E4M3 block scales (16 wide),
        |                               weight_scale_2 = amax / (6 * 448),
        |                               input_scale = activation amax / (6 * 448)
        +--> write_modelopt_checkpoint(bf16, q, dir)     vLLM loads it
        +--> decoded_model(bf16, q)     float32, experts = E2M1 value * block
                                        scale * weight_scale_2 (the
                                        checkpoint's weights, one float32
                                        rounding each)

Only the experts are NVFP4: attention, router, embeddings, norms and LM head
stay BF16 and are excluded in ``hf_quant_config.json`` (vLLM has no NVFP4
linear kernel on CPU). ``moe_intermediate_size`` is 256: at 128 FlashInfer's
b12x pads each expert's weights with copies on its first run.
"""

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from upstream_b12x_test import b12x_test_module

from nvfp4_checkpoint import quant_config

__all__ = [
    "CALIBRATION",
    "HIDDEN",
    "INTER",
    "NUM_EXPERTS",
    "VOCAB",
    "QuantizedExperts",
    "bf16_model",
    "decoded_model",
    "quantize",
    "write_modelopt_checkpoint",
]

HIDDEN, INTER, NUM_EXPERTS, TOP_K, NUM_LAYERS, VOCAB = 256, 256, 8, 2, 2, 256
#: Calibration batch: sequences x tokens, random token ids (seeded).
CALIBRATION = (8, 32)
# Expert weight std, log-spaced across each layer's experts (real checkpoints:
# 0.005-0.05). Routers, attention and the LM head keep transformers' init
# (std 0.02). The embeddings (std 0.1) stand for the residual stream a deep
# model carries into its MoE layers: two layers add to it rather than make
# all of it, so a token's top-1 is decided by more than rounding.
_EXPERT_STD = (0.005, 0.05)
_EMBED_STD = 0.1
F4_E2M1_MAX, F8_E4M3_MAX = 6.0, torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class QuantizedExperts:
    """One layer's experts as ModelOpt writes them. w13 rows are [gate; up]:
    ``w13`` uint8 [E, 2I, H/2], ``w13_scale`` E4M3 [E, 2I, H/16] linear,
    ``w13_scale_2`` float32 [E] (gate's and up's, one per expert),
    ``w2`` uint8 [E, H, I/2], ``w2_scale`` E4M3 [E, H, I/16], ``w2_scale_2``
    float32 [E]; ``a13_scale`` / ``a2_scale`` float32 [E]: the input scales
    of gate/up and of down (dequantization direction)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    a13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    a2_scale: torch.Tensor


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * INTER,  # dense MLP: no layer has one
        moe_intermediate_size=INTER,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def bf16_model(seed: int = 0):
    """The BF16 model, seeded: each layer's experts at std log-spaced from
    0.005 to 0.05, the embeddings at std 0.1, everything else at
    transformers' initialisation."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(_config()).to(torch.bfloat16).eval()
    std = torch.logspace(*torch.tensor(_EXPERT_STD).log10(), NUM_EXPERTS)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, _EMBED_STD)
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(torch.randn(p.shape) * std.view(-1, 1, 1))
    return model


def _calibration_tokens() -> torch.Tensor:
    """int64 [sequences, tokens] token ids (seeded)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, CALIBRATION, generator=gen)


@torch.no_grad()
def _activation_amax(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, float32 [E] amaxes of each expert's routed inputs and of its
    SwiGLU output, over the calibration batch (an expert no token reached
    takes its layer's largest)."""
    amax = [
        (torch.zeros(NUM_EXPERTS), torch.zeros(NUM_EXPERTS)) for _ in model.model.layers
    ]

    def hook(layer):
        a13, a2 = amax[layer]
        experts = model.model.layers[layer].mlp.experts

        def record(module, args):
            x, ids = args[0], args[1]  # [T, H], [T, K]
            for e in range(NUM_EXPERTS):
                rows = x[(ids == e).any(-1)].float()
                if not len(rows):
                    continue
                gate, up = (rows @ experts.gate_up_proj[e].float().T).chunk(2, -1)
                h = torch.nn.functional.silu(gate) * up
                a13[e] = max(a13[e], rows.abs().amax())
                a2[e] = max(a2[e], h.abs().amax())

        return record

    handles = [
        layer.mlp.experts.register_forward_pre_hook(hook(i))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        model(_calibration_tokens())
    finally:
        for h in handles:
            h.remove()
    for a13, a2 in amax:
        for a in (a13, a2):
            a[a == 0] = a.max()
    return amax


def quantize(model) -> list[QuantizedExperts]:
    """Each layer's experts of the BF16 ``model`` quantized as ModelOpt does:
    upstream's ``_quantize_modelopt`` (vLLM's reference NVFP4 quantizer) on
    [gate; up] and on down, input scales from the calibration."""
    quantize_modelopt = b12x_test_module()._quantize_modelopt
    out = []
    for layer, (a13, a2) in zip(
        model.model.layers, _activation_amax(model), strict=True
    ):
        experts = layer.mlp.experts
        w13, w13_scale, w13_scale_2 = quantize_modelopt(experts.gate_up_proj.data)
        w2, w2_scale, w2_scale_2 = quantize_modelopt(experts.down_proj.data)
        scale = F4_E2M1_MAX * F8_E4M3_MAX
        out.append(
            QuantizedExperts(
                w13,
                w13_scale,
                w13_scale_2,
                a13 / scale,
                w2,
                w2_scale,
                w2_scale_2,
                a2 / scale,
            )
        )
    return out


def _expert_tensors(
    prefix: str, q: QuantizedExperts, swap_gate_up: bool
) -> dict[str, torch.Tensor]:
    """Per expert and projection: weight, weight_scale, weight_scale_2 and
    input_scale (0-d), as ModelOpt exports them."""
    gate, up = ("up_proj", "gate_proj") if swap_gate_up else ("gate_proj", "up_proj")
    w13_rows = {gate: slice(0, INTER), up: slice(INTER, 2 * INTER)}
    out = {}
    for e in range(NUM_EXPERTS):
        parts = {
            proj: (q.w13[e, rows], q.w13_scale[e, rows], q.w13_scale_2, q.a13_scale)
            for proj, rows in w13_rows.items()
        }
        parts["down_proj"] = (q.w2[e], q.w2_scale[e], q.w2_scale_2, q.a2_scale)
        for proj, (codes, scales, scale_2, input_scale) in parts.items():
            name = f"{prefix}.{e}.{proj}"
            out[f"{name}.weight"] = codes.contiguous()
            out[f"{name}.weight_scale"] = scales.contiguous()
            out[f"{name}.weight_scale_2"] = scale_2[e].clone()
            out[f"{name}.input_scale"] = input_scale[e].clone()
    return out


def write_modelopt_checkpoint(
    bf16, quantized: list[QuantizedExperts], out: Path, swap_gate_up: bool = False
) -> Path:
    """Write ``bf16``'s non-expert weights (BF16) and ``quantized`` experts as
    a ModelOpt NVFP4 checkpoint in ``out``; ``swap_gate_up`` writes each
    expert's gate tensors under up_proj's names and up's under gate_proj's
    (a negative control). Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: t.contiguous()
        for name, t in bf16.state_dict().items()
        if ".mlp.experts." not in name
    }
    for i, q in enumerate(quantized):
        prefix = f"model.layers.{i}.mlp.experts"
        tensors.update(_expert_tensors(prefix, q, swap_gate_up))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = bf16.config.to_dict()
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=1))
    quant = quant_config("modelopt")
    (out / "hf_quant_config.json").write_text(json.dumps(quant, indent=1))
    return out


def _w4a4_experts_forward(experts, q: QuantizedExperts):
    """``experts.forward`` as the checkpoint's W4A4 function: each expert's
    routed inputs and its SwiGLU output quantized to NVFP4 with its input
    scales (vLLM's reference ``ref_nvfp4_quant_dequant``), in the model's
    dtype."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant_dequant,
    )

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)  # [T, H]
        for e in range(NUM_EXPERTS):
            tok, slot = torch.where(top_k_index == e)
            x = ref_nvfp4_quant_dequant(hidden_states[tok], 1 / q.a13_scale[e], 16)
            gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, -1)
            h = torch.nn.functional.silu(gate) * up
            h = ref_nvfp4_quant_dequant(h, 1 / q.a2_scale[e], 16)
            y = h @ experts.down_proj[e].T * top_k_weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    return forward


@torch.no_grad()
def decoded_model(
    bf16,
    quantized: list[QuantizedExperts],
    dtype: torch.dtype = torch.float32,
    w4a4: bool = True,
):
    """``bf16`` in ``dtype`` with each expert's weights replaced by the
    checkpoint's, decoded (E2M1 value * block scale * weight_scale_2, one
    float32 rounding), and with ``w4a4`` its experts' inputs and SwiGLU
    outputs quantized to NVFP4 at the checkpoint's input scales, as a W4A4
    kernel quantizes them."""
    decode = b12x_test_module()._decode
    model = copy.deepcopy(bf16).to(dtype)
    for layer, q in zip(model.model.layers, quantized, strict=True):
        experts = layer.mlp.experts
        for e in range(NUM_EXPERTS):
            w13 = decode(q.w13[e], q.w13_scale[e]) * q.w13_scale_2[e]
            experts.gate_up_proj[e] = w13
            experts.down_proj[e] = decode(q.w2[e], q.w2_scale[e]) * q.w2_scale_2[e]
        if w4a4:
            experts.forward = _w4a4_experts_forward(experts, q)
    return model
