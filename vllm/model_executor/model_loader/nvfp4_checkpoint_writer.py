# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write small NVFP4 MoE checkpoints (ModelOpt or compressed-tensors layout).

For tests and for trying ``vllm bench moe-weight-prep --checkpoint`` without
a download: BF16 expert weights are quantized with the project's NVFP4
reference, one global scale per expert and projection (so gate and up get
different ones), and written as sharded safetensors with an index::

    python -m vllm.model_executor.model_loader.nvfp4_checkpoint_writer OUT_DIR \\
        [--format modelopt|compressed-tensors] [--activation silu|relu2] \\
        [--quant-mode w4a4|w4a16|mixed] [--per-layer] [--overwrite] ...

The checkpoint is written into a new directory beside ``OUT_DIR`` and
renamed into place at the end, so an interrupted write leaves no
half-written checkpoint; a non-empty ``OUT_DIR`` is refused unless
``overwrite`` (``--overwrite``). Files get the usual modes (the umask's).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    global_scale_to_compressed_tensors,
    global_scale_to_modelopt,
    nvfp4_global_scale,
    quantize_nvfp4,
)
from vllm.model_executor.model_loader.checkpoint_files import (
    check_target,
    whole_directory,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    MODELOPT,
)
from vllm.model_executor.model_loader.nvfp4_moe_quant_modes import W4A4, W4A16
from vllm.utils.argparse_utils import CommandLineParser, positive_int
from vllm.utils.mem_utils import available_memory_bytes

__all__ = [
    "random_bf16_experts",
    "write_nvfp4_moe_checkpoint",
]


def _global_scales(w: torch.Tensor, pow2: bool, amax=None) -> torch.Tensor:
    """One quantization-direction global scale per expert of ``w`` [c, N, K]
    (float32 [c]), from ``amax`` [c] (default: each expert's own)."""
    if amax is None:
        amax = w.float().abs().amax(dim=(1, 2))
    gs = nvfp4_global_scale(amax)
    if pow2:
        # The largest power of two not above 448*6/amax: block scales stay
        # <= 448, and folding this scale into them is exact (an exponent shift).
        gs = torch.exp2(torch.floor(torch.log2(gs)))
    return gs


def _experts_tensors(
    w: torch.Tensor, fmt: str, pow2: bool, act_amax: float | None, amax=None
) -> list[dict[str, torch.Tensor]]:
    """NVFP4 tensors of one projection of ``c`` experts, ``w`` [c, N, K]: per
    expert a dict suffix -> tensor (each its own storage, as safetensors
    needs). The global scales from ``amax`` [c] (default: each expert's own);
    a static input scale from ``act_amax`` unless it is None. The same bytes
    as quantizing each expert alone: the quantization is per block, with
    each expert's global scale."""
    gs = _global_scales(w, pow2, amax)
    packed, scale = quantize_nvfp4(w, gs)
    in_gs = None if act_amax is None else nvfp4_global_scale(torch.tensor(act_amax))
    out = []
    for i in range(w.shape[0]):
        if fmt == MODELOPT:
            t = {
                "weight": packed[i].clone(),
                "weight_scale": scale[i].clone(),
                "weight_scale_2": global_scale_to_modelopt(gs[i]).reshape(()),
            }
            if in_gs is not None:
                t["input_scale"] = global_scale_to_modelopt(in_gs).reshape(())
        else:
            t = {
                "weight_packed": packed[i].clone(),
                "weight_scale": scale[i].clone(),
                "weight_global_scale": global_scale_to_compressed_tensors(
                    gs[i]
                ).reshape(1),
            }
            if in_gs is not None:
                t["input_global_scale"] = global_scale_to_compressed_tensors(
                    in_gs
                ).reshape(1)
        out.append(t)
    return out


#: Experts are quantized a few at a time: about this many weights per call
#: (2 MiB of float32 temporaries, several alive at once; a whole layer at
#: once spills the cache).
_WEIGHTS_PER_CALL = 1 << 19


