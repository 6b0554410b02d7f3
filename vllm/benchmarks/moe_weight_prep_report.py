# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job's report: the text table and the memory plot of one result
of :func:`vllm.benchmarks.moe_weight_prep.run_benchmark`."""

from __future__ import annotations

__all__ = [
    "format_speedup",
    "REPORTED_STEPS",
    "VARIANTS",
    "format_mib",
    "format_report",
    "write_plot",
]

MIB = 1 << 20
#: Steps reported per variant; "total" is the whole preparation.
REPORTED_STEPS = ("reorder", "swizzle", "fold", "total")
VARIANTS = ("legacy", "bounded")


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


def format_report(result: dict) -> str:
    """The human-readable table for one :func:`run_benchmark` result."""
    s = result["summary"]
    lines = [
        f"model {result['model']} ({result['hf_id']}, {result['source']} weights), "
        f"device {result['device']}, "
        f"TP {result['tp_size']}, {result['num_layers']} MoE layers, "
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
        "weights; time: summed over layers)",
        "",
        f"totals: {result['num_layers']} layers, {format_mib(total_bytes)} of expert "
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
    experts = p["alpha"]["experts"]
    lines = [
        f"precision of the prepared weights vs the checkpoint (first layer; decoded "
        f"experts {experts}; block scales of all experts; running mode "
        f"{result['global_scale_mode']!r}):",
        f"{'mode':<7}{'rel. RMS':>10}{'subnormal':>12}{'saturated':>11}"
        f"{'zero':>9}   (block scales of w13 + w2; checkpoint: "
        + ", ".join(
            f"{k} {sum(p['alpha'][t + '_checkpoint'][k] for t in ('w13', 'w2')):,}"
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
        )
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> None:
    """PNG of the first layer's memory over the preparation steps, legacy and
    bounded side by side (MiB allocated above the resident weights)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, variant in zip(axes, VARIANTS, strict=True):
        x0, base = 0.0, 0.0
        for rec in result["first_layer_timelines"][variant]:
            xs, ys = [x0], [base]
            levels = [lvl for _, lvl in rec["timeline"]]
            if not levels and rec["peak_bytes"] is not None:
                levels = [rec["peak_bytes"], rec["growth_bytes"]]  # CUDA: no timeline
            for j, lvl in enumerate(levels):
                xs.append(x0 + (j + 1) / (len(levels) + 1))
                ys.append(base + lvl / MIB)
            base += rec["growth_bytes"] / MIB
            xs.append(x0 + 1)
            ys.append(base)
            ax.step(xs, ys, where="post")
            x0 += 1
        ax.axhline(result["max_transient_bytes"] / MIB, color="grey", ls="--", lw=0.8)
        steps = [rec["step"] for rec in result["first_layer_timelines"][variant]]
        ax.set_xticks([i + 0.5 for i in range(len(steps))], steps, fontsize=8)
        ax.set_title(variant)
    axes[0].set_ylabel("MiB allocated above the resident weights")
    fig.suptitle(
        f"{result['model']}: one MoE layer's weight preparation on "
        f"{result['device']} (dashed: bounded cap)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
