# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/quantizers loads with tests/vllm_loader's helpers (``cpu_loading``,
``preparation_peaks``, ``upstream_b12x_test``), which import each other by bare
name: that directory goes on ``sys.path`` (never the repository root, whose
``vllm/`` holds fragments)."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "vllm_loader"))
