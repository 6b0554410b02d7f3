# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Synthetic NVFP4 MoE checkpoints of real models' expert shapes, for vLLM.

The carrier is a Qwen3-MoE model (`Qwen3MoeForCausalLM`) with a tiny vocabulary
and attention, so that the routed experts are nearly all of it. Only the
experts are NVFP4 (attention, router, embeddings and norms are BF16 and
excluded in the quantization config: vLLM has no NVFP4 linear kernel on CPU).
Expert codes are random bytes and the scales random values in a realistic
range; nothing is quantized. Each layer is streamed into its own safetensors
file, one tensor at a time, so the writer holds one expert's tensor at most.

Expert tensors per projection (`gate_proj` = w1, `up_proj` = w3, `down_proj` =
w2), rows x cols of the unquantized weight being N x K:
  ModelOpt:  weight [N, K/2] uint8, weight_scale [N, K/16] float8_e4m3fn,
             weight_scale_2 [] and input_scale [] float32 (dequantization
             direction, amax / (448 * 6)); `hf_quant_config.json`.
  compressed-tensors (`nvfp4-pack-quantized`): weight_packed, weight_scale,
             weight_global_scale [1] and input_global_scale [1] float32
             (quantization direction, the inverse); `config.json`.
"""

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["FORMATS", "PRESETS", "MoEPreset", "quant_config", "write_checkpoint"]

FORMATS = ("modelopt", "compressed-tensors")

F4_E2M1_MAX = 6.0
F8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# Block scales drawn from the E4M3 codes of [32, 448]: a block's amax between
# 1/14 of its tensor's amax and the amax itself, the global scale being
# amax / (6 * 448). No subnormals, no NaN (0x7f).
_SCALE_CODES = (0x60, 0x7F)

# The carrier's non-expert parts, as small as Qwen3-MoE allows.
_VOCAB, _HEADS, _KV_HEADS, _HEAD_DIM = 256, 2, 1, 64


@dataclass(frozen=True)
class MoEPreset:
    """Routed-expert geometry of one model (TP=1); facts section 5."""

    name: str
    hf_id: str
    num_moe_layers: int
    hidden_size: int  # H
    num_experts: int  # E
    top_k: int
    intermediate_size: int  # I, one expert's


PRESETS = {
    p.name: p
    for p in (
        MoEPreset("qwen3.6-35b-a3b", "Qwen/Qwen3.6-35B-A3B", 40, 2048, 256, 8, 512),
        MoEPreset("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 2048, 128, 8, 768),
        MoEPreset(
            "qwen3-next-80b-a3b", "Qwen/Qwen3-Next-80B-A3B", 48, 2048, 512, 10, 512
        ),
        MoEPreset("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 4096, 128, 8, 1536),
        # For tests: every dimension a multiple of 128 (no swizzle padding).
        MoEPreset("tiny", "none", 2, 256, 8, 2, 256),
    )
}

_Spec = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]
_ST_DTYPES = {
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
}


def _write_safetensors(path: Path, specs: list[_Spec]) -> int:
    """Stream tensors into a safetensors file; each is made just before it is
    written. Returns the bytes of tensor data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in specs:
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype, make in specs:
            t = make()
            if t.shape != shape or t.dtype != dtype:
                raise TypeError(f"{name}: made {t.dtype}{list(t.shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())
    return offset


class _Draws:
    """Random tensors from one seeded generator."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def codes(self, rows: int, cols: int) -> torch.Tensor:
        n = rows * cols
        out = torch.empty(-(-n // 8) * 8, dtype=torch.uint8)
        out.view(torch.int64).random_(-(2**63), 2**63 - 1, generator=self.g)
        return out[:n].view(rows, cols)

    def block_scales(self, rows: int, cols: int) -> torch.Tensor:
        u8 = torch.randint(
            *_SCALE_CODES, (rows, cols), generator=self.g, dtype=torch.uint8
        )
        return u8.view(torch.float8_e4m3fn)

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * torch.rand((), generator=self.g).item()

    def bf16(self, *shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g) * 0.02).to(torch.bfloat16)


def _expert_specs(p: MoEPreset, prefix: str, fmt: str, d: _Draws) -> Iterator[_Spec]:
    H, inter = p.hidden_size, p.intermediate_size
    for e in range(p.num_experts):
        # One global weight scale for gate and up, as ModelOpt exports them.
        w13_amax, w2_amax = d.uniform(0.05, 0.5), d.uniform(0.05, 0.5)
        act_amax = d.uniform(1.0, 20.0)
        for proj, (n, k), amax in (
            ("gate_proj", (inter, H), w13_amax),
            ("up_proj", (inter, H), w13_amax),
            ("down_proj", (H, inter), w2_amax),
        ):
            name = f"{prefix}.{e}.{proj}"
            w_scale = amax / (F4_E2M1_MAX * F8_E4M3_MAX)
            a_scale = act_amax / (F4_E2M1_MAX * F8_E4M3_MAX)
            packed = "weight" if fmt == "modelopt" else "weight_packed"
            yield (
                f"{name}.{packed}",
                (n, k // 2),
                torch.uint8,
                lambda n=n, k=k: d.codes(n, k // 2),
            )
            yield (
                f"{name}.weight_scale",
                (n, k // 16),
                torch.float8_e4m3fn,
                lambda n=n, k=k: d.block_scales(n, k // 16),
            )
            if fmt == "modelopt":
                globals_ = {"weight_scale_2": w_scale, "input_scale": a_scale}
                shape: tuple[int, ...] = ()
            else:
                globals_ = {
                    "weight_global_scale": 1 / w_scale,
                    "input_global_scale": 1 / a_scale,
                }
                shape = (1,)
            for suffix, value in globals_.items():
                yield (
                    f"{name}.{suffix}",
                    shape,
                    torch.float32,
                    lambda v=value, s=shape: torch.full(s, v),
                )


def _bf16(name: str, shape: tuple[int, ...], d: _Draws) -> _Spec:
    return name, shape, torch.bfloat16, lambda: d.bf16(*shape)


def _ones(name: str, n: int) -> _Spec:
    return name, (n,), torch.bfloat16, lambda: torch.ones(n, dtype=torch.bfloat16)


def _dense_layer_specs(p: MoEPreset, prefix: str, d: _Draws) -> list[_Spec]:
    H, q, kv = p.hidden_size, _HEADS * _HEAD_DIM, _KV_HEADS * _HEAD_DIM
    return [
        _bf16(f"{prefix}.self_attn.q_proj.weight", (q, H), d),
        _bf16(f"{prefix}.self_attn.k_proj.weight", (kv, H), d),
        _bf16(f"{prefix}.self_attn.v_proj.weight", (kv, H), d),
        _bf16(f"{prefix}.self_attn.o_proj.weight", (H, q), d),
        _bf16(f"{prefix}.mlp.gate.weight", (p.num_experts, H), d),
        _ones(f"{prefix}.input_layernorm.weight", H),
        _ones(f"{prefix}.post_attention_layernorm.weight", H),
        _ones(f"{prefix}.self_attn.q_norm.weight", _HEAD_DIM),
        _ones(f"{prefix}.self_attn.k_norm.weight", _HEAD_DIM),
    ]


def _hf_config(p: MoEPreset, num_layers: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "torch_dtype": "bfloat16",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,  # dense MLP: no layer has one
        "moe_intermediate_size": p.intermediate_size,
        "num_experts": p.num_experts,
        "num_experts_per_tok": p.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": num_layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "hidden_act": "silu",
        "vocab_size": _VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def quant_config(fmt: str) -> dict:
    if fmt == "modelopt":
        # kv_cache_quant_algo must be present (null is fine): vLLM 0.34.0
        # refuses an NVFP4 hf_quant_config.json without it (modelopt.py:848).
        return {
            "producer": {"name": "modelopt", "version": "0.39.0"},
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": None,
                "group_size": 16,
                "exclude_modules": [
                    "lm_head",
                    "model.layers.*.self_attn*",
                    "model.layers.*.mlp.gate",
                ],
            },
        }
    fp4 = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "nvfp4-pack-quantized",
                "weights": {**fp4, "dynamic": False},
                "input_activations": {**fp4, "dynamic": "local"},
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
    }


def write_checkpoint(
    out_dir: str | Path,
    preset: MoEPreset,
    num_layers: int | None = None,
    fmt: str = "modelopt",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write a synthetic NVFP4 checkpoint of `preset`'s shapes into `out_dir`.

    `num_layers` (default: the preset's) MoE decoder layers, one safetensors
    file each plus one for the embeddings, final norm and LM head. Calls
    `progress(layer)` after each layer. Returns `out_dir`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    num_layers = preset.num_moe_layers if num_layers is None else num_layers
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = _Draws(seed)
    weight_map: dict[str, str] = {}

    def write(file: str, specs: list[_Spec]) -> int:
        weight_map.update({name: file for name, *_ in specs})
        return _write_safetensors(out / file, specs)

    H = preset.hidden_size
    total = write(
        "model-embed.safetensors",
        [
            _bf16("model.embed_tokens.weight", (_VOCAB, H), d),
            _bf16("lm_head.weight", (_VOCAB, H), d),
            _ones("model.norm.weight", H),
        ],
    )
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        specs = [
            *_dense_layer_specs(preset, prefix, d),
            *_expert_specs(preset, f"{prefix}.mlp.experts", fmt, d),
        ]
        total += write(f"model-layer{layer:03d}.safetensors", specs)
        if progress is not None:
            progress(layer)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = _hf_config(preset, num_layers)
    if fmt == "modelopt":
        (out / "hf_quant_config.json").write_text(json.dumps(quant_config(fmt)))
    else:
        config["quantization_config"] = quant_config(fmt)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
