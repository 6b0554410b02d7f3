# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep``: NVFP4 MoE weight preparation, legacy vs bounded.

For every MoE layer of a model preset, one layer at a time::

    synthetic NVFP4 layer (random codes and scales of the exact shapes)
      -> legacy  preparation: reorder (split+cat), swizzle (padded + permuted
                 copies), fold (float32 whole-tensor products)
      -> bounded preparation: FusedMoE's own process_weights_after_loading
                 for the b12x backends (fold, reorder, swizzle, finalize)
      -> check: both give the same bytes

Each variant runs twice on fresh copies of the layer: once timed, once under
:func:`vllm.utils.mem_utils.measure_peak_memory` (the CPU meter uses the
profiler, which slows code down). A step's *peak transient* is its metered
peak minus the growth of the resident parameters it leaves behind (a padded
swizzle result replaces a smaller source): the free memory the step needs
above the weights resident before and after it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from vllm.benchmarks.busy_cores import busy_cores
from vllm.benchmarks.legacy_moe_prep import (
    legacy_preparation_steps,
    split_cat_halves,
)
from vllm.benchmarks.moe_model_presets import (
    MOE_MODEL_PRESETS,
    MoEModelPreset,
    get_preset,
)
from vllm.benchmarks.moe_prep_precision import prepared_weight_precision
from vllm.benchmarks.moe_synthetic_weights import (
    synthetic_layer_tensors,
    synthetic_w13,
)
from vllm.benchmarks.moe_weight_prep_report import (
    REPORTED_STEPS,
    VARIANTS,
    format_mib,
    format_ranks,
    format_report,
    write_plot,
)
from vllm.distributed.launcher import spawn_workers
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    moe_prep_threads,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.argparse_utils import non_negative_int, positive_int
from vllm.utils.mem_utils import measure_peak_memory

__all__ = [
    "CLI_DESCRIPTION",
    "CLI_HELP",
    "REPORTED_STEPS",
    "RankShard",
    "add_cli_args",
    "main",
    "run_benchmark",
    "synthetic_layer_tensors",
    "synthetic_w13",
]

MIB = 1 << 20

CLI_HELP = "NVFP4 MoE weight preparation for FlashInfer: legacy vs bounded"
CLI_DESCRIPTION = (
    "Prepare every MoE layer of a model (synthetic NVFP4 weights of a preset's "
    "exact shapes, or a checkpoint directory) for the FlashInfer b12x kernel, "
    "twice: the legacy way (whole-tensor copies) and the bounded way (this "
    "branch). Reports each step's peak transient memory and time, checks that "
    "both give the same bytes, and the precision of the prepared weights."
)


