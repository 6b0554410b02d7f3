# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The W4A4 b12x preparation's steps one at a time at the Qwen3.6-35B-A3B
layer (slow): the fork's bounded reorder, swizzle and fold against
unmodified 0.33.0's, on the same synthetic tensors (prep_steps.py): the
same bytes (sha256), the fork within 2 MiB, unmodified 0.33.0's peak
measured by the same meter (its whole-tensor copies: tens to hundreds of
MiB), and each step's time (one run, recorded, not asserted). The figures
of docs/pr/'s first two pull requests."""

import pytest

from prep_steps import prep_step_reports
from upstream_env import UPSTREAM_VERSION
from upstream_layers import QWEN36_35B_A3B

MIB = 1 << 20
#: The fork's bound on a step's peak transient (one bounce buffer of
#: 2 MiB - 64 KiB on CPU, plus the fold's small tables).
FORK_PEAK_BOUND = 2 * MIB
#: The smallest of unmodified 0.33.0's whole-tensor copies at this shape is
#: the padded copy of w2's 16 MiB of block scales: a floor saying the
#: control measures a copy at all.
UNMODIFIED_PEAK_FLOOR = 16 * MIB

_SNIPPET = """\
from prep_steps import prep_step_reports
from upstream_layers import QWEN36_35B_A3B
result = prep_step_reports(QWEN36_35B_A3B)
"""


@pytest.mark.slow
def test_qwen36_preparation_steps_bytes_and_peaks(
    unmodified_upstream, upstream_measurements
):
    fork = prep_step_reports(QWEN36_35B_A3B)
    unmodified = unmodified_upstream(_SNIPPET)
    assert set(fork) == set(unmodified)
    shape = QWEN36_35B_A3B
    for step, ours in fork.items():
        theirs = unmodified[step]
        upstream_measurements(
            f"{step}, {shape.name} layer ({shape.id}), peak transient and time: "
            f"fork / unmodified {UPSTREAM_VERSION}",
            f"{ours['peak_bytes'] / MIB:.2f} / {theirs['peak_bytes'] / MIB:.2f} MiB, "
            f"{ours['seconds']:.3f} / {theirs['seconds']:.3f} s, "
            + ("same bytes" if ours["digest"] == theirs["digest"] else "BYTES DIFFER"),
        )
    for step, ours in fork.items():
        theirs = unmodified[step]
        assert ours["digest"] == theirs["digest"], step
        assert ours["peak_bytes"] <= FORK_PEAK_BOUND, step
        assert theirs["peak_bytes"] >= UNMODIFIED_PEAK_FLOOR, step
