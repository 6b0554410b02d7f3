# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``--memory-limit`` on CUDA: the allocator enforces it on reserved bytes, so
the fraction starts from what the process holds (reserved), and it is
applied for real. The arithmetic on CPU (CUDA's calls recorded); the
enforcement where CUDA exists."""

import pytest
import torch

from vllm.benchmarks.moe_weight_prep.memory_limit import (
    cuda_memory_fraction,
    limit_cuda_memory,
)

MIB = 1 << 20


def test_fraction_starts_from_the_reserved_bytes():
    assert cuda_memory_fraction(5 * MIB, 10 * MIB, 100 * MIB) == 0.15
    assert cuda_memory_fraction(500 * MIB, 10 * MIB, 100 * MIB) == 1.0


def test_limit_is_applied_from_reserved_and_reset(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    props = type("Props", (), {"total_memory": 100 * MIB})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    # Allocated 8 MiB, reserved 10 MiB (cached free blocks, segment rounding).
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 8 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 10 * MIB)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append(f)
    )
    cuda = torch.device("cuda", 0)
    with limit_cuda_memory(cuda, 5 * MIB):
        assert calls == ["empty", 0.15]  # (10 + 5) / 100, not (8 + 5) / 100
    assert calls[-1] == 1.0
    calls.clear()
    for device, limit in ((cuda, None), (torch.device("cpu"), 5 * MIB)):
        with limit_cuda_memory(device, limit):
            pass
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_limit_is_enforced():
    device = torch.device("cuda")
    held = torch.empty(8 * MIB, dtype=torch.uint8, device=device)
    with limit_cuda_memory(device, 64 * MIB):
        ok = torch.empty(32 * MIB, dtype=torch.uint8, device=device)
        del ok
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(128 * MIB, dtype=torch.uint8, device=device)
    # Reset on exit: the same request succeeds.
    big = torch.empty(128 * MIB, dtype=torch.uint8, device=device)
    del big, held