@dataclass(frozen=True)
class RankShard:
    """The shard of every MoE layer one rank prepares: I split ``tp_size``
    ways (tensor parallelism) or the experts split ``ep_size`` ways (expert
    parallelism, each expert's I whole)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1

    @property
    def rank(self) -> int:
        return self.tp_rank * self.ep_size + self.ep_rank

    def layer_kwargs(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "ep_rank": self.ep_rank, "ep_size": self.ep_size}  # fmt: skip

    def describe(self) -> str:
        if self.ep_size > 1:
            return f"EP {self.ep_rank}/{self.ep_size}"
        return f"TP {self.tp_rank}/{self.tp_size}"

    def check(self, preset: MoEModelPreset) -> None:
        """ValueError if ``preset`` cannot be split this way."""
        preset.intermediate_size_per_partition(self.tp_size)
        if preset.num_experts % self.ep_size:
            raise ValueError(
                f"--tp {self.ep_size} with --enable-expert-parallel does not divide "
                f"{preset.name}'s {preset.num_experts} experts"
            )


def _make_layer(preset, shard, device, tensors, cap, mode="alpha"):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    # The emulated backend runs the kernel backend's preparation line for
    # line (it subclasses it) on any device.
    layer = FusedMoE(
        num_experts=preset.num_experts,
        top_k=preset.top_k,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        activation=preset.activation,
        quant_config=ModelOptNvFp4Config(),
        moe_backend="flashinfer_b12x_emulated",
        device=device,
        **shard.layer_kwargs(),
        place_w3w1_at_load=False,  # tensors are copied in checkpoint layout
        experts_kwargs={"max_transient_bytes": cap, "global_scale_mode": mode},
    )
    with torch.no_grad():
        for name, value in tensors.items():
            getattr(layer, name).copy_(value)
    return layer


def _resident_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# --- running steps -----------------------------------------------------------------


@dataclass
class StepRecord:
    """One step of one variant on one layer."""

    step: str
    time_s: float | None = None
    peak_bytes: int | None = None  # metered peak above the step's start
    growth_bytes: int = 0  # resident parameters after minus before
    timeline: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None

    @property
    def transient_bytes(self) -> int | None:
        if self.peak_bytes is None:
            return None
        return max(0, self.peak_bytes - max(0, self.growth_bytes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_steps(
    steps: list[tuple[str, Callable[[], None]]],
    resident: Callable[[], int],
    device: torch.device,
    metered: bool,
) -> list[StepRecord]:
    records = []
    for name, fn in steps:
        rec = StepRecord(step=name)
        before = resident()
        try:
            if metered:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                with measure_peak_memory(device) as mem:
                    fn()
                rec.peak_bytes = mem.peak_bytes
                rec.timeline = mem.timeline
            else:
                _sync(device)
                start = time.perf_counter()
                fn()
                _sync(device)
                rec.time_s = time.perf_counter() - start
        except torch.OutOfMemoryError as e:
            rec.error = f"out of memory: {str(e).splitlines()[0]}"
            records.append(rec)
            break
        rec.growth_bytes = resident() - before
        records.append(rec)
    return records


def _legacy_run(tensors, gated, device, metered):
    owned = {k: v.clone() for k, v in tensors.items()}
    steps = legacy_preparation_steps(owned, gated)
    records = _run_steps(steps, lambda: _resident_bytes(owned.values()), device,
                         metered)  # fmt: skip
    return records, owned


def _bounded_run(preset, shard, tensors, device, cap, metered, mode="alpha"):
    layer = _make_layer(preset, shard, device, tensors, cap, mode)
    steps = dict(layer.quant_method.preparation_steps(layer))
    # Building the kernel object is part of finishing the layer: one step.
    finalize, kernel = steps.pop("finalize"), steps.pop("kernel")
    steps["finalize"] = lambda: (finalize(), kernel())
    steps = list(steps.items())
    # One thread setting around all steps, as process_weights_after_loading.
    with moe_prep_threads(device):
        records = _run_steps(steps, lambda: _resident_bytes(layer.parameters()),
                             device, metered)  # fmt: skip
    return records, layer


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _check_equal(layer, legacy: dict, tensors: dict, layer_idx: int, mode: str):
    """The bounded preparation's bytes against the legacy one's (weights, and
    in "fold" mode the folded scales) or, in "alpha" mode, against the
    checkpoint's own block scales reordered and swizzled."""
    names = ["w13_weight", "w2_weight"]
    s2 = tensors["w13_weight_scale_2"]
    expected = {}
    if mode == "fold" and bool((s2 == s2[:, :1]).all()):
        # With separate w1/w3 global scales the legacy fold is wrong (it used
        # w1's for both halves): only then do the w13 scales differ.
        names += ["w13_weight_scale", "w2_weight_scale"]
    elif mode == "alpha" and bool((s2 == s2[:, :1]).all()):
        s13 = tensors["w13_weight_scale"]
        if layer.moe_config.is_act_and_mul:
            s13 = split_cat_halves(s13, -2)
        expected = {
            "w13_weight_scale": swizzle_blockscale(s13),
            "w2_weight_scale": swizzle_blockscale(tensors["w2_weight_scale"]),
        }
    for name in names:
        expected[name] = legacy[name]
    for name, want in expected.items():
        if not _same_bytes(getattr(layer, name).data, want):
            raise RuntimeError(
                f"layer {layer_idx}: the bounded preparation ({mode}) differs from "
                f"the reference in {name}"
            )


