# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One rank's W4A4 layers in ``vllm bench moe-weight-prep``: legacy vs bounded,
per step and layer."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from vllm.benchmarks.moe_weight_prep.baselines import (
    legacy_preparation_steps,
    split_cat_halves,
)
from vllm.benchmarks.moe_weight_prep.checks import check_num_layers, same_bytes
from vllm.benchmarks.moe_weight_prep.layer import make_layer
from vllm.benchmarks.moe_weight_prep.memory_limit import limit_cuda_memory
from vllm.benchmarks.moe_weight_prep.precision import (
    PRECISION_CHOICES,
    prepared_weight_precision,
)
from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.report import (
    JOB_PHASES,
    REPORTED_STEPS,
    VARIANTS,
)
from vllm.benchmarks.moe_weight_prep.shard import RankShard
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors
from vllm.entrypoints.process_policy import preparing_weights
from vllm.model_executor.layers.fused_moe.weight_prep_state import wait_for_step
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

__all__ = [
    "StepRecord",
    "check_equal",
    "run_benchmark",
]


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
                wait_for_step(device)
                start = time.perf_counter()
                fn()
                wait_for_step(device)
                rec.time_s = time.perf_counter() - start
        except torch.OutOfMemoryError as e:
            rec.error = f"out of memory: {str(e).splitlines()[0]}"
            records.append(rec)
            break
        rec.growth_bytes = resident() - before
        records.append(rec)
    return records


def _legacy_run(tensors, gated, device, metered, copy_in=contextlib.nullcontext):
    """The legacy steps on a clone of ``tensors``; ``copy_in()`` is the
    context the clone is made in (the job times it apart from the steps)."""
    with copy_in():
        owned = {k: v.clone() for k, v in tensors.items()}
    steps = legacy_preparation_steps(owned, gated)
    records = _run_steps(
        steps, lambda: _resident_bytes(owned.values()), device, metered
    )
    return records, owned


def _bounded_run(
    preset,
    shard,
    tensors,
    device,
    cap,
    metered,
    global_scale_mode="alpha",
    copy_in=contextlib.nullcontext,
):
    """The bounded steps on a new layer holding ``tensors``; ``copy_in()`` is
    the context the layer is built and filled in."""
    with copy_in():
        layer = make_layer(preset, shard, device, tensors, cap, global_scale_mode)
    steps = layer.quant_method.preparation_steps(layer)
    # One thread setting around all steps, as process_weights_after_loading.
    with preparing_weights(device):
        records = _run_steps(
            steps, lambda: _resident_bytes(layer.parameters()), device, metered
        )
    return records, layer


