# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep``: its command line (arguments, their checks,
the presets' list); the job itself is :func:`~.run.run_job`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import torch

from vllm.benchmarks.moe_weight_prep.output_files import check_output_path
from vllm.benchmarks.moe_weight_prep.precision import PRECISION_CHOICES
from vllm.benchmarks.moe_weight_prep.presets import MOE_MODEL_PRESETS
from vllm.benchmarks.moe_weight_prep.report import format_mib
from vllm.benchmarks.moe_weight_prep.run import run_job, write_json
from vllm.benchmarks.moe_weight_prep.sources import checkpoint_quant_modes
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
)
from vllm.utils.argparse_utils import core_count, positive_int

__all__ = [
    "CLI_DESCRIPTION",
    "CLI_HELP",
    "QUANT_CHOICES",
    "add_cli_args",
    "main",
    "parse_size",
    "resolve_quant_mode",
]

CLI_HELP = "NVFP4 MoE weight preparation for FlashInfer: legacy vs bounded"
CLI_DESCRIPTION = (
    "Prepare every MoE layer of a model (synthetic NVFP4 weights of a preset's "
    "exact shapes, or a checkpoint directory) for the FlashInfer b12x kernel, "
    "twice: the legacy way (whole-tensor copies) and the bounded way (this "
    "branch). Reports each step's peak transient memory and time, checks that "
    "both give the same bytes, and the precision of the prepared weights."
)


#: ``--quant-mode`` values: a mode, or the checkpoint's declared one.
QUANT_CHOICES = ("auto", "w4a4", "w4a16")

#: Largest size accepted on the command line (1 PiB).
MAX_CLI_SIZE = 1 << 50