_NVFP4_SCHEME = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": 16,
    "symmetric": True,
    "dynamic": False,
}
_MODELOPT_ALGO = {W4A4: "NVFP4", W4A16: "W4A16_NVFP4"}


def _ct_group(targets: list[str], mode: str) -> dict:
    """A compressed-tensors NVFP4 config group; W4A16: null input activations."""
    acts = None if mode == W4A16 else {**_NVFP4_SCHEME, "dynamic": "local"}
    return {
        "targets": targets,
        "weights": dict(_NVFP4_SCHEME),
        "input_activations": acts,
        "format": "nvfp4-pack-quantized",
    }


def _experts_modules(modes: dict[int, str], prefix: str, block: str) -> dict:
    return {f"{prefix}.{i}.{block}.experts": m for i, m in sorted(modes.items())}


def _modelopt_quantization(
    modes: dict[int, str], per_layer: bool, prefix: str, block: str
) -> dict:
    """ModelOpt's ``quantization`` dict: one ``quant_algo`` for the checkpoint,
    or MIXED_PRECISION with ``quantized_layers`` (the experts modules, next to
    FP8 attention entries as in NVIDIA's mixed releases)."""
    distinct = set(modes.values())
    if len(distinct) == 1 and not per_layer:
        return {
            "quant_algo": _MODELOPT_ALGO[distinct.pop()],
            "group_size": 16,
            "exclude_modules": ["lm_head"],
        }
    layers = {}
    for module, mode in _experts_modules(modes, prefix, block).items():
        layers[module] = {"quant_algo": _MODELOPT_ALGO[mode], "group_size": 16}
        attn = module.rsplit(".", 2)[0] + ".self_attn.q_proj"
        layers[attn] = {"quant_algo": "FP8"}
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "quantized_layers": layers,
        "exclude_modules": ["lm_head"],
    }


def _compressed_tensors_config(modes: dict[int, str], prefix: str, block: str) -> dict:
    """compressed-tensors ``quantization_config``: one group targeting every
    Linear, or one group per mode whose ``re:`` targets name its layers'
    experts (plus an FP8 group for attention, as a mixed export has)."""
    distinct = sorted(set(modes.values()))
    if len(distinct) == 1:
        return {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": _ct_group(["Linear"], distinct[0])},
            "ignore": ["lm_head"],
        }
    groups = {}
    for n, mode in enumerate(distinct):
        idx = "|".join(str(i) for i, m in sorted(modes.items()) if m == mode)
        pattern = (
            re.escape(f"{prefix}.")
            + f"({idx})"
            + re.escape(f".{block}.experts.")
            + ".*"
        )
        groups[f"group_{n}"] = _ct_group([f"re:{pattern}"], mode)
    fp8 = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "symmetric": True,
        "dynamic": False,
    }
    groups["group_fp8"] = {
        "targets": [r"re:.*self_attn\..*"],
        "weights": fp8,
        "input_activations": fp8,
        "format": "float-quantized",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "config_groups": groups,
        "ignore": ["lm_head"],
    }


