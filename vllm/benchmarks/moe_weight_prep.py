# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep``: NVFP4 MoE weight preparation, before vs after.

For every MoE layer of a model preset, one layer at a time::

    synthetic NVFP4 w13 (random codes and scales, exact shapes)
      -> legacy   reorder (split + cat: a full second copy)   time, peak
      -> bounded  reorder (in place, chunk-bounded)            time, peak
      -> check: both produce the same bytes

and report per-model totals. Peak transient memory is read with
:func:`vllm.utils.mem_utils.measure_peak_memory` in a separate run from the
timed one (the CPU meter uses the profiler, which slows the code down).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from vllm.benchmarks.legacy_moe_prep import split_cat_reorder
from vllm.benchmarks.moe_model_presets import (
    MOE_MODEL_PRESETS,
    MoEModelPreset,
    get_preset,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    reorder_w1w3_to_w3w1,
)
from vllm.utils.mem_utils import measure_peak_memory

__all__ = ["add_cli_args", "main", "run_benchmark", "synthetic_w13"]

MIB = 1 << 20


def synthetic_w13(
    preset: MoEModelPreset, tp_size: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random NVFP4 ``w13_weight`` [E, rows, H/2] uint8 and ``w13_weight_scale``
    [E, rows, H/16] float8_e4m3fn (finite, positive) of the preset's shapes."""
    rows = preset.w13_rows(tp_size)
    e, h = preset.num_experts, preset.hidden_size
    gen = torch.Generator(device=device).manual_seed(seed)
    # int64 random_ fills 8 bytes per draw: much faster than uint8 randint.
    n_words = -(-e * rows * (h // 2) // 8)
    words = torch.empty(n_words, dtype=torch.int64, device=device)
    words.random_(generator=gen)
    weight = words.view(torch.uint8)[: e * rows * (h // 2)].view(e, rows, h // 2)
    scale_bytes = torch.randint(
        0x08, 0x7F, (e, rows, h // 16), dtype=torch.uint8, device=device,
        generator=gen,
    )  # fmt: skip
    return weight, scale_bytes.view(torch.float8_e4m3fn)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepStats:
    """Per-layer figures of one step in one variant."""

    step: str
    variant: str
    times_s: list[float] = field(default_factory=list)
    peaks_bytes: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "step": self.step,
            "variant": self.variant,
            "layers": len(self.times_s),
            "total_time_s": sum(self.times_s),
            "median_time_per_layer_s": statistics.median(self.times_s)
            if self.times_s
            else 0.0,
            "max_peak_transient_bytes": max(self.peaks_bytes, default=0),
        }


def _timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _metered(fn: Callable[[], object], device: torch.device) -> int:
    with measure_peak_memory(device) as mem:
        out = fn()
        del out
    return mem.peak_bytes


def _bench_reorder_layer(
    weight: torch.Tensor,
    scale: torch.Tensor,
    device: torch.device,
    max_transient_bytes: int,
    legacy: StepStats,
    bounded: StepStats,
    layer: int,
) -> None:
    t, (want_w, want_s) = _timed(lambda: split_cat_reorder(weight, scale), device)
    legacy.times_s.append(t)
    legacy.peaks_bytes.append(
        _metered(lambda: split_cat_reorder(weight, scale), device)
    )

    def bounded_reorder():
        return reorder_w1w3_to_w3w1(
            weight, scale, max_transient_bytes=max_transient_bytes
        )

    t, _ = _timed(bounded_reorder, device)
    bounded.times_s.append(t)
    if not (
        torch.equal(weight, want_w)
        and torch.equal(scale.view(torch.uint8), want_s.view(torch.uint8))
    ):
        raise RuntimeError(f"layer {layer}: the bounded reorder differs from split+cat")
    del want_w, want_s
    # Metered on a second call (it swaps back; the memory is the same).
    bounded.peaks_bytes.append(_metered(bounded_reorder, device))


def run_benchmark(
    preset: MoEModelPreset,
    *,
    device: torch.device,
    tp_size: int = 1,
    num_layers: int | None = None,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Prepare ``num_layers`` synthetic layers of ``preset``, legacy and bounded.

    Returns a JSON-serializable dict: the configuration, per-layer shapes and
    bytes, and per step/variant the times and peak transients of every layer.
    Raises RuntimeError if the bounded result differs from the legacy one.
    """
    layers = preset.num_moe_layers if num_layers is None else num_layers
    if not 1 <= layers <= preset.num_moe_layers:
        raise ValueError(
            f"--num-layers must be in [1, {preset.num_moe_layers}] for "
            f"{preset.name}, got {layers}"
        )
    rows = preset.w13_rows(tp_size)
    e, h = preset.num_experts, preset.hidden_size
    w13_bytes = e * rows * (h // 2) + e * rows * (h // 16)
    legacy = StepStats("reorder", "legacy")
    bounded = StepStats("reorder", "bounded")

    for layer in tqdm(range(layers), desc=preset.name, unit="layer",
                      disable=not progress):  # fmt: skip
        if not preset.is_gated:
            # Non-gated experts have no [w1; w3] halves: nothing to reorder.
            for stats in (legacy, bounded):
                stats.times_s.append(0.0)
                stats.peaks_bytes.append(0)
            continue
        weight, scale = synthetic_w13(preset, tp_size, device, seed + layer)
        _bench_reorder_layer(
            weight, scale, device, max_transient_bytes, legacy, bounded, layer
        )
        del weight, scale

    return {
        "model": preset.name,
        "hf_id": preset.hf_id,
        "device": str(device),
        "torch": torch.__version__,
        "tp_size": tp_size,
        "num_layers": layers,
        "max_transient_bytes": max_transient_bytes,
        "w13_weight_shape": [e, rows, h // 2],
        "w13_scale_shape": [e, rows, h // 16],
        "w13_bytes_per_layer": w13_bytes,
        "steps": [asdict(s) | s.summary() for s in (legacy, bounded)],
    }


def _fmt_mib(n: float) -> str:
    return f"{n / MIB:,.1f} MiB"


def format_report(result: dict) -> str:
    """The human-readable table for one :func:`run_benchmark` result."""
    by = {(s["step"], s["variant"]): s for s in result["steps"]}
    lines = [
        f"model {result['model']} ({result['hf_id']}), device {result['device']}, "
        f"TP {result['tp_size']}, {result['num_layers']} MoE layers",
        f"w13 per layer: weight {result['w13_weight_shape']} uint8, scale "
        f"{result['w13_scale_shape']} float8_e4m3fn "
        f"({_fmt_mib(result['w13_bytes_per_layer'])}); "
        f"cap {_fmt_mib(result['max_transient_bytes'])}",
        "",
        f"{'step':<9}{'variant':<10}{'peak transient':>16}{'median/layer':>14}"
        f"{'total':>10}",
    ]
    for s in result["steps"]:
        lines.append(
            f"{s['step']:<9}{s['variant']:<10}"
            f"{_fmt_mib(s['max_peak_transient_bytes']):>16}"
            f"{s['median_time_per_layer_s'] * 1e3:>11.1f} ms"
            f"{s['total_time_s']:>9.2f}s"
        )
    old, new = by[("reorder", "legacy")], by[("reorder", "bounded")]
    speedup = old["total_time_s"] / new["total_time_s"] if new["total_time_s"] else 0.0
    lines += [
        "",
        f"totals: layers {result['num_layers']}, w13 bytes "
        f"{_fmt_mib(result['num_layers'] * result['w13_bytes_per_layer'])}, "
        f"peak transient before {_fmt_mib(old['max_peak_transient_bytes'])} / "
        f"after {_fmt_mib(new['max_peak_transient_bytes'])}, time before "
        f"{old['total_time_s']:.2f}s / after {new['total_time_s']:.2f}s"
        + (f" ({speedup:.1f}x faster)" if speedup else ""),
    ]
    return "\n".join(lines)


def _parse_size(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in "kmg" else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size like 64MiB, 512K or 1048576, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(value * units[unit])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="model preset, or 'list' to list them: " + ", ".join(MOE_MODEL_PRESETS),
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size "
                        "(divides the intermediate size)")  # fmt: skip
    parser.add_argument(
        "--num-layers", type=int, default=None, help="MoE layers to prepare "
        "(default: all of the model's)"
    )  # fmt: skip
    parser.add_argument(
        "--max-transient",
        type=_parse_size,
        default=DEFAULT_MAX_TRANSIENT_BYTES,
        help="cap on the memory the bounded preparation allocates (default 64MiB)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON")
    parser.add_argument("--no-progress", action="store_true")


def _list_presets() -> str:
    lines = [
        f"{'preset':<26}{'layers':>7}{'H':>6}{'E':>5}{'top-k':>6}{'I':>7}  act   "
        f"{'w13/layer':>12}"
    ]
    for p in MOE_MODEL_PRESETS.values():
        rows = p.w13_rows()
        nbytes = p.num_experts * rows * (p.hidden_size // 2 + p.hidden_size // 16)
        lines.append(
            f"{p.name:<26}{p.num_moe_layers:>7}{p.hidden_size:>6}"
            f"{p.num_experts:>5}{p.top_k:>6}{p.intermediate_size:>7}  "
            f"{p.activation:<5} {_fmt_mib(nbytes):>12}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict | None:
    if args.model == "list":
        print(_list_presets())
        return None
    preset = get_preset(args.model)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
    result = run_benchmark(
        preset,
        device=device,
        tp_size=args.tp,
        num_layers=args.num_layers,
        max_transient_bytes=args.max_transient,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result
