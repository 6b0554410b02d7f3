# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep --quant``: which NVFP4 mode the main job
measures, and its W4A16 run (:mod:`vllm.benchmarks.moe_w4a16_prep`) from
the command line: arguments, the report table, the JSON."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vllm.benchmarks.busy_cores import busy_cores
from vllm.benchmarks.moe_checkpoint_source import (
    checkpoint_quant_modes,
    checkpoint_source,
)
from vllm.benchmarks.moe_model_presets import get_preset
from vllm.benchmarks.moe_w4a16_prep import W4A16_VARIANTS, run_w4a16_benchmark
from vllm.benchmarks.moe_weight_prep_ranks import RankShard
from vllm.benchmarks.output_files import write_atomically

__all__ = [
    "QUANT_CHOICES",
    "add_quant_arg",
    "format_w4a16_report",
    "resolve_quant",
    "run_w4a16_command",
]

MIB = 1 << 20
QUANT_CHOICES = ("auto", "w4a4", "w4a16")


def add_quant_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quant",
        default="auto",
        choices=QUANT_CHOICES,
        help="w4a4: NVFP4 weights and activations (legacy vs bounded); w4a16: "
        "weight-only NVFP4, FlashInfer's W4A16 layout (FlashInfer's public "
        "path, its in-place mode where flashinfer is installed, and the "
        "bounded one); auto: a checkpoint's declared mode, w4a4 for a preset "
        "(default %(default)s)",
    )


def resolve_quant(args: argparse.Namespace) -> str:
    """``"w4a4"`` or ``"w4a16"`` for ``--quant`` (auto: what a checkpoint
    declares; a preset is w4a4). ValueError for ``auto`` on a checkpoint
    that mixes the two."""
    quant = getattr(args, "quant", "auto")
    if quant != "auto":
        return quant
    if not args.checkpoint:
        return "w4a4"
    modes = checkpoint_quant_modes(args.checkpoint)
    found = sorted(set(modes.values()))
    if len(found) > 1:
        w4a16 = [i for i, m in modes.items() if m == "w4a16"]
        raise ValueError(
            f"--checkpoint {args.checkpoint} mixes w4a4 and w4a16 MoE layers "
            f"(w4a16: {w4a16}): pass --quant w4a4 or --quant w4a16 to measure "
            "those layers"
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
                f"{flag} is not supported with --quant w4a16 (one process; W4A16 "
                "keeps the global scales as the kernel's alphas)"
            )


def run_w4a16_command(args: argparse.Namespace, device: torch.device) -> int:
    """The main job with ``--quant w4a16``: prints the table, writes
    ``--json``; returns 1 when the bounded preparation's peak exceeds
    ``--memory-limit`` (checked against the meter), else 0."""
    _check_w4a16_args(args)
    layer_tensors = None
    if args.checkpoint:
        preset, layer_tensors = checkpoint_source(
            args.checkpoint, RankShard(), device, "w4a16"
        )
    else:
        preset = get_preset(args.model)
    with busy_cores(args.busy_cores):
        result = run_w4a16_benchmark(
            preset, device=device, num_layers=args.num_layers,
            max_transient_bytes=args.max_transient, seed=args.seed,
            progress=not args.no_progress, layer_tensors=layer_tensors,
        )  # fmt: skip
    result["busy_cores"] = args.busy_cores
    limit = args.memory_limit
    bounded = result["summary"]["bounded"]["peak_per_layer_bytes"]
    result["memory_limit_bytes"] = limit
    result["memory_limit_ok"] = None if limit is None else bounded <= limit
    print(format_w4a16_report(result))
    if args.json:
        # The main job's one JSON layout, whatever --quant and --tp.
        job = {"world_size": 1, "expert_parallel": False, "quant": "w4a16",
               "busy_cores": args.busy_cores, "ranks": [result]}  # fmt: skip

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(job, f, indent=2)

        write_atomically(args.json, write)
        print(f"wrote {args.json}")
    if result["memory_limit_ok"] is False:
        print(
            "vllm bench moe-weight-prep: error: the bounded W4A16 preparation "
            f"exceeds --memory-limit {_mib(limit)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _secs(t: float | None, digits: int) -> str:
    return "-" if t is None else f"{t:.{digits}f} s"


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f} MiB"


def format_w4a16_report(result: dict) -> str:
    """The table of one :func:`run_w4a16_benchmark` result."""
    n = result["num_layers"]
    lines = [
        f"W4A16 (weight-only NVFP4) preparation for b12x: model {result['model']} "
        f"({result['hf_id']}, {result['source']} weights), device "
        f"{result['device']}, {n} MoE layer{'s' * (n != 1)}, activation "
        f"{result['activation']}"
        + (f", {b} busy core(s)" if (b := result.get("busy_cores")) else ""),
        f"per layer: resident {_mib(result['resident_bytes_per_layer'])} of "
        f"weights and scales; bounded cap {_mib(result['max_transient_bytes'])}",
        "",
        f"{'variant':<25}{'peak/layer':>12}{'kept/layer':>12}{'time/layer':>12}"
        f"{'model peak':>13}{'model kept':>13}{'model time':>12}",
    ]
    for name, s in result["summary"].items():
        lines.append(
            f"{name:<25}{_mib(s['peak_per_layer_bytes']):>12}"
            f"{_mib(s['kept_per_layer_bytes']):>12}"
            f"{_secs(s['median_time_per_layer_s'], 3):>12}"
            f"{_mib(s['model_peak_bytes']):>13}{_mib(s['model_kept_bytes']):>13}"
            f"{_secs(s['model_time_s'], 2):>12}"
        )
    lines.append(
        f"{'memcpy of the layer':<25}{'':>24}"
        f"{result['memcpy_median_time_per_layer_s']:>10.3f} s{'':>26}"
        f"{result['memcpy_model_time_s']:>10.2f} s"
    )
    checked = "layer" if result["source"] == "checkpoint" else "shape"
    lines += [
        "(peak: the most a layer's preparation allocates above its resident "
        "tensors, metered once per shape; kept: what stays allocated beside "
        "them after it; model peak: the earlier layers' kept copies plus one "
        "layer's peak; time/layer: median of the timed runs)",
        *(f"  {k}: {v}" for k, v in W4A16_VARIANTS.items() if k in result["summary"]),
        f"every variant gives the same bytes (checked per {checked})",
    ]
    if d := result.get("gate_up_scales_differ"):
        lines.append(
            f"  except w2_global_scale: in {d} expert(s) of a layer gate and up "
            "have different global scales; this tree carries up / gate in FC2's "
            "alpha (exact), FlashInfer's path takes one FC1 scale for both"
        )
    if result["flashinfer_skipped"]:
        lines.append(
            f"FlashInfer's own functions not run: {result['flashinfer_skipped']}"
        )
    p = result["precision"]
    if p:
        lines.append(
            f"precision of the bounded result vs the checkpoint (first layer, "
            f"experts {p['experts']}): rel. RMS {p['rel_rms']:.4g}; block scales "
            f"flushed to 0 by the W4A16 encoding: {p['flushed']:,} of {p['total']:,}"
        )
    if result.get("memory_limit_bytes") is not None:
        verdict = "fits" if result["memory_limit_ok"] else "EXCEEDS"
        lines.append(
            f"memory limit {_mib(result['memory_limit_bytes'])} above the resident "
            f"weights (checked against the meter): bounded {verdict}"
        )
    return "\n".join(lines)