def write_nvfp4_moe_checkpoint(
    out_dir: str | Path,
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]],
    config: dict,
    *,
    fmt: str = MODELOPT,
    gated: bool = True,
    prefix: str = "model.layers",
    block: str = "mlp",
    max_shard_bytes: int = 16 << 20,
    pow2_global_scales: bool = False,
    act_amax: float = 8.0,
    quant_config_in_config_json: bool = False,
    shared_w13_global_scale: bool = False,
    quant_mode: str | dict[int, str] = W4A4,
    per_layer: bool = False,
    w4a16_input_scales: bool = False,
    overwrite: bool = False,
) -> Path:
    """Quantize and write the routed experts of ``layers`` as an NVFP4 checkpoint.

    Args:
        layers: decoder layer index -> (w13 [E, 2I, H] in [gate; up] order, or
            [E, I, H] up_proj when not gated; w2 [E, H, I]), any float dtype.
        config: the model's ``config.json`` contents (hidden size, expert
            counts, ...); the quantization config is added.
        fmt: ``"modelopt"`` (``hf_quant_config.json``, or ``config.json``'s
            ``quantization_config`` with ``quant_config_in_config_json``) or
            ``"compressed-tensors"`` (``config.json``).
        gated: w13 holds gate_proj then up_proj; else it is up_proj alone.
        max_shard_bytes: start a new ``model-XXXXX-of-YYYYY.safetensors`` when
            a shard would exceed this; an index is always written.
        pow2_global_scales: round each global scale down to a power of two
            (a valid checkpoint whose scale fold is exact).
        act_amax: activation amax recorded as the static input scale (W4A4
            layers; W4A16 layers have none unless ``w4a16_input_scales``).
        shared_w13_global_scale: gate_proj and up_proj of an expert share one
            global scale, from their joint amax (what ModelOpt exports);
            default: each its own.
        quant_mode: ``"w4a4"`` or ``"w4a16"`` (weight-only) for every layer,
            or a dict giving each layer of ``layers`` its own (a mixed
            checkpoint). ModelOpt declares one mode as the top-level
            ``quant_algo`` (``NVFP4`` / ``W4A16_NVFP4``) and several as
            ``MIXED_PRECISION`` with ``quantized_layers`` naming each experts
            module (plus FP8 attention entries, as NVIDIA's releases have);
            compressed-tensors as config groups, W4A16 with
            ``input_activations: null``, per-layer ``re:`` targets when mixed.
        per_layer: ModelOpt: write ``MIXED_PRECISION`` / ``quantized_layers``
            even for one mode (NVIDIA's Qwen3.6 NVFP4 release does).
        w4a16_input_scales: W4A16 layers carry input scales too (some exports
            do; the reader ignores them).
        overwrite: replace a non-empty ``out_dir`` (default: ValueError).

    Everything is written into a new directory beside ``out_dir`` that is
    renamed to ``out_dir`` at the end (and removed on any error), so
    ``out_dir`` is never half-written. Returns the output directory.
    """
    if fmt not in (MODELOPT, COMPRESSED_TENSORS):
        raise ValueError(
            f"fmt must be {MODELOPT!r} or {COMPRESSED_TENSORS!r}, got {fmt!r}"
        )
    modes = (
        dict(quant_mode)
        if isinstance(quant_mode, dict)
        else dict.fromkeys(layers, quant_mode)
    )
    if set(modes) != set(layers) or not set(modes.values()) <= {W4A4, W4A16}:
        raise ValueError(
            f"quant_mode must be {W4A4!r} or {W4A16!r}, or a dict giving one of "
            f"them to each of the layers {sorted(layers)}; got {quant_mode!r}"
        )
    with whole_directory(out_dir, overwrite) as tmp:
        _write(
            tmp,
            layers,
            config,
            fmt,
            gated,
            prefix,
            block,
            max_shard_bytes,
            pow2_global_scales,
            act_amax,
            quant_config_in_config_json,
            shared_w13_global_scale,
            modes,
            per_layer,
            w4a16_input_scales,
        )
    return Path(out_dir)


