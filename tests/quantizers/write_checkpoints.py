# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write NVFP4 MoE checkpoints with the real quantizers, and each tool's own
reference beside each, for tests/quantizers/test_quantizer_checkpoints.py.

Run in .venv-quantizers (requirements/quantizers-cpu.txt), on CPU, seeded:

    python tests/quantizers/write_checkpoints.py OUT_DIR

    tiny Qwen3-MoE, BF16, seeded (hidden 256, moe intermediate 256, 8 experts,
    top-2, 2 layers; expert weight std 0.005..0.05 across each layer's
    experts, the experts' inputs std about 2)
        |  calibration text -> each MoE layer's expert inputs and routes
        +-- llm-compressor 0.14.0.1: oneshot, save_pretrained(save_compressed)
        |       NVFP4 (W4A4), NVFP4A16
        +-- ModelOpt 0.47.0: mtq.quantize, export_hf_checkpoint
                NVFP4 (W4A4), W4A16_NVFP4, MIXED_PRECISION (W4A16_NVFP4
                experts beside FP8 o_proj)
        v
    OUT_DIR/<name>/                       the checkpoint as the tool wrote it
    OUT_DIR/<name>.reference.safetensors  per MoE layer i:
        layers.i.w13 f32 [E, 2I, H]    the tool's dequantization of [gate; up]
        layers.i.w2  f32 [E, H, I]     and of down
        layers.i.a13_scale f32 [E, 2]  W4A4: the tool's calibrated input
        layers.i.a2_scale  f32 [E]     scales of gate, up; of down
                                       (dequantization direction, amax / 2688)
        layers.i.x bf16 [T, H]         the experts' inputs and routes (the
        layers.i.topk_ids i64 [T, K]   BF16 model's router) on calibration
        layers.i.topk_weights f32      tokens
        layers.i.out f32 [T, H]        the tool's function of the experts on x

Only the experts are NVFP4: vLLM builds no NVFP4 linear layer on CPU. FP8
goes on o_proj alone: vLLM's FP8 linear requantizes a fused qkv_proj whose
shards' scales differ with ``_C.static_scaled_fp8_quant``, which a CPU build
lacks. The tools are imported inside the functions: the test imports this
module's names in vLLM's venv.
"""

import copy
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

import torch

__all__ = ["CHECKPOINTS", "NUM_LAYERS", "W4A4", "W4A16", "reference_path"]

HIDDEN, INTER, NUM_EXPERTS, TOP_K, NUM_LAYERS = 256, 256, 8, 2, 2
W4A4, W4A16 = "w4a4", "w4a16"
#: name -> (tool, scheme, what the experts are)
CHECKPOINTS = {
    "llmcompressor-NVFP4": ("llmcompressor", "NVFP4", W4A4),
    "llmcompressor-NVFP4A16": ("llmcompressor", "NVFP4A16", W4A16),
    "modelopt-NVFP4": ("modelopt", "NVFP4", W4A4),
    "modelopt-W4A16_NVFP4": ("modelopt", "W4A16_NVFP4", W4A16),
    "modelopt-MIXED_PRECISION": ("modelopt", "MIXED_PRECISION", W4A16),
}
_EXPERT_STD = (0.005, 0.05)
_NORM_GAIN = 2.0  # post_attention_layernorm's weight: the experts' input std
_WORDS = [f"w{i}" for i in range(60)]
_CALIBRATION = (16, 32)  # texts x words, one token each
_TOKENS = 64  # calibration tokens kept as the reference's inputs
_BLOCK = 16


def reference_path(out_dir: Path, name: str) -> Path:
    """Where checkpoint ``name``'s reference lies (beside it: a
    ``.safetensors`` inside it would be loaded as weights)."""
    return Path(out_dir) / f"{name}.reference.safetensors"


# ---- the tiny model, its tokenizer and calibration data ----


def _write_bf16_model(path: Path) -> None:
    """The seeded BF16 model and a word-level tokenizer (llm-compressor's
    calibration tokenizes text) saved as a Hugging Face model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config = Qwen3MoeConfig(
        vocab_size=len(_WORDS) + 2,
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
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=1,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    std = torch.logspace(*torch.tensor(_EXPERT_STD).log10(), NUM_EXPERTS)
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.copy_(torch.randn(p.shape) * std.view(-1, 1, 1))
            layer.post_attention_layernorm.weight.fill_(_NORM_GAIN)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<pad>": 1, **{w: i + 2 for i, w in enumerate(_WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(path)


def _load(path: Path):
    """(model, tokenizer) from ``path``: a new model each call (the tools
    change the one they get)."""
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def _calibration_texts() -> list[str]:
    gen = torch.Generator().manual_seed(1)
    picks = torch.randint(len(_WORDS), _CALIBRATION, generator=gen)
    return [" ".join(_WORDS[i] for i in row) for row in picks.tolist()]


@torch.no_grad()
def _expert_inputs(model, tokenizer) -> dict[str, torch.Tensor]:
    """Each MoE layer's experts' inputs and routes on the first
    :data:`_TOKENS` calibration tokens, as the BF16 model makes them."""
    found = {}

    def hook(i):
        def record(module, args):
            x, ids, weights = args  # [T, H], [T, K], [T, K]
            found[f"layers.{i}.x"] = x[:_TOKENS].clone()
            found[f"layers.{i}.topk_ids"] = ids[:_TOKENS].long()
            found[f"layers.{i}.topk_weights"] = weights[:_TOKENS].float()

        return record

    experts = [layer.mlp.experts for layer in model.model.layers]
    handles = [m.register_forward_pre_hook(hook(i)) for i, m in enumerate(experts)]
    texts = _calibration_texts()[: -(-_TOKENS // _CALIBRATION[1])]
    model(**tokenizer(texts, return_tensors="pt"))
    for h in handles:
        h.remove()
    return found


# ---- the tools ----


def _llmcompressor(model_dir: Path, scheme: str, out: Path, inputs: dict) -> dict:
    """``oneshot`` with llm-compressor's preset ``scheme`` on the experts (it
    linearizes them: one Linear per expert and projection, every expert
    calibrated on every token), saved compressed. The reference from the
    quantized model: each Linear's weight through its own fake quantization
    (``forward_quantize``, float32), its ``input_global_scale`` inverted, and
    the linearized experts' own forward (BF16 throughout, activations
    fake-quantized at the calibrated scales)."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model, tokenizer = _load(model_dir)
    oneshot(
        model=model,
        dataset=Dataset.from_dict({"text": _calibration_texts()}),
        tokenizer=tokenizer,
        recipe=QuantizationModifier(
            targets="Linear",
            scheme=scheme,
            ignore=["lm_head", r"re:.*self_attn.*", r"re:.*mlp\.gate$"],
        ),
        max_seq_length=_CALIBRATION[1],
        num_calibration_samples=_CALIBRATION[0],
    )

    def dequantized(linear) -> torch.Tensor:
        weight = linear.weight.detach().float()
        scheme = linear.quantization_scheme.weights
        return forward_quantize(linear, weight, "weight", scheme)

    ref = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            mlps = [layer.mlp.experts[e] for e in range(NUM_EXPERTS)]
            ref[f"layers.{i}.w13"] = torch.stack(
                [
                    torch.cat([dequantized(m.gate_proj), dequantized(m.up_proj)])
                    for m in mlps
                ]
            )
            ref[f"layers.{i}.w2"] = torch.stack(
                [dequantized(m.down_proj) for m in mlps]
            )
            if scheme == "NVFP4":
                ref[f"layers.{i}.a13_scale"] = torch.stack(
                    [
                        1
                        / torch.cat(
                            [
                                m.gate_proj.input_global_scale,
                                m.up_proj.input_global_scale,
                            ]
                        )
                        for m in mlps
                    ]
                ).float()
                ref[f"layers.{i}.a2_scale"] = (
                    1
                    / torch.cat([m.down_proj.input_global_scale for m in mlps]).float()
                )
            x, ids = inputs[f"layers.{i}.x"], inputs[f"layers.{i}.topk_ids"]
            weights = inputs[f"layers.{i}.topk_weights"].to(x.dtype)
            ref[f"layers.{i}.out"] = layer.mlp.experts(x, ids, weights).float()
    model.save_pretrained(out, save_compressed=True)
    return ref


def _modelopt_config(scheme: str) -> dict:
    """ModelOpt's preset for the experts; attention left BF16 but, for
    MIXED_PRECISION, o_proj in ModelOpt's FP8 (NVIDIA's own NVFP4 releases
    put attention in FP8). Appended, so they override the preset's
    wildcards."""
    import modelopt.torch.quantization as mtq

    preset = mtq.NVFP4_DEFAULT_CFG if scheme == "NVFP4" else mtq.W4A16_NVFP4_CFG
    cfg = copy.deepcopy(preset)
    attention = [{"quantizer_name": "*self_attn*", "enable": False}]
    if scheme == "MIXED_PRECISION":
        fp8 = {
            e["quantizer_name"]: e["cfg"]
            for e in mtq.FP8_DEFAULT_CFG["quant_cfg"]
            if "cfg" in e
        }
        attention += [
            {"quantizer_name": f"*self_attn.o_proj.{q}", "cfg": fp8[f"*{q}"]}
            for q in ("weight_quantizer", "input_quantizer")
        ]
    cfg["quant_cfg"] = [*cfg["quant_cfg"], *attention]
    return cfg


def _modelopt(model_dir: Path, scheme: str, out: Path, inputs: dict) -> dict:
    """``mtq.quantize`` (max calibration) and ``export_hf_checkpoint``.
    ModelOpt gives the fused experts one weight quantizer per expert (gate
    and up share its global scale) and one input quantizer per projection
    for all experts. Its quantized forward refuses on CPU ("amax must be a
    CUDA tensor"), so the reference is built from ModelOpt's own NVFP4
    quantize/dequantize (``NVFP4QTensor``) as its export and its fake
    quantization compute: weights at each expert's calibrated global scale,
    activations (W4A4) at the calibrated input scales in front of each GEMM,
    GEMMs in float32, the SiLU product rounded to BF16 (the model's dtype)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    def fake_quant(x: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
        q, block_scale, scale_2 = NVFP4QTensor.quantize(
            x.float(), _BLOCK, weights_scaling_factor_2=scale_2.float()
        )
        return q.dequantize(
            dtype=torch.float32,
            scale=block_scale,
            double_scale=scale_2,
            block_sizes={-1: _BLOCK},
        )

    model, tokenizer = _load(model_dir)
    ids = tokenizer(_calibration_texts(), return_tensors="pt").input_ids

    def forward_loop(m):
        for batch in ids.split(4):
            m(input_ids=batch)

    model = mtq.quantize(model, _modelopt_config(scheme), forward_loop)
    global_scale = NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer
    ref = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            w13, w2 = (
                torch.stack(
                    [
                        fake_quant(getattr(experts, name)[e], global_scale(q))
                        for e, q in enumerate(
                            getattr(experts, f"{name}_weight_quantizers")
                        )
                    ]
                )
                for name in ("gate_up_proj", "down_proj")
            )
            ref[f"layers.{i}.w13"], ref[f"layers.{i}.w2"] = w13, w2
            input_scale = NVFP4QTensor.get_activation_scaling_factor
            a13 = input_scale(experts.gate_up_proj_input_quantizer)
            a2 = input_scale(experts.down_proj_input_quantizer)
            if a13 is not None:
                ref[f"layers.{i}.a13_scale"] = a13.float().expand(NUM_EXPERTS, 2)
                ref[f"layers.{i}.a2_scale"] = a2.float().expand(NUM_EXPERTS)
            x, ids = inputs[f"layers.{i}.x"], inputs[f"layers.{i}.topk_ids"]
            weights = inputs[f"layers.{i}.topk_weights"]
            y = torch.zeros(x.shape, dtype=torch.float32)
            for e in ids.unique().tolist():
                rows, slots = (ids == e).nonzero(as_tuple=True)
                h = x[rows].float() if a13 is None else fake_quant(x[rows], a13)
                gate, up = (h @ w13[e].T).chunk(2, dim=-1)
                h = (torch.nn.functional.silu(gate) * up).bfloat16().float()
                h = h if a2 is None else fake_quant(h, a2)
                y.index_add_(0, rows, (h @ w2[e].T) * weights[rows, slots, None])
            ref[f"layers.{i}.out"] = y
    export_hf_checkpoint(model, export_dir=out)
    return ref


def main(out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = out_dir / "bf16-model"
    _write_bf16_model(bf16)
    inputs = _expert_inputs(*_load(bf16))
    for name, (tool, scheme, _) in CHECKPOINTS.items():
        start = time.perf_counter()
        quantize = _llmcompressor if tool == "llmcompressor" else _modelopt
        ref = quantize(bf16, scheme, out_dir / name, inputs)
        tensors = {k: v.contiguous() for k, v in {**ref, **inputs}.items()}
        save_file(tensors, reference_path(out_dir, name))
        print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)
    dists = ("llmcompressor", "compressed-tensors", "nvidia-modelopt")
    versions = {d: importlib.metadata.version(d) for d in (*dists, "transformers")}
    (out_dir / "versions.json").write_text(json.dumps(versions, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
    main(Path(sys.argv[1]))
