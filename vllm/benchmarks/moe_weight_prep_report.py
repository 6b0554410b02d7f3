# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job's report: the text table and the memory plot of one result
of :func:`vllm.benchmarks.moe_weight_prep_run.run_benchmark`."""

from __future__ import annotations

import os

__all__ = [
    "JOB_PHASES",
    "STEP_COLOURS",
    "format_job_time",
    "format_speedup",
    "plot_figure",
    "REPORTED_STEPS",
    "VARIANTS",
    "format_mib",
    "format_ranks",
    "format_report",
    "write_plot",
]

MIB = 1 << 20
#: Steps reported per variant; "total" is the whole preparation.
#: Steps in the bounded preparation's order (the legacy one runs reorder,
#: swizzle, fold), then the sum; the plot uses the same names and colours.
REPORTED_STEPS = ("validate", "fold", "reorder", "swizzle", "finalize", "total")
STEP_COLOURS = {
    "validate": "tab:gray",
    "fold": "tab:red",
    "reorder": "tab:blue",
    "swizzle": "tab:green",
    "finalize": "tab:purple",
}
VARIANTS = ("legacy", "bounded")
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
    return "-" if n is None else f"{n / MIB:,.1f} MiB"


def _secs(n: float | None) -> str:
    return "-" if n is None else f"{n:.3f} s"


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
            f"{_secs(leg['total_time_s']):>14}{_secs(bnd['total_time_s']):>15}"
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
        f"weights prepared; time legacy {_secs(lt)}, bounded {_secs(bt)}"
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
        return (f"{label:<6}{shard:<10}{format_mib(resident):>15}{format_mib(lp):>13}"
                f"{format_mib(bp):>14}{_secs(lt):>13}{_secs(bt):>14}")  # fmt: skip

    lines = [
        f"per rank: {len(results)} processes, each preparing its own shard of "
        "every layer, all at once",
        f"{'rank':<6}{'shard':<10}{'resident/layer':>15}{'legacy peak':>13}"
        f"{'bounded peak':>14}{'legacy time':>13}{'bounded time':>14}",
    ]
    cols = []
    for r in results:
        s = r["summary"]
        vals = (r["resident_bytes_per_layer"],
                s["legacy"]["total"]["max_transient_bytes"],
                s["bounded"]["total"]["max_transient_bytes"],
                s["legacy"]["total"]["total_time_s"],
                s["bounded"]["total"]["total_time_s"])  # fmt: skip
        cols.append(vals)
        lines.append(row(str(r["rank"]), r["shard"], *vals))
    maxima = [max((v for v in col if v is not None), default=None)
              for col in zip(*cols, strict=True)]  # fmt: skip
    lines.append(row("max", "", *maxima))
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    """Write :func:`plot_figure` of ``result`` to ``path`` (format by its
    extension; :func:`vllm.benchmarks.output_files.check_output_path`
    checks it before the run)."""
    fig = plot_figure(result)  # selects the Agg backend first
    import matplotlib.pyplot as plt

    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    try:
        fig.savefig(path, dpi=110, format=fmt)
    finally:
        plt.close(fig)


def _reference_lines(result: dict) -> list[tuple[float, str, str]]:
    """(MiB, label, line style) of the horizontal lines a panel may draw."""
    lines = [(result["max_transient_bytes"] / MIB, "bounded cap", "--")]
    if result.get("memory_limit_bytes") is not None:
        lines.append((result["memory_limit_bytes"] / MIB, "--memory-limit", ":"))
    return lines


def plot_figure(result: dict):
    """The first layer's preparation, legacy and bounded side by side:
    MiB allocated above the resident weights against time (ms). Each step
    spans its duration in the timed run, coloured as in ``STEP_COLOURS``;
    the metered allocation levels are spread over it in the order they
    happened (the meter itself slows code down, so it gives no times).

    Each panel has its own scales (the bounded trace is a few MiB where the
    legacy one reaches hundreds). The cap and ``--memory-limit`` are drawn
    where they fall within a panel's range (up to 3x its highest level),
    else named in its corner with their value. A parallel run's plot is of
    one rank's result: the title says which."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    timelines = result["first_layer_timelines"]
    references = _reference_lines(result)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    for ax, variant in zip(axes, VARIANTS, strict=True):
        records = timelines[variant]
        total_ms = sum((r.get("time_s") or 0.0) for r in records) * 1e3
        min_width = max(total_ms, 1e-3) / 100  # a short step stays visible
        x0, base, top = 0.0, 0.0, 0.0
        for rec in records:
            width = max((rec.get("time_s") or 0.0) * 1e3, min_width)
            levels = [lvl for _, lvl in rec["timeline"]]
            if not levels and rec["peak_bytes"] is not None:
                levels = [rec["peak_bytes"], rec["growth_bytes"]]  # CUDA: no timeline
            xs, ys = [x0], [base]
            for j, lvl in enumerate(levels):
                xs.append(x0 + width * (j + 1) / (len(levels) + 1))
                ys.append(base + lvl / MIB)
            base += rec["growth_bytes"] / MIB
            xs.append(x0 + width)
            ys.append(base)
            top = max(top, *ys)
            colour = STEP_COLOURS.get(rec["step"], "black")
            ax.step(xs, ys, where="post", color=colour, lw=1.6)
            ax.fill_between(xs, ys, step="post", color=colour, alpha=0.2, lw=0)
            x0 += width
        top = max(top, 1e-3)
        off_scale = []
        for mib, label, style in references:
            if mib <= 3 * top:
                ax.axhline(mib, color="black", ls=style, lw=0.8, label=label)
                top = max(top, mib)
            else:
                off_scale.append(f"{label} {mib:,.1f} MiB: above this scale")
        if off_scale:
            ax.text(0.99, 0.97, "\n".join(off_scale), transform=ax.transAxes,
                    ha="right", va="top", fontsize=8)  # fmt: skip
        ax.set_ylim(0, top * 1.15)
        ax.set_xlim(0, x0)
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("MiB allocated above the resident weights")
        ax.set_title(f"{variant}: " + " -> ".join(r["step"] for r in records),
                     fontsize=9)  # fmt: skip
    present = {r["step"] for v in VARIANTS for r in timelines[v]}
    handles = [Patch(color=STEP_COLOURS[s], alpha=0.6, label=s)
               for s in REPORTED_STEPS if s in present]  # fmt: skip
    for _, label, style in references:
        handles.append(Line2D([], [], color="black", ls=style, lw=0.8, label=label))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    world = result.get("tp_size", 1) * result.get("ep_size", 1)
    rank = (
        f", rank {result['rank']} of {world} ({result['shard']}; the others in "
        "the JSON)"
        if world > 1
        else ""
    )
    fig.suptitle(
        f"{result['model']}: one MoE layer's weight preparation on "
        f"{result['device']}{rank} (each panel its own scale)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