def _summarize(records: list[StepRecord]) -> dict[str, dict]:
    """Per reported step: time and transient (max over the step's records)."""
    out = {}
    for step in REPORTED_STEPS:
        recs = records if step == "total" else [r for r in records if r.step == step]
        times = [r.time_s for r in recs if r.time_s is not None]
        trans = [r.transient_bytes for r in recs if r.transient_bytes is not None]
        out[step] = {
            "time_s": sum(times) if times else None,
            "transient_bytes": max(trans) if trans else None,
            "error": next((r.error for r in recs if r.error), None),
        }
    return out


# --- the benchmark -------------------------------------------------------------------


def run_benchmark(
    preset: MoEModelPreset,
    *,
    device: torch.device,
    shard: RankShard | None = None,
    num_layers: int | None = None,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    memory_limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
    layer_tensors: Callable[[int], dict[str, torch.Tensor]] | None = None,
    global_scale_mode: str = "alpha",
    before_layer: Callable[[], None] | None = None,
) -> dict:
    """Prepare ``num_layers`` layers of ``preset``, legacy and bounded.

    ``shard`` is the part of each layer this process prepares (default: all
    of it); ``before_layer()``, if given, runs before each layer (the ranks
    of a parallel job meet there, so they prepare at the same moment).

    The bounded preparation runs with ``global_scale_mode`` ("alpha", the
    default, or upstream's "fold"); the first layer is also prepared in the
    other mode to report the precision of both (``precision``).

    Layers are synthetic unless ``layer_tensors(i)`` returns the i-th MoE
    layer's parameters (checkpoint layout), e.g. read from a checkpoint.

    Returns a JSON-serializable dict: configuration, shapes, per layer and
    variant the per-step records (time, peak, growth, transient), per-variant
    summaries, and the first layer's metered timelines (for the plot).
    Raises RuntimeError if the two preparations give different bytes.
    """
    shard = shard or RankShard()
    shard.check(preset)
    local_experts = preset.num_experts // shard.ep_size
    layers = preset.num_moe_layers if num_layers is None else num_layers
    if not 1 <= layers <= preset.num_moe_layers:
        raise ValueError(
            f"--num-layers must be in [1, {preset.num_moe_layers}] for "
            f"{preset.name}, got {layers}"
        )
    per_layer: list[dict] = []
    timelines: dict[str, list[dict]] = {}
    precision: dict[str, dict] = {}
    resident = None
    shapes = None
    synthetic = None  # a preset's layers share one shape: one set, reused
    metered_shapes: set[tuple] = set()
    # The meter's first start imports the profiler's dependencies (seconds
    # on CPU); pay for it here, not in a layer's measurement.
    with measure_peak_memory(device):
        pass
    for idx in tqdm(range(layers), desc=preset.name, unit="layer",
                    disable=not progress):  # fmt: skip
        if before_layer is not None:
            before_layer()
        if layer_tensors is None:
            if synthetic is None:
                synthetic = synthetic_layer_tensors(
                    preset, shard.tp_size, device, seed, local_experts
                )
            tensors = synthetic
        else:
            tensors = layer_tensors(idx)
        resident = _resident_bytes(tensors.values())
        shapes = {k: list(v.shape) for k, v in tensors.items()}
        # Allocations depend on shapes and the cap only: each distinct shape
        # is metered once. Each distinct layer (every checkpoint layer, the
        # first synthetic one) is checked byte for byte.
        shape_key = tuple((k, tuple(v)) for k, v in shapes.items())
        meter = shape_key not in metered_shapes
        check = layer_tensors is not None or idx == 0
        row: dict[str, list[StepRecord]] = {}
        with _memory_limit(device, memory_limit):
            # Timed runs, then the accuracy check, then metered runs.
            legacy_timed, legacy_out = _legacy_run(tensors, preset.is_gated, device,
                                                   False)  # fmt: skip
            bounded_timed, layer = _bounded_run(
                preset, shard, tensors, device, max_transient_bytes, False,
                global_scale_mode,
            )  # fmt: skip
            ok = not any(r.error for r in legacy_timed + bounded_timed)
            if ok and check:
                _check_equal(layer, legacy_out, tensors, idx, global_scale_mode)
            del legacy_out
            if ok and idx == 0:
                experts = sorted({0, local_experts // 2, local_experts - 1})
                precision[global_scale_mode] = prepared_weight_precision(
                    layer, tensors, experts
                )
            # Dropped before the other mode's copy is prepared: the tensors
            # and one layer are alive at a time (DeepSeek-V3: 6 GiB each).
            del layer
            if ok and idx == 0:
                other = "fold" if global_scale_mode == "alpha" else "alpha"
                _, other_layer = _bounded_run(
                    preset, shard, tensors, device, max_transient_bytes, False,
                    other,
                )  # fmt: skip
                precision[other] = prepared_weight_precision(
                    other_layer, tensors, experts
                )
                del other_layer
                precision = {m: precision[m] for m in ("alpha", "fold")}
            legacy_mem = bounded_mem = []
            if meter:
                metered_shapes.add(shape_key)
                legacy_mem, _ = _legacy_run(tensors, preset.is_gated, device, True)
                bounded_mem, _ = _bounded_run(preset, shard, tensors, device,
                                              max_transient_bytes, True,
                                              global_scale_mode)  # fmt: skip
        row["legacy"] = _merge(legacy_timed, legacy_mem)
        row["bounded"] = _merge(bounded_timed, bounded_mem)
        if idx == 0:
            timelines = {
                v: [
                    {"step": r.step, "timeline": r.timeline, "time_s": r.time_s,
                     "growth_bytes": r.growth_bytes, "peak_bytes": r.peak_bytes}
                    for r in row[v]
                ]
                for v in VARIANTS
            }  # fmt: skip
        per_layer.append(row)
        del tensors

    summary = {}
    for v in VARIANTS:
        layer_sums = [_summarize(row[v]) for row in per_layer]
        summary[v] = {}
        for step in REPORTED_STEPS:
            times = [s[step]["time_s"] for s in layer_sums if s[step]["time_s"]]
            trans = [s[step]["transient_bytes"] for s in layer_sums
                     if s[step]["transient_bytes"] is not None]  # fmt: skip
            errors = [s[step]["error"] for s in layer_sums if s[step]["error"]]
            summary[v][step] = {
                "total_time_s": sum(times) if times else None,
                "median_time_per_layer_s": statistics.median(times) if times else None,
                "max_transient_bytes": max(trans) if trans else None,
                "errors": errors,
            }
    limit_ok = None
    if memory_limit is not None:
        limit_ok = {
            v: not summary[v]["total"]["errors"]
            and (summary[v]["total"]["max_transient_bytes"] or 0) <= memory_limit
            for v in VARIANTS
        }
    return {
        "model": preset.name,
        "hf_id": preset.hf_id,
        "source": "synthetic" if layer_tensors is None else "checkpoint",
        "device": str(device),
        "torch": torch.__version__,
        "tp_size": shard.tp_size,
        "ep_size": shard.ep_size,
        "rank": shard.rank,
        "shard": shard.describe(),
        "num_layers": layers,
        "activation": preset.activation,
        "max_transient_bytes": max_transient_bytes,
        "global_scale_mode": global_scale_mode,
        "precision": precision,
        "memory_limit_bytes": memory_limit,
        "memory_limit_ok": limit_ok,
        "memory_limit_enforced": device.type == "cuda" and memory_limit is not None,
        "resident_bytes_per_layer": resident,
        "shapes": shapes,
        "summary": summary,
        "first_layer_timelines": timelines,
        "layers": [
            {v: [_record_json(r) for r in row[v]] for v in VARIANTS}
            for row in per_layer
        ],
    }


def _merge(timed: list[StepRecord], metered: list[StepRecord]) -> list[StepRecord]:
    by_step = {r.step: r for r in metered}
    out = []
    for t in timed:
        m = by_step.get(t.step)
        out.append(
            StepRecord(
                step=t.step,
                time_s=t.time_s,
                peak_bytes=m.peak_bytes if m else None,
                growth_bytes=m.growth_bytes if m else t.growth_bytes,
                timeline=m.timeline if m else [],
                error=t.error or (m.error if m else None),
            )
        )
    for m in metered:  # steps the timed run never reached (it ran out of memory)
        if m.step not in {t.step for t in timed}:
            out.append(m)
    return out


def _record_json(r: StepRecord) -> dict:
    return {
        "step": r.step,
        "time_s": r.time_s,
        "peak_bytes": r.peak_bytes,
        "growth_bytes": r.growth_bytes,
        "transient_bytes": r.transient_bytes,
        "error": r.error,
    }


class _memory_limit:
    """On CUDA, cap this process's allocations at the resident memory plus
    ``limit`` bytes (``torch.cuda.set_per_process_memory_fraction``)."""

    def __init__(self, device: torch.device, limit: int | None):
        self.device, self.limit = device, limit

    def __enter__(self):
        if self.limit is None or self.device.type != "cuda":
            return self
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        allowed = torch.cuda.memory_allocated(self.device) + self.limit
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, allowed / total), self.device
        )
        return self

    def __exit__(self, *exc):
        if self.limit is not None and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        return False


