# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cap on the memory a CUDA process may allocate above what it holds."""

from __future__ import annotations

import torch

__all__ = [
    "limit_cuda_memory",
]


class limit_cuda_memory:
    """On CUDA, cap this process's allocations at the resident memory plus
    ``limit`` bytes (``torch.cuda.set_per_process_memory_fraction``)."""

    def __init__(self, device: torch.device, limit: int | None):
        self.device, self.limit = device, limit

    def __enter__(self):
        if self.limit is None or self.device.type != "cuda":
            return self
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        allowed = torch.cuda.memory_allocated(self.device) + self.limit
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, allowed / total), self.device
        )
        return self

    def __exit__(self, *exc):
        if self.limit is not None and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        return False
