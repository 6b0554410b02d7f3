# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny MoE language models built from their transformers configs (nothing
downloaded), the word-level tokenizer and calibration text the quantizers
need, and the inputs the comparisons feed one MoE layer's experts.

Weights are random at real magnitude: every expert's gate/up/down weights
have the std :attr:`TinyMoE.expert_std` gives for its layer (0.005-0.05 in
real checkpoints); the routers std 0.02. The norm in front of each MoE block
(``post_attention_layernorm``) has gain 2, so the calibration data reaches
the experts at std about 2 and every test input std from 0.03 to 2
(:data:`INPUT_STDS`) lies inside the calibrated activation range.

Imports transformers and tokenizers (inside the functions that need them),
never a quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CALIBRATION_SAMPLES",
    "CALIBRATION_TOKENS",
    "INPUT_STDS",
    "MODELS",
    "TOKENS",
    "ExpertInputs",
    "TinyMoE",
    "calibration_texts",
    "expert_inputs",
    "load_tiny_moe",
    "write_tiny_moe",
]

#: Input std of the expert comparisons, from a twentieth of the calibrated
#: activations' to the calibrated std itself.
INPUT_STDS = (0.03, 0.1, 0.3, 1.0, 2.0)
#: Tokens per comparison (E=8, top-2: 32 per expert on average).
TOKENS = 128
CALIBRATION_SAMPLES = 16
CALIBRATION_TOKENS = 32
#: Gain of the norm in front of each MoE block: the experts' calibration
#: input has std about this.
_MOE_INPUT_GAIN = 2.0
_WORDS = tuple(f"w{i}" for i in range(60))
_UNK, _PAD = "<unk>", "<pad>"


@dataclass(frozen=True)
class TinyMoE:
    """One tiny model: its architecture, sizes and expert weight std per
    layer. ``model_type`` is transformers' (``qwen3_moe``, ``qwen3_5_moe``)."""

    name: str
    model_type: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    expert_std: tuple[float, ...]  # one per decoder layer
    num_heads: int = 4
    head_dim: int = 64

    @property
    def num_layers(self) -> int:
        return len(self.expert_std)

    def experts_module(self, layer: int) -> str:
        """The module name of decoder layer ``layer``'s routed experts."""
        stack = "model.language_model" if self.model_type == "qwen3_5_moe" else "model"
        return f"{stack}.layers.{layer}.mlp.experts"

    def config(self):
        """The transformers config (Qwen3-MoE: ``norm_topk_prob=True``, so
        its routing renormalizes as Qwen3.5-MoE's always does)."""
        from transformers import Qwen3_5MoeConfig, Qwen3MoeConfig

        text = dict(
            vocab_size=len(_WORDS) + 2,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=2,
            head_dim=self.head_dim,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            max_position_embeddings=2 * CALIBRATION_TOKENS,
            pad_token_id=1,
        )
        if self.model_type == "qwen3_moe":
            return Qwen3MoeConfig(
                **text,
                intermediate_size=2 * self.moe_intermediate_size,
                norm_topk_prob=True,
                architectures=["Qwen3MoeForCausalLM"],
            )
        if self.model_type == "qwen3_5_moe":
            # Full attention in every layer: the Gated DeltaNet layers of the
            # real 3:1 pattern run transformers' reference PyTorch kernel on
            # CPU (about 60 s for this calibration) and hold no experts.
            text.update(
                layer_types=["full_attention"] * self.num_layers,
                shared_expert_intermediate_size=self.moe_intermediate_size,
            )
            vision = dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=self.hidden_size,
            )
            return Qwen3_5MoeConfig(
                text_config=text,
                vision_config=vision,
                architectures=["Qwen3_5MoeForConditionalGeneration"],
            )
        raise ValueError(f"unknown model_type {self.model_type!r}")