def _write(
    out: Path,
    layers,
    config,
    fmt,
    gated,
    prefix,
    block,
    max_shard_bytes,
    pow2_global_scales,
    act_amax,
    quant_config_in_config_json,
    shared_w13_global_scale,
    modes,
    per_layer,
    w4a16_input_scales,
) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for layer_idx, (w13, w2) in sorted(layers.items()):
        e = w13.shape[0]
        half = w13.shape[1] // 2
        projs = (
            {"gate_proj": w13[:, :half], "up_proj": w13[:, half:]}
            if gated
            else {"up_proj": w13}
        )
        projs["down_proj"] = w2
        with_input = modes[layer_idx] == W4A4 or w4a16_input_scales
        per_call = max(1, _WEIGHTS_PER_CALL // (w13[0].numel() or 1))
        for first in range(0, e, per_call):
            chunk = range(first, min(e, first + per_call))
            joint = (
                w13[chunk.start : chunk.stop].float().abs().amax(dim=(1, 2))
                if shared_w13_global_scale
                else None
            )
            # proj -> one dict per expert of the chunk
            done = {
                proj: _experts_tensors(
                    w[chunk.start : chunk.stop],
                    fmt,
                    pow2_global_scales,
                    act_amax if with_input else None,
                    joint if proj != "down_proj" else None,
                )
                for proj, w in projs.items()
            }
            # The order of the per-expert writer before: expert, projection,
            # suffix (it decides where the shards split).
            for i, ex in enumerate(chunk):
                base = f"{prefix}.{layer_idx}.{block}.experts.{ex}"
                for proj in projs:
                    for suffix, t in done[proj][i].items():
                        tensors[f"{base}.{proj}.{suffix}"] = t

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    # safetensors creates its files with mode 0o600; give them the mode any
    # new file gets here, which the directory (made with 0o777) shows.
    file_mode = 0o666 & out.stat().st_mode
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        os.chmod(out / file, file_mode)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
        )
    )
    config = dict(config)
    if fmt == MODELOPT:
        quantization = _modelopt_quantization(modes, per_layer, prefix, block)
        if quant_config_in_config_json:
            config["quantization_config"] = {"quant_method": "modelopt", **quantization}
        else:
            (out / "hf_quant_config.json").write_text(
                json.dumps(
                    {
                        "producer": {
                            "name": "modelopt",
                            "version": "vllm-nvfp4-test-writer",
                        },
                        "quantization": quantization,
                    },
                    indent=2,
                )
            )
    else:
        config["quantization_config"] = _compressed_tensors_config(modes, prefix, block)
    (out / "config.json").write_text(json.dumps(config, indent=2))


