# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Small pieces of the main job's report: block-scale range counts and how
a speed ratio is said."""

import pytest
import torch

from vllm.benchmarks.moe_prep_precision import blockscale_range_counts
from vllm.benchmarks.moe_weight_prep_report import format_speedup


def test_blockscale_range_counts_on_hand_made_bytes():
    # 0x00 / 0x80: +-0; 0x01..0x07 / 0x81..0x87: subnormal; 0x08: 2^-6, the
    # smallest normal; 0x7E / 0xFE: +-448; 0x7F: NaN (none of the three).
    raw = [0x00, 0x80, 0x01, 0x07, 0x87, 0x08, 0x7E, 0xFE, 0x7E, 0x7F, 0x40]
    scale = torch.tensor(raw, dtype=torch.uint8).view(torch.float8_e4m3fn)
    counts = blockscale_range_counts(scale.view(1, 1, -1))
    assert counts == {"total": 11, "subnormal": 3, "saturated": 3, "zero": 2}


@pytest.mark.parametrize(
    "baseline, new, text",
    [(2.9, 1.0, "2.9x faster"), (1.0, 2.1, "2.1x slower"), (1.0, 1.03, "as fast"),
     (1.0, None, ""), (0.0, 1.0, "")],
)  # fmt: skip
def test_speed_ratios_are_said_as_faster_or_slower(baseline, new, text):
    assert format_speedup(baseline, new) == text
