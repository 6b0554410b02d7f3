# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's definitions in vLLM's tests/kernels/moe/utils.py."""

import torch
from torch.profiler import ProfilerActivity, profile


def peak_memory_bytes(fn, device: str) -> int:
    """Bytes allocated on ``device`` above the start while ``fn`` runs (CPU:
    torch's allocation events, each counted when its op starts)."""
    if device != "cpu":
        torch.accelerator.synchronize()
        start = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        fn()
        torch.accelerator.synchronize()
        return torch.accelerator.max_memory_allocated() - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    level = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        level += event.self_cpu_memory_usage
        peak = max(peak, level)
    return peak
