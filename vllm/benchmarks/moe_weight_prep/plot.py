# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The main job's memory plot: the first layer's preparation, legacy and
bounded, from one result of
:func:`vllm.benchmarks.moe_weight_prep.w4a4_layers.run_benchmark`."""

from __future__ import annotations

import os

from vllm.benchmarks.moe_weight_prep.report import MIB, REPORTED_STEPS, VARIANTS

__all__ = [
    "STEP_COLOURS",
    "plot_figure",
    "write_plot",
]

#: Each reported step's colour in the plot.
STEP_COLOURS = {
    "validate": "tab:gray",
    "fold": "tab:red",
    "reorder": "tab:blue",
    "swizzle": "tab:green",
    "finalize": "tab:purple",
}


def write_plot(result: dict, path: str) -> None:
    """Write :func:`plot_figure` of ``result`` to ``path`` (format by its
    extension; :func:`vllm.benchmarks.moe_weight_prep.output_files.check_output_path`
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
            ax.text(
                0.99,
                0.97,
                "\n".join(off_scale),
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
            )
        ax.set_ylim(0, top * 1.15)
        ax.set_xlim(0, x0)
        ax.set_xlabel("time (ms)")
        ax.set_ylabel("MiB allocated above the resident weights")
        ax.set_title(
            f"{variant}: " + " -> ".join(r["step"] for r in records), fontsize=9
        )
    present = {r["step"] for v in VARIANTS for r in timelines[v]}
    handles = [
        Patch(color=STEP_COLOURS[s], alpha=0.6, label=s)
        for s in REPORTED_STEPS
        if s in present
    ]
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