# --- reporting --------------------------------------------------------------------


# --- command line ---------------------------------------------------------------------


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
        help="model preset (synthetic weights of its exact shapes), or 'list': "
        + ", ".join(MOE_MODEL_PRESETS),
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
        "--global-scale-mode",
        default="alpha",
        choices=["alpha", "fold"],
        help="how per-expert global scales reach the kernel: 'alpha' keeps them as "
        "the kernel's alphas (exact, default); 'fold' multiplies them into the "
        "FP8 block scales (upstream's contract)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the weights live and are prepared (auto: cuda when available)",
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor-parallel size: N worker processes (gloo on CPU), each "
        "loading or synthesising its own shard and preparing it at the same "
        "moment as the others; N divides I (default 1: this process)",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tp N: shard the experts over the N ranks instead of I "
        "(N divides the number of experts)",
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
        "checked against the meter on CPU",
    )
    parser.add_argument(
        "--busy-cores",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="keep N cores busy with processes copying memory while measuring, "
        "as other workers preparing their shards would (default 0)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic weights (default 0)"
    )
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the first layer's memory over the steps, and the "
        "time per step",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (for logs)"
    )


def _checkpoint_source(path: str, shard: RankShard, device: torch.device):
    """A preset describing the checkpoint's MoE geometry, and a function that
    loads ``shard`` of its i-th MoE layer."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config
    from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
        NVFP4MoECheckpoint,
    )

    ckpt = NVFP4MoECheckpoint(path)
    preset = MoEModelPreset(
        name=ckpt.model_dir.name,
        hf_id=f"{ckpt.model_dir} ({ckpt.format})",
        num_moe_layers=len(ckpt.moe_layers),
        hidden_size=ckpt.hidden_size,
        num_experts=ckpt.num_experts,
        top_k=ckpt.top_k,
        intermediate_size=ckpt.intermediate_size,
        activation=ckpt.activation,
    )
    shard.check(preset)  # validates --tp

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        layer = FusedMoE(
            num_experts=preset.num_experts, top_k=preset.top_k,
            hidden_size=preset.hidden_size,
            intermediate_size=preset.intermediate_size,
            activation=preset.activation, quant_config=ModelOptNvFp4Config(),
            moe_backend="flashinfer_b12x_emulated", device=device,
            **shard.layer_kwargs(), place_w3w1_at_load=False,
        )  # fmt: skip
        # No bar per tensor: the job's bar counts layers already.
        ckpt.load_layer(layer, ckpt.moe_layers[i])
        return {n: p.data for n, p in layer.named_parameters()}

    return preset, layer_tensors


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
            f"{p.activation:<5} {format_mib(nbytes):>12}"
        )
    return "\n".join(lines)


#: Smallest --max-transient the command line accepts. Below it every bounded
#: step moves a few bytes per torch call: at 1 byte one Qwen3.6 layer would
#: take about two hours. The library itself accepts any positive cap.
MIN_CLI_MAX_TRANSIENT = 64 << 10


def _check_output_path(path: str, flag: str) -> None:
    """ValueError now, not after the run, if ``path`` cannot be written."""
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        raise ValueError(f"{flag} {path}: is a directory")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (
        os.path.exists(target) and not os.access(target, os.W_OK)
    ):
        raise ValueError(f"{flag} {path}: not writable")


def main(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status (1 when the bounded
    preparation exceeds ``--memory-limit``). Bad arguments raise ValueError
    before anything runs."""
    if args.model == "list":
        print(_list_presets())
        return 0
    if args.max_transient < MIN_CLI_MAX_TRANSIENT:
        raise ValueError(
            f"--max-transient {args.max_transient} bytes is below "
            f"{MIN_CLI_MAX_TRANSIENT >> 10}KiB: every step would move a few bytes "
            "per torch call and one layer could take hours; use at least 64KiB "
            "(default 64MiB)"
        )
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            _check_output_path(path, flag)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
    n = args.tp
    if n > 1 and device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(
            f"--tp {n} on CUDA needs {n} devices, found {torch.cuda.device_count()}"
        )
    rank0 = _shard_of(0, n, args.enable_expert_parallel)
    layer_tensors = None
    if args.checkpoint:
        preset, layer_tensors = _checkpoint_source(args.checkpoint, rank0, device)
    else:
        preset = get_preset(args.model)
        rank0.check(preset)  # a bad --tp is refused before anything runs
    params = {
        "preset": preset,
        "checkpoint": args.checkpoint,
        "world_size": n,
        "expert_parallel": args.enable_expert_parallel,
        "device": device.type,
        "num_layers": args.num_layers,
        "max_transient_bytes": args.max_transient,
        "memory_limit": args.memory_limit,
        "seed": args.seed,
        "progress": not args.no_progress,
        "global_scale_mode": args.global_scale_mode,
    }
    with busy_cores(args.busy_cores):
        if n == 1:
            results = [
                run_benchmark(
                    preset, device=device, shard=rank0, num_layers=args.num_layers,
                    max_transient_bytes=args.max_transient,
                    memory_limit=args.memory_limit, seed=args.seed,
                    progress=not args.no_progress, layer_tensors=layer_tensors,
                    global_scale_mode=args.global_scale_mode,
                )
            ]  # fmt: skip
        else:
            results = spawn_workers(_rank_job, n, args=(params,))
    for result in results:
        result["busy_cores"] = args.busy_cores
    print(format_report(results[0]))
    if n > 1:
        print()
        print(format_ranks(results))
    if args.plot:
        write_plot(results[0], args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results[0] if n == 1 else {"ranks": results}, f, indent=2)
        print(f"wrote {args.json}")
    over = [
        r["rank"]
        for r in results
        if r["memory_limit_ok"] is not None and not r["memory_limit_ok"]["bounded"]
    ]
    if over:
        where = "" if n == 1 else f" on rank(s) {', '.join(map(str, over))}"
        print(
            "vllm bench moe-weight-prep: error: the bounded preparation exceeds "
            f"--memory-limit {format_mib(args.memory_limit)}{where}",
            file=sys.stderr,
        )
        return 1
    return 0


