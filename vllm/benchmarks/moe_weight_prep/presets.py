# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routed-expert shapes of real MoE models, for weight-preparation benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MOE_MODEL_PRESETS", "MoEModelPreset", "get_preset"]


@dataclass(frozen=True)
class MoEModelPreset:
    """One MoE model's routed-expert geometry at tensor-parallel size 1.

    Attributes:
        name: preset key (lower case, as typed on the command line).
        hf_id: the model it describes.
        num_moe_layers: number of MoE layers.
        hidden_size: H.
        num_experts: E (routed experts).
        top_k: experts per token.
        intermediate_size: I, one expert's intermediate size at TP=1.
        activation: "silu" (gated, w13 has 2I rows) or "relu2" (I rows).
    """

    name: str
    hf_id: str
    num_moe_layers: int
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    activation: str

    @property
    def is_gated(self) -> bool:
        return self.activation == "silu"

    def intermediate_size_per_partition(self, tp_size: int = 1) -> int:
        """I / tp_size; raises ValueError if it does not split into 16-blocks."""
        if tp_size <= 0 or self.intermediate_size % (16 * tp_size) != 0:
            raise ValueError(
                f"--tp {tp_size} does not divide {self.name}'s intermediate "
                f"size {self.intermediate_size} into multiples of 16"
            )
        return self.intermediate_size // tp_size

    def w13_rows(self, tp_size: int = 1) -> int:
        i = self.intermediate_size_per_partition(tp_size)
        return 2 * i if self.is_gated else i


# One preset per row, its fields in columns: kept as a table (fmt: skip).
MOE_MODEL_PRESETS: dict[str, MoEModelPreset] = {
    p.name: p
    for p in [
        MoEModelPreset("qwen3.6-35b-a3b", "Qwen/Qwen3.6-35B-A3B", 40, 2048, 256, 8, 512, "silu"),
        MoEModelPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 2048, 128, 8, 768, "silu"),
        MoEModelPreset("qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B-Instruct", 48, 2048, 512, 10, 512, "silu"),
        MoEModelPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 4096, 128, 8, 1536, "silu"),
        MoEModelPreset("deepseek-v3", "deepseek-ai/DeepSeek-V3", 58, 7168, 256, 8, 2048, "silu"),
        MoEModelPreset("llama-4-scout-17b-16e", "meta-llama/Llama-4-Scout-17B-16E", 48, 5120, 16, 1, 8192, "silu"),
        MoEModelPreset("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 4096, 8, 2, 14336, "silu"),
        MoEModelPreset("nemotron-3-nano-30b-a3b", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B", 23, 2688, 128, 6, 1856, "relu2"),
    ]
}  # fmt: skip


def get_preset(name: str) -> MoEModelPreset:
    """The preset called ``name``, or describing the model ``name`` (its
    Hugging Face id, e.g. "Qwen/Qwen3.6-35B-A3B", as the report prints it);
    case-insensitive. ValueError listing the presets otherwise."""
    key = name.strip().lower()
    if key in MOE_MODEL_PRESETS:
        return MOE_MODEL_PRESETS[key]
    for preset in MOE_MODEL_PRESETS.values():
        if preset.hf_id.lower() == key:
            return preset
    raise ValueError(
        f"unknown model preset {name!r}; known: {', '.join(MOE_MODEL_PRESETS)} "
        "(or their ids: --model list)"
    )