def random_bf16_experts(
    e: int, hidden: int, inter: int, gated: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random BF16 experts with unit-variance outputs for unit-variance inputs:
    w13 [E, 2I or I, H] ([gate; up]), w2 [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    w13 = torch.randn(e, rows, hidden, generator=gen) / math.sqrt(hidden)
    w2 = torch.randn(e, hidden, inter, generator=gen) / math.sqrt(inter)
    return w13.bfloat16(), w2.bfloat16()


def _bytes_needed(args) -> int:
    """Peak bytes of :func:`main`: every layer's BF16 experts (2 bytes per
    weight), their NVFP4 tensors (0.5 + 1/16), and the float32 draw of one
    w13 (4 bytes per weight, twice: the draw and its scaled copy)."""
    rows = (
        2 * args.intermediate_size
        if args.activation == "silu"
        else (args.intermediate_size)
    )
    per_layer = args.num_experts * args.hidden_size * (rows + args.intermediate_size)
    draw = args.num_experts * rows * args.hidden_size * 8
    return args.num_layers * per_layer * (2 + 0.5 + 1 / 16) + draw


def _example_config(args) -> dict:
    if args.activation == "silu":
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "hidden_size": args.hidden_size,
            "num_hidden_layers": args.num_layers,
            "num_experts": args.num_experts,
            "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.intermediate_size,
            "hidden_act": "silu",
        }
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "n_routed_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.intermediate_size,
        "mlp_hidden_act": "relu2",
    }


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.process_policy import PREP_CPU_THREADS, intra_op_threads

    parser = CommandLineParser(
        prog="python -m vllm.model_executor.model_loader.nvfp4_checkpoint_writer",
        description="Write a small NVFP4 MoE checkpoint with random weights "
        "(ModelOpt or compressed-tensors layout) for trying the loader and "
        "`vllm bench moe-weight-prep --checkpoint`. MoE layers only.",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument(
        "--format",
        default=MODELOPT,
        choices=[MODELOPT, COMPRESSED_TENSORS],
        help="checkpoint layout (default %(default)s)",
    )
    parser.add_argument(
        "--activation",
        default="silu",
        choices=["silu", "relu2"],
        help="silu: gated experts (gate_proj/up_proj/down_proj); "
        "relu2: non-gated (up_proj/down_proj, Nemotron-style) "
        "(default %(default)s)",
    )
    for flag, default, what in (
        ("--num-layers", 4, "MoE layers"),
        ("--num-experts", 64, "experts per layer"),
        ("--top-k", 8, "experts per token (at most --num-experts)"),
        ("--hidden-size", 1024, "H, a multiple of 16"),
        ("--intermediate-size", 256, "I per expert, a multiple of 16"),
    ):
        parser.add_argument(
            flag,
            type=positive_int,
            default=default,
            help=f"{what} (default %(default)s)",
        )
    parser.add_argument(
        "--quant-mode",
        default=W4A4,
        choices=[W4A4, W4A16, "mixed"],
        help="w4a4: NVFP4 weights and activations; w4a16: weight-only NVFP4 "
        "(BF16 activations; ModelOpt W4A16_NVFP4, compressed-tensors with "
        "input_activations null); mixed: even layers w4a16, odd layers w4a4 "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="modelopt: declare each layer's experts under MIXED_PRECISION "
        "quantized_layers (as NVIDIA's Qwen3.6 NVFP4 release) even for one "
        "--quant-mode; mixed always does",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="random seed (default %(default)s)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR when it is not empty (default: refuse)",
    )
    args = parser.parse_args(argv)
    for flag, value in (
        ("--hidden-size", args.hidden_size),
        ("--intermediate-size", args.intermediate_size),
    ):
        if value % 16:
            parser.error(f"{flag} must be a multiple of 16 (NVFP4 blocks), got {value}")
    if args.top_k > args.num_experts:
        parser.error(
            f"--top-k {args.top_k} is more than --num-experts {args.num_experts}"
        )
    try:
        check_target(Path(args.out_dir), args.overwrite, "--overwrite")
    except ValueError as e:
        parser.error(str(e))
    sizes = (
        f"--num-layers {args.num_layers}, --num-experts {args.num_experts}, "
        f"--hidden-size {args.hidden_size}, --intermediate-size "
        f"{args.intermediate_size}"
    )
    need, free = _bytes_needed(args), available_memory_bytes()
    if free is not None and need > free:
        parser.error(
            f"{sizes} need about {need / 2**30:.1f} GiB of memory to write, "
            f"{free / 2**30:.1f} GiB is available"
        )
    gated = args.activation == "silu"
    block = "mlp" if gated else "mixer"
    prefix = "model.layers" if gated else "backbone.layers"
    if args.quant_mode == "mixed":
        modes = {i: W4A16 if i % 2 == 0 else W4A4 for i in range(args.num_layers)}
    else:
        modes = args.quant_mode
    try:
        # One intra-op thread: many small element-wise operations, each of
        # which would wait for its slowest thread; the draw too (the same
        # numbers on any number of threads).
        with intra_op_threads(PREP_CPU_THREADS):
            layers = {
                i: random_bf16_experts(
                    args.num_experts,
                    args.hidden_size,
                    args.intermediate_size,
                    gated,
                    args.seed + i,
                )
                for i in range(args.num_layers)
            }
            out = write_nvfp4_moe_checkpoint(
                args.out_dir,
                layers,
                _example_config(args),
                fmt=args.format,
                gated=gated,
                prefix=prefix,
                block=block,
                max_shard_bytes=64 << 20,
                quant_mode=modes,
                per_layer=args.per_layer,
                overwrite=args.overwrite,
            )
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError) and "alloc" not in str(e):
            raise
        parser.exit(
            2,
            f"{parser.prog}: error: out of memory writing {sizes} "
            f"(about {need / 2**30:.1f} GiB needed)\n",
        )
    print(f"wrote an NVFP4 ({args.format}, {args.quant_mode}) MoE checkpoint to {out}")


if __name__ == "__main__":
    main()