def _shard_of(rank: int, world_size: int, expert_parallel: bool) -> RankShard:
    if expert_parallel:
        return RankShard(ep_rank=rank, ep_size=world_size)
    return RankShard(tp_rank=rank, tp_size=world_size)


def _rank_job(rank: int, params: dict) -> dict:
    """One worker of ``--tp N``: prepares its own shard of every layer (in
    step with the other ranks) and returns its ``run_benchmark`` result."""
    from vllm.distributed import get_tp_group

    n = params["world_size"]
    shard = _shard_of(rank, n, params["expert_parallel"])
    device = torch.device("cuda", rank) if params["device"] == "cuda" else (
        torch.device("cpu"))  # fmt: skip
    preset, layer_tensors = params["preset"], None
    if params["checkpoint"]:
        preset, layer_tensors = _checkpoint_source(params["checkpoint"], shard, device)
    return run_benchmark(
        preset,
        device=device,
        shard=shard,
        num_layers=params["num_layers"],
        max_transient_bytes=params["max_transient_bytes"],
        memory_limit=params["memory_limit"],
        seed=params["seed"] + rank,
        progress=params["progress"] and rank == 0,
        layer_tensors=layer_tensors,
        global_scale_mode=params["global_scale_mode"],
        before_layer=get_tp_group().barrier,
    )
