# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small pieces of the main job's report: block-scale range counts and how
a speed ratio is said."""

import pytest
import torch

from vllm.benchmarks.moe_weight_prep.precision import blockscale_range_counts
from vllm.benchmarks.moe_weight_prep.report import format_speedup


def test_blockscale_range_counts_on_hand_made_bytes():
    # 0x00 / 0x80: +-0; 0x01..0x07 / 0x81..0x87: subnormal; 0x08: 2^-6, the
    # smallest normal; 0x7E / 0xFE: +-448; 0x7F: NaN (none of the three).
    raw = [0x00, 0x80, 0x01, 0x07, 0x87, 0x08, 0x7E, 0xFE, 0x7E, 0x7F, 0x40]
    scale = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e4m3fn)
    counts = blockscale_range_counts(scale.view(1, 1, -1))
    assert counts == {"total": 11, "subnormal": 3, "saturated": 3, "zero": 2}


@pytest.mark.parametrize(
    "baseline, new, text",
    [
        (2.9, 1.0, "2.9x faster"),
        (1.0, 2.1, "2.1x slower"),
        (1.0, 1.03, "as fast"),
        (1.0, None, ""),
        (0.0, 1.0, ""),
    ],
)
def test_speed_ratios_are_said_as_faster_or_slower(baseline, new, text):
    assert format_speedup(baseline, new) == text


def test_plot_has_a_legend_units_and_one_colour_per_step():
    import matplotlib.colors as mcolors

    from vllm.benchmarks.moe_weight_prep.plot import STEP_COLOURS, plot_figure

    result = _result()
    bounded = result["first_layer_timelines"]["bounded"]
    bounded.insert(1, _rec("fold", 0.0, []))
    bounded.append(_rec("finalize", 0.0, []))
    fig = plot_figure(result)
    legend = fig.legends[0]
    labels = [t.get_text() for t in legend.get_texts()]
    # Every step once, in the table's order, and the cap.
    assert labels == [
        "validate",
        "fold",
        "reorder",
        "swizzle",
        "finalize",
        "bounded cap",
    ]
    for ax in fig.axes:
        assert ax.get_xlabel() == "time (ms)"
        assert "MiB" in fig.axes[0].get_ylabel()
    # Each panel draws its steps in order, each in its step's colour.
    for ax, variant in zip(fig.axes, ("legacy", "bounded"), strict=True):
        steps = [r["step"] for r in result["first_layer_timelines"][variant]]
        colours = [line.get_color() for line in ax.get_lines()][: len(steps)]
        want = [STEP_COLOURS[s] for s in steps]
        assert [mcolors.to_hex(c) for c in colours] == [mcolors.to_hex(c) for c in want]


def _rec(step, seconds, levels, growth=0):
    return {
        "step": step,
        "time_s": seconds,
        "growth_bytes": growth,
        "timeline": list(enumerate(levels)),
        "peak_bytes": max(levels, default=0),
    }


def _result(**extra):
    """A report's result: the legacy steps and the bounded ones (validate,
    reorder, swizzle) of one layer, under a 64 MiB cap."""
    mib = 1 << 20
    return {
        "model": "m",
        "device": "cpu",
        "max_transient_bytes": 64 * mib,
        "first_layer_timelines": {
            "legacy": [
                _rec("reorder", 0.09, [288 * mib, 0]),
                _rec("swizzle", 0.08, [64 * mib, 0]),
                _rec("fold", 0.27, [288 * mib, 0]),
            ],
            "bounded": [
                _rec("validate", 0.003, []),
                _rec("reorder", 0.02, [2 * mib, 0]),
                _rec("swizzle", 0.01, [2 * mib, 0]),
            ],
        },
        **extra,
    }


def test_plot_panels_have_their_own_scale_and_draw_the_memory_limit():
    from vllm.benchmarks.moe_weight_prep.plot import plot_figure

    fig = plot_figure(_result(memory_limit_bytes=100 << 20))
    legacy, bounded = fig.axes
    # Each panel scaled to its own trace: the bounded one (2 MiB) is readable
    # next to the legacy one (288 MiB), not a line along the bottom.
    assert 288 < legacy.get_ylim()[1] < 400
    assert 2 < bounded.get_ylim()[1] < 3
    # The cap and the limit: drawn where they fall within the panel ...
    lines = {line.get_label(): line.get_ydata()[0] for line in legacy.get_lines()}
    assert lines["bounded cap"] == 64 and lines["--memory-limit"] == 100
    # ... else named, with their value, in the panel's corner.
    texts = " ".join(t.get_text() for t in bounded.texts)
    assert "bounded cap 64.0 MiB: above this scale" in texts
    assert "--memory-limit 100.0 MiB: above this scale" in texts
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[-2:] == ["bounded cap", "--memory-limit"]
    # Control: without --memory-limit there is no such line or label.
    fig = plot_figure(_result())
    assert "--memory-limit" not in [t.get_text() for t in fig.legends[0].get_texts()]
    assert "--memory-limit" not in [x.get_label() for x in fig.axes[0].get_lines()]


def test_plot_of_a_parallel_run_names_its_rank():
    from vllm.benchmarks.moe_weight_prep.plot import plot_figure

    fig = plot_figure(_result(tp_size=2, ep_size=1, rank=0, shard="TP 0/2"))
    assert "rank 0 of 2 (TP 0/2" in fig._suptitle.get_text()
    fig = plot_figure(_result(tp_size=1, ep_size=1, rank=0, shard="TP 0/1"))
    assert "rank" not in fig._suptitle.get_text()
