# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job's text report: the tables of one rank's result, of the ranks
of ``--tp N``, of a W4A16 result, and where the job's time went."""

from __future__ import annotations

__all__ = [
    "JOB_PHASES",
    "MIB",
    "REPORTED_STEPS",
    "VARIANTS",
    "W4A16_VARIANTS",
    "format_job_time",
    "format_mib",
    "format_ranks",
    "format_report",
    "format_secs",
    "format_speedup",
    "format_w4a16_report",
]

MIB = 1 << 20
#: Steps reported per variant; "total" is the whole preparation.
#: Steps in the bounded preparation's order (the legacy one runs reorder,
#: swizzle, fold), then the sum; the plot uses the same names.
REPORTED_STEPS = ("validate", "fold", "reorder", "swizzle", "finalize", "total")
VARIANTS = ("legacy", "bounded")
#: Variant -> what it is (the report's labels).
W4A16_VARIANTS = {
    "flashinfer-public-model": "FlashInfer's public path as memory: a full packed "
    "copy kept, made with this package's reference (not timed)",
    "flashinfer-public": "FlashInfer 0.7.4 public (reuse_input_storage=False)",
    "flashinfer-inplace": "FlashInfer 0.7.4 in place (reuse_input_storage=True)",
    "bounded": "this tree, bounded in place",
}
#: Phases of the job whose time the run records (``phase_times_s``).
#: "timed" is the step table's time (its totals, legacy plus bounded);
#: "copy_in" what each timed preparation needs first and the table leaves
#: out: the legacy run's clone of the layer, the bounded run's new FusedMoE
#: with the layer copied into its parameters.
JOB_PHASES = {
    "timed": "preparing (the step table's time, legacy and bounded)",
    "copy_in": "copying each layer in (a clone for legacy, a new layer for "
    "bounded; not in the table)",
    "metered": "metering",
    "check": "byte checks",
    "precision": "precision report",
    "weights": "making or loading the weights",
}


def format_speedup(baseline_s: float | None, new_s: float | None) -> str:
    """``new`` against ``baseline`` as a reader says it: "2.9x faster",
    "2.1x slower", "as fast" (within 5%); "" when either is missing."""
    if not baseline_s or not new_s:
        return ""
    ratio = baseline_s / new_s
    if abs(ratio - 1) < 0.05:
        return "as fast"
    if ratio > 1:
        return f"{ratio:.1f}x faster"
    return f"{1 / ratio:.1f}x slower"


def format_mib(n: float | None) -> str:
    """``n`` bytes as "1,234.5 MiB"; "-" for None."""
    return "-" if n is None else f"{n / MIB:,.1f} MiB"


def format_secs(t: float | None, digits: int = 3) -> str:
    """``t`` seconds as "1.234 s" (``digits`` decimals); "-" for None."""
    return "-" if t is None else f"{t:.{digits}f} s"