MODELS = {
    m.name: m
    for m in (
        TinyMoE("qwen3_moe", "qwen3_moe", 256, 128, 8, 2, expert_std=(0.05, 0.006)),
        TinyMoE("qwen3_5_moe", "qwen3_5_moe", 256, 128, 8, 2, expert_std=(0.02, 0.01)),
        # One layer of a real model's size (Qwen3.6-35B-A3B's H and I).
        TinyMoE(
            "qwen3_moe-2048x512",
            "qwen3_moe",
            2048,
            512,
            8,
            2,
            expert_std=(0.02,),
            num_heads=16,
            head_dim=128,
        ),
    )
}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_UNK: 0, _PAD: 1, **{w: i + 2 for i, w in enumerate(_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=_UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=_UNK, pad_token=_PAD)


def calibration_texts() -> list[str]:
    """:data:`CALIBRATION_SAMPLES` lines of :data:`CALIBRATION_TOKENS` random
    words of the tokenizer's vocabulary (seeded)."""
    gen = torch.Generator().manual_seed(1)
    shape = (CALIBRATION_SAMPLES, CALIBRATION_TOKENS)
    picks = torch.randint(len(_WORDS), shape, generator=gen)
    return [" ".join(_WORDS[i] for i in row) for row in picks.tolist()]


@torch.no_grad()
def _set_weights(model, spec: TinyMoE) -> None:
    gen = torch.Generator().manual_seed(0)
    for layer, std in enumerate(spec.expert_std):
        experts = model.get_submodule(spec.experts_module(layer))
        block = model.get_submodule(spec.experts_module(layer).rsplit(".", 1)[0])
        for p in (experts.gate_up_proj, experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        block.gate.weight.copy_(
            torch.randn(block.gate.weight.shape, generator=gen) * 0.02
        )
        decoder = model.get_submodule(spec.experts_module(layer).rsplit(".", 2)[0])
        norm = decoder.post_attention_layernorm.weight
        # Qwen3.5's RMSNorm multiplies by (1 + weight), Qwen3's by weight.
        offset = 1.0 if spec.model_type == "qwen3_5_moe" else 0.0
        norm.fill_(_MOE_INPUT_GAIN - offset)


def write_tiny_moe(spec: TinyMoE, path: Path) -> Path:
    """Build ``spec``'s model (BF16, seeded) and save it with its tokenizer
    to ``path`` (a Hugging Face model directory, as the tools load one)."""
    import transformers

    config = spec.config()
    cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(0)
    model = cls(config).to(torch.bfloat16)
    _set_weights(model, spec)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def load_tiny_moe(spec: TinyMoE, path: Path):
    """``(model, tokenizer)`` loaded from :func:`write_tiny_moe`'s directory
    (a new model object each call: the tools change the one they get)."""
    import transformers

    cls = getattr(transformers, spec.config().architectures[0])
    model = cls.from_pretrained(path, dtype=torch.bfloat16, local_files_only=True)
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


@dataclass(frozen=True)
class ExpertInputs:
    """One comparison's inputs to a MoE layer's experts: ``x`` [T, H] BF16
    of the given std, router ``logits`` [T, E] float32 and the routes they
    make (softmax, top-k, renormalized): ``topk_ids`` [T, K] int64,
    ``topk_weights`` [T, K] float32."""

    std: float
    x: torch.Tensor
    logits: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def expert_inputs(spec: TinyMoE, std: float) -> ExpertInputs:
    """Seeded inputs at ``std``: the same direction and the same routes at
    every std (only the magnitude changes). The routes are the ones the
    tree's ``FusedMoE`` makes from ``logits`` (``fused_topk``), so both sides
    of a comparison route alike."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(TOKENS, spec.hidden_size, generator=gen)
    logits = torch.randn(TOKENS, spec.num_experts, generator=gen)
    weights, ids = fused_topk(x, logits, spec.top_k, renormalize=True)
    return ExpertInputs(std, (x * std).bfloat16(), logits, ids.long(), weights.float())
