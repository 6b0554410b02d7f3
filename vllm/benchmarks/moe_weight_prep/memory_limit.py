# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A cap on the device memory a CUDA process may take above what it holds."""

from __future__ import annotations

import torch

__all__ = [
    "cuda_memory_fraction",
    "limit_cuda_memory",
]


def cuda_memory_fraction(limit: int, reserved: int, total: int) -> float:
    """The ``set_per_process_memory_fraction`` that lets a process holding
    ``reserved`` bytes of a ``total``-byte device take ``limit`` more.

    The caching allocator enforces the fraction on its reserved bytes (the
    segments it holds), not on the allocated bytes the meter reports, so the
    limit counts from ``reserved``."""
    return min(1.0, (reserved + limit) / total)


class limit_cuda_memory:
    """On CUDA, let this process take at most ``limit`` bytes of device
    memory above what it holds at entry (after releasing its cached free
    blocks); the allocator raises ``torch.OutOfMemoryError`` beyond that.
    A no-op elsewhere or without a limit; the fraction is reset on exit."""

    def __init__(self, device: torch.device, limit: int | None):
        self.device, self.limit = device, limit

    def __enter__(self):
        if self.limit is None or self.device.type != "cuda":
            return self
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        reserved = torch.cuda.memory_reserved(self.device)
        torch.cuda.set_per_process_memory_fraction(
            cuda_memory_fraction(self.limit, reserved, total), self.device
        )
        return self

    def __exit__(self, *exc):
        if self.limit is not None and self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        return False