def _layers(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def format_report(result: dict) -> str:
    """The human-readable table for one :func:`run_benchmark` result."""
    s = result["summary"]
    lines = [
        f"model {result['model']} ({result['hf_id']}, {result['source']} weights), "
        f"device {result['device']}, "
        + (
            f"rank {result['rank']} ({result['shard']}), "
            if result["tp_size"] * result["ep_size"] > 1
            else ""
        )
        + f"{_layers(result['num_layers'], 'MoE layer')}, "
        f"activation {result['activation']}"
        + (f", {n} busy core(s)" if (n := result.get("busy_cores")) else ""),
        f"per layer: w13 {result['shapes']['w13_weight']} + w2 "
        f"{result['shapes']['w2_weight']} with scales, resident "
        f"{format_mib(result['resident_bytes_per_layer'])}; bounded cap "
        f"{format_mib(result['max_transient_bytes'])}",
        "",
        f"{'step':<9}{'legacy peak':>14}{'bounded peak':>15}"
        f"{'legacy time':>14}{'bounded time':>15}",
    ]
    for step in REPORTED_STEPS:
        leg, bnd = s["legacy"][step], s["bounded"][step]
        lines.append(
            f"{step:<9}{format_mib(leg['max_transient_bytes']):>14}"
            f"{format_mib(bnd['max_transient_bytes']):>15}"
            f"{format_secs(leg['total_time_s']):>14}{format_secs(bnd['total_time_s']):>15}"
        )
    total_bytes = result["num_layers"] * result["resident_bytes_per_layer"]
    lt, bt = s["legacy"]["total"]["total_time_s"], s["bounded"]["total"]["total_time_s"]
    lines += [
        "(peak: the most free memory one layer's step needs above the resident "
        "weights, metered on the first layer of each shape; time: summed over "
        "layers; -: the variant has no such step)",
        "",
        f"totals: {_layers(result['num_layers'], 'layer')}, "
        f"{format_mib(total_bytes)} of expert "
        f"weights prepared; time legacy {format_secs(lt)}, bounded {format_secs(bt)}"
        + (f" (bounded {format_speedup(lt, bt)})" if lt and bt else ""),
        "free memory needed above the resident weights: legacy "
        f"{format_mib(s['legacy']['total']['max_transient_bytes'])}, bounded "
        f"{format_mib(s['bounded']['total']['max_transient_bytes'])}",
    ]
    if result["precision"]:
        lines += ["", _precision_table(result)]
    if result["memory_limit_bytes"] is not None:
        how = (
            "enforced with torch.cuda.set_per_process_memory_fraction"
            if result["memory_limit_enforced"]
            else "checked against the meter"
        )
        verdict = ", ".join(
            f"{v} {'fits' if ok else 'EXCEEDS'}"
            + (f" ({s[v]['total']['errors'][0]})" if s[v]["total"]["errors"] else "")
            for v, ok in result["memory_limit_ok"].items()
        )
        lines.append(
            f"memory limit {format_mib(result['memory_limit_bytes'])} above the "
            f"resident weights ({how}): {verdict}"
        )
    return "\n".join(lines)


def _precision_table(result: dict) -> str:
    p = result["precision"]
    first = p[result["global_scale_mode"]]
    how = first["sample"]["how"]
    lines = [
        "precision of the prepared weights vs the checkpoint (first layer; "
        f"--precision {how}: decoded {first['described']}; block scales of all "
        f"experts; running mode {result['global_scale_mode']!r}):",
        f"{'mode':<7}{'rel. RMS':>10}{'subnormal':>12}{'saturated':>11}"
        f"{'zero':>9}   (block scales of w13 + w2; checkpoint: "
        + ", ".join(
            f"{k} {sum(first[t + '_checkpoint'][k] for t in ('w13', 'w2')):,}"
            for k in ("subnormal", "saturated", "zero")
        )
        + ")",
    ]
    for mode in ("alpha", "fold"):
        q = p[mode]
        counts = {
            k: sum(q[t][k] for t in ("w13", "w2"))
            for k in ("total", "subnormal", "saturated", "zero")
        }
        lines.append(
            f"{mode:<7}{q['rel_rms']:>10.4f}"
            f"{100 * counts['subnormal'] / counts['total']:>11.1f}%"
            f"{100 * counts['saturated'] / counts['total']:>10.2f}%"
            f"{100 * counts['zero'] / counts['total']:>8.2f}%"
            + ("   exact" if q["rel_rms"] == 0 else "")
        )
    return "\n".join(lines)


def format_job_time(phases: dict[str, float], wall_s: float) -> str:
    """Where the job's wall time went: ``phases`` maps a phase (as named in
    :data:`JOB_PHASES`) to its seconds (rank 0's in a parallel run); the
    rest is setup (starting the meter, processes, reading the config) and
    the bookkeeping between timed steps. "preparing" is the sum of the step
    table's totals, so the two add up."""
    if wall_s <= 0:
        return ""
    parts = [
        f"{JOB_PHASES[name]} {secs:.1f} s ({100 * secs / wall_s:.0f}%)"
        for name, secs in phases.items()
    ]
    rest = wall_s - sum(phases.values())
    return (
        f"job: {wall_s:.1f} s wall: " + ", ".join(parts) + f", the rest {rest:.1f} s "
        "(setup: the meter's first start, processes, the checkpoint's index; "
        "between the timed steps)"
    )


def format_ranks(results: list[dict]) -> str:
    """One line per rank of a parallel run (its shard, resident bytes per
    layer, peaks and summed times of both variants) and their maximum."""

    def row(label, shard, resident, lp, bp, lt, bt):
        return (
            f"{label:<6}{shard:<10}{format_mib(resident):>15}{format_mib(lp):>13}"
            f"{format_mib(bp):>14}{format_secs(lt):>13}{format_secs(bt):>14}"
        )

    lines = [
        f"per rank: {len(results)} processes, each preparing its own shard of "
        "every layer, all at once",
        f"{'rank':<6}{'shard':<10}{'resident/layer':>15}{'legacy peak':>13}"
        f"{'bounded peak':>14}{'legacy time':>13}{'bounded time':>14}",
    ]
    cols = []
    for r in results:
        s = r["summary"]
        vals = (
            r["resident_bytes_per_layer"],
            s["legacy"]["total"]["max_transient_bytes"],
            s["bounded"]["total"]["max_transient_bytes"],
            s["legacy"]["total"]["total_time_s"],
            s["bounded"]["total"]["total_time_s"],
        )
        cols.append(vals)
        lines.append(row(str(r["rank"]), r["shard"], *vals))
    maxima = [
        max((v for v in col if v is not None), default=None)
        for col in zip(*cols, strict=True)
    ]
    lines.append(row("max", "", *maxima))
    return "\n".join(lines)


def format_w4a16_report(result: dict) -> str:
    """The table of one :func:`run_w4a16_benchmark` result."""
    n = result["num_layers"]
    lines = [
        f"W4A16 (weight-only NVFP4) preparation for b12x: model {result['model']} "
        f"({result['hf_id']}, {result['source']} weights), device "
        f"{result['device']}, {n} MoE layer{'s' * (n != 1)}, activation "
        f"{result['activation']}"
        + (f", {b} busy core(s)" if (b := result.get("busy_cores")) else ""),
        f"per layer: resident {format_mib(result['resident_bytes_per_layer'])} of "
        f"weights and scales; bounded cap {format_mib(result['max_transient_bytes'])}",
        "",
        f"{'variant':<25}{'peak/layer':>12}{'kept/layer':>12}{'time/layer':>12}"
        f"{'model peak':>13}{'model kept':>13}{'model time':>12}",
    ]
    for name, s in result["summary"].items():
        lines.append(
            f"{name:<25}{format_mib(s['peak_per_layer_bytes']):>12}"
            f"{format_mib(s['kept_per_layer_bytes']):>12}"
            f"{format_secs(s['median_time_per_layer_s'], 3):>12}"
            f"{format_mib(s['model_peak_bytes']):>13}{format_mib(s['model_kept_bytes']):>13}"
            f"{format_secs(s['model_time_s'], 2):>12}"
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
            f"memory limit {format_mib(result['memory_limit_bytes'])} above the "
            f"resident weights (checked against the meter): bounded {verdict}"
        )
    return "\n".join(lines)