def parse_size(text: str) -> int:
    """'64MiB', '512K', '1.5G', '1048576' -> bytes (binary units); a positive,
    finite size of at least one byte and at most 1 PiB."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in "kmgt" else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 64MiB, 512K or 1048576, got {text!r}"
        ) from None
    if not math.isfinite(value) or value * units[unit] > MAX_CLI_SIZE:
        raise argparse.ArgumentTypeError(
            f"size must be finite and at most 1024TiB, got {text!r}"
        )
    if value * units[unit] < 1:
        raise argparse.ArgumentTypeError(
            f"size must be at least one byte, got {text!r}"
        )
    return int(value * units[unit])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        help="model preset (synthetic weights of its exact shapes), by name or "
        "by the model's id (e.g. Qwen/Qwen3.6-35B-A3B); 'list' prints them "
        "(with --json, also as JSON): " + ", ".join(MOE_MODEL_PRESETS),
    )
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="an NVFP4 MoE checkpoint directory (ModelOpt or compressed-tensors); "
        "its MoE layers are loaded one at a time",
    )
    parser.add_argument(
        "--backend",
        default="flashinfer_b12x",
        choices=["flashinfer_b12x"],
        help="the kernel whose weight preparation is measured (its preparation "
        "runs on any device; the kernel itself is not called)",
    )
    parser.add_argument(
        "--quant-mode",
        default="auto",
        choices=QUANT_CHOICES,
        help="w4a4: NVFP4 weights and activations (legacy vs bounded); w4a16: "
        "weight-only NVFP4, FlashInfer's W4A16 layout (FlashInfer's public "
        "path, its in-place mode where flashinfer is installed, and the "
        "bounded one); auto: a checkpoint's declared mode, w4a4 for a preset "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--global-scale-mode",
        default="alpha",
        choices=["alpha", "fold"],
        help="how per-expert global scales reach the kernel: 'alpha' (default) "
        "keeps them as the kernel's alphas and rewrites no block scale: the "
        "prepared weights are the checkpoint's exactly, and where gate and up "
        "have different global scales the ratio rides on the FC2 alpha; 'fold' "
        "multiplies them into the FP8 block scales (upstream's contract; "
        "5-70%% at real weight magnitudes). The report prints each mode's "
        "measured error",
    )
    parser.add_argument(
        "--precision",
        default="sample",
        choices=list(PRECISION_CHOICES),
        help="the precision report on the first layer: 'sample' (default) "
        "decodes the first, middle and last expert's first, middle and last "
        "128-row tile of w13 and w2 (stated in the report); 'full' every "
        "expert and row (slow on large layers); 'off' none",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the weights live and are prepared (auto: cuda when available)",
    )
    parser.add_argument(
        "--tp",
        "-tp",
        "--tensor-parallel-size",
        dest="tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor-parallel size: N worker processes (gloo on CPU), each "
        "loading or synthesising its own shard and preparing it at the same "
        "moment as the others; N divides I (default 1: this process)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="with --tp N (N > 1; refused without): shard the experts over "
        "the N ranks instead of I (N divides the number of experts)",
    )
    parser.add_argument(
        "--num-layers",
        type=positive_int,
        default=None,
        help="MoE layers (default: all)",
    )
    parser.add_argument(
        "--max-transient",
        type=parse_size,
        default=DEFAULT_MAX_TRANSIENT_BYTES,
        help="cap on what the bounded preparation allocates (default 64MiB)",
    )
    parser.add_argument(
        "--memory-limit",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="free memory allowed above the resident weights: enforced on CUDA, "
        "checked against the meter on CPU; drawn in the plot",
    )
    parser.add_argument(
        "--busy-cores",
        type=core_count,
        default=0,
        metavar="N",
        help="keep N cores busy with processes copying memory while measuring, "
        "as other workers preparing their shards would (default 0; at most the "
        "cores this process may run on)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic weights (default 0)"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write all results as JSON: {world_size, ..., ranks: [one result "
        "per rank]}, the same layout for any --tp",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="plot the first layer's memory over the steps, legacy and bounded "
        "(rank 0's with --tp N); the format follows the extension (png, svg, "
        "pdf, ...; none: .png is added)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (for logs)"
    )


def _list_presets() -> str:
    lines = [
        f"{'preset':<26}{'layers':>7}{'H':>6}{'E':>5}{'top-k':>6}{'I':>7}  act   "
        f"{'w13/layer':>12}  model id"
    ]
    for p in MOE_MODEL_PRESETS.values():
        rows = p.w13_rows()
        nbytes = p.num_experts * rows * (p.hidden_size // 2 + p.hidden_size // 16)
        lines.append(
            f"{p.name:<26}{p.num_moe_layers:>7}{p.hidden_size:>6}"
            f"{p.num_experts:>5}{p.top_k:>6}{p.intermediate_size:>7}  "
            f"{p.activation:<5} {format_mib(nbytes):>12}  {p.hf_id}"
        )
    return "\n".join(lines)


#: Smallest --max-transient the command line accepts. Below it every bounded
#: step moves a few bytes per torch call: at 1 byte one Qwen3.6 layer would
#: take about two hours. The library itself accepts any positive cap.
MIN_CLI_MAX_TRANSIENT = 64 << 10


def resolve_quant_mode(args: argparse.Namespace) -> str:
    """``"w4a4"`` or ``"w4a16"`` for ``--quant-mode`` (auto: what a checkpoint
    declares; a preset is w4a4). ValueError for ``auto`` on a checkpoint
    that mixes the two."""
    quant_mode = getattr(args, "quant_mode", "auto")
    if quant_mode != "auto":
        return quant_mode
    if not args.checkpoint:
        return "w4a4"
    modes = checkpoint_quant_modes(args.checkpoint)
    found = sorted(set(modes.values()))
    if len(found) > 1:
        w4a16 = [i for i, m in modes.items() if m == "w4a16"]
        raise ValueError(
            f"--checkpoint {args.checkpoint} mixes w4a4 and w4a16 MoE layers "
            f"(w4a16: {w4a16}): pass --quant-mode w4a4 or --quant-mode w4a16 to "
            "measure those layers"
        )
    return found[0]


def _check_w4a16_args(args: argparse.Namespace) -> None:
    unsupported = [
        ("--tp", args.tp != 1),
        ("--enable-expert-parallel", args.enable_expert_parallel),
        ("--global-scale-mode fold", args.global_scale_mode == "fold"),
        ("--plot", bool(args.plot)),
    ]
    for flag, given in unsupported:
        if given:
            raise ValueError(
                f"{flag} is not supported with --quant-mode w4a16 (one process; W4A16 "
                "keeps the global scales as the kernel's alphas)"
            )


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def main(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (1 when the bounded
    preparation exceeds ``--memory-limit``). Bad arguments raise ValueError
    before anything runs; a failure after that (the run, writing the plot)
    raises :class:`RunError`. Outputs are written whole or not at all, the
    JSON first."""
    start = time.perf_counter()
    json_path = args.json and check_output_path(args.json, "--json")
    if args.model == "list":
        print(_list_presets())
        if json_path:
            presets = [dataclasses.asdict(p) for p in MOE_MODEL_PRESETS.values()]
            write_json(json_path, {"presets": presets})
            print(f"wrote {json_path}")
        return 0
    if args.max_transient < MIN_CLI_MAX_TRANSIENT:
        raise ValueError(
            f"--max-transient {args.max_transient} bytes is below "
            f"{MIN_CLI_MAX_TRANSIENT >> 10}KiB: every step would move a few bytes "
            "per torch call and one layer could take hours; use at least 64KiB "
            "(default 64MiB)"
        )
    if args.enable_expert_parallel and args.tp == 1:
        # Accepted silently before: one rank owns every expert, so the run
        # had no expert parallelism at all.
        raise ValueError(
            "--enable-expert-parallel (-ep) needs --tp N with N > 1: it shards "
            "the experts over the N ranks (vLLM's spelling: -tp 2 -ep)"
        )
    plot_path = args.plot and check_output_path(args.plot, "--plot", plot=True)
    device = _device(args.device)
    n = args.tp
    if n > 1 and device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"--tp {n} on CUDA needs {n} devices, found {torch.cuda.device_count()}"
        )
    if args.checkpoint and not os.path.lexists(args.checkpoint):
        raise ValueError(f"--checkpoint {args.checkpoint}: no such directory")
    quant_mode = resolve_quant_mode(args)
    if quant_mode == "w4a16":
        _check_w4a16_args(args)
    return run_job(
        args, device, quant_mode, start=start, json_path=json_path, plot_path=plot_path
    )