def check_equal(
    layer, legacy: dict, tensors: dict, layer_idx: int, global_scale_mode: str
):
    """The bounded preparation's bytes against the legacy one's (weights, and
    in "fold" mode the folded scales) or, in "alpha" mode, against the
    checkpoint's own block scales reordered and swizzled."""
    names = ["w13_weight", "w2_weight"]
    s2 = tensors["w13_weight_scale_2"]
    expected = {}
    if global_scale_mode == "fold" and bool((s2 == s2[:, :1]).all()):
        # With separate w1/w3 global scales the legacy fold is wrong (it used
        # w1's for both halves): only then do the w13 scales differ.
        names += ["w13_weight_scale", "w2_weight_scale"]
    elif global_scale_mode == "alpha" and bool((s2 == s2[:, :1]).all()):
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
        if not same_bytes(getattr(layer, name).data, want):
            raise RuntimeError(
                f"layer {layer_idx}: the bounded preparation ({global_scale_mode}) "
                f"differs from the reference in {name}"
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


class _PhaseClock:
    """``with clock("timed"): ...`` adds the block's wall time to
    ``phases["timed"]``."""

    def __init__(self, phases: dict[str, float]):
        self.phases = phases

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[phase] += time.perf_counter() - start


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
    precision: str = "sample",
) -> dict:
    """Prepare ``num_layers`` layers of ``preset``, legacy and bounded.

    ``shard`` is the part of each layer this process prepares (default: all
    of it); ``before_layer()``, if given, runs before each layer (the ranks
    of a parallel job meet there, so they prepare at the same moment).

    The bounded preparation runs with ``global_scale_mode`` ("alpha", the
    default, or upstream's "fold"). Unless ``precision`` is "off", the first
    layer is also prepared in the other mode, and both are compared with the
    checkpoint's weights (:func:`prepared_weight_precision`: a stated
    "sample" of experts and rows, or "full").

    Steps that do not apply to the layer (the reorder of non-gated experts)
    are run, as the preparation does, but not reported: their figures are
    None ("-" in the report). ``phase_times_s`` says where the run's time
    went: the timed steps ("timed": the sum of the summary's totals, legacy
    plus bounded), copying each layer in for them ("copy_in"), metering,
    checks, the precision report, making or loading the weights.

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
    layers = check_num_layers(preset, num_layers)
    phases = dict.fromkeys(JOB_PHASES, 0.0)
    clock = _PhaseClock(phases)
    per_layer: list[dict] = []
    timelines: dict[str, list[dict]] = {}
    if precision not in PRECISION_CHOICES:
        raise ValueError(
            f"--precision must be one of {PRECISION_CHOICES}, got {precision!r}"
        )
    precision_how = precision
    report: dict[str, dict] = {}  # the precision report, per mode
    resident = None
    shapes = None
    synthetic = None  # a preset's layers share one shape: one set, reused
    metered_shapes: set[tuple] = set()
    # The meter's first start imports the profiler's dependencies (seconds
    # on CPU); pay for it here, not in a layer's measurement.
    with measure_peak_memory(device):
        pass

    def _layer_rows(idx: int, tensors: dict) -> dict[str, list[StepRecord]]:
        """Time, check, report the precision of and meter one layer."""
        nonlocal resident, shapes, report
        resident = _resident_bytes(tensors.values())
        shapes = {k: list(v.shape) for k, v in tensors.items()}
        # Allocations depend on shapes and the cap only: each distinct shape
        # is metered once. Each distinct layer (every checkpoint layer, the
        # first synthetic one) is checked byte for byte.
        shape_key = tuple((k, tuple(v)) for k, v in shapes.items())
        meter = shape_key not in metered_shapes
        check = layer_tensors is not None or idx == 0
        decode = precision_how != "off" and idx == 0
        with limit_cuda_memory(device, memory_limit):
            # Timed runs, then the accuracy check, then metered runs. The
            # steps' own time is the table's; copying the layer in is apart.
            copy_in = functools.partial(clock, "copy_in")
            legacy_timed, legacy_out = _legacy_run(
                tensors, preset.is_gated, device, False, copy_in
            )
            bounded_timed, layer = _bounded_run(
                preset,
                shard,
                tensors,
                device,
                max_transient_bytes,
                False,
                global_scale_mode,
                copy_in,
            )
            ok = not any(r.error for r in legacy_timed + bounded_timed)
            with clock("check"):
                if ok and check:
                    check_equal(layer, legacy_out, tensors, idx, global_scale_mode)
                del legacy_out
            with clock("precision"):
                if ok and decode:
                    report[global_scale_mode] = prepared_weight_precision(
                        layer, tensors, precision_how
                    )
                # Dropped before the other mode's copy is prepared: the
                # tensors and one layer are alive at a time (DeepSeek-V3:
                # 6 GiB each).
                del layer
                if ok and decode:
                    other = "fold" if global_scale_mode == "alpha" else "alpha"
                    _, other_layer = _bounded_run(
                        preset,
                        shard,
                        tensors,
                        device,
                        max_transient_bytes,
                        False,
                        other,
                    )
                    report[other] = prepared_weight_precision(
                        other_layer, tensors, precision_how
                    )
                    del other_layer
                    report = {m: report[m] for m in ("alpha", "fold")}
            legacy_mem = bounded_mem = []
            if meter:
                metered_shapes.add(shape_key)
                with clock("metered"):
                    legacy_mem, _ = _legacy_run(tensors, preset.is_gated, device, True)
                    bounded_mem, _ = _bounded_run(
                        preset,
                        shard,
                        tensors,
                        device,
                        max_transient_bytes,
                        True,
                        global_scale_mode,
                    )
        row = {
            "legacy": _merge(legacy_timed, legacy_mem),
            "bounded": _merge(bounded_timed, bounded_mem),
        }
        if not preset.is_gated:
            # Non-gated experts have no halves to swap: the reorder step runs
            # (and records itself) but does not apply.
            row = {
                v: [r for r in recs if r.step != "reorder"] for v, recs in row.items()
            }
        return row

    # A context manager: an exception (Ctrl-C) closes the bar, so what is
    # printed next starts on a line of its own.
    with tqdm(
        range(layers), desc=preset.name, unit="layer", disable=not progress
    ) as bar:
        for idx in bar:
            if before_layer is not None:
                before_layer()
            with clock("weights"):
                if layer_tensors is None:
                    if synthetic is None:
                        synthetic = synthetic_layer_tensors(
                            preset, shard.tp_size, device, seed, local_experts
                        )
                    tensors = synthetic
                else:
                    tensors = layer_tensors(idx)
            row = _layer_rows(idx, tensors)
            per_layer.append(row)
            if idx == 0:
                timelines = {
                    v: [
                        {
                            "step": r.step,
                            "timeline": r.timeline,
                            "time_s": r.time_s,
                            "growth_bytes": r.growth_bytes,
                            "peak_bytes": r.peak_bytes,
                        }
                        for r in row[v]
                    ]
                    for v in VARIANTS
                }
            del tensors

    summary = {}
    for v in VARIANTS:
        layer_sums = [_summarize(row[v]) for row in per_layer]
        summary[v] = {}
        for step in REPORTED_STEPS:
            times = [s[step]["time_s"] for s in layer_sums if s[step]["time_s"]]
            trans = [
                s[step]["transient_bytes"]
                for s in layer_sums
                if s[step]["transient_bytes"] is not None
            ]
            errors = [s[step]["error"] for s in layer_sums if s[step]["error"]]
            summary[v][step] = {
                "total_time_s": sum(times) if times else None,
                "median_time_per_layer_s": statistics.median(times) if times else None,
                "max_transient_bytes": max(trans) if trans else None,
                "errors": errors,
            }
    # What the table shows, so the job's summary and the table add up.
    phases["timed"] = sum(summary[v]["total"]["total_time_s"] or 0.0 for v in VARIANTS)
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
        "precision": report,
        "precision_how": precision_how,
        "phase_times_s": phases,
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
