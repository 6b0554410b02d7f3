# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers shared by the kernel tests: devices, random bit patterns, byte views.
(The torch reference MoE is tests/kernels/moe/moe_reference.py.)"""

import pytest
import torch

__all__ = [
    "DEVICES",
    "bytes_of",
    "random_bits",
]

#: CPU always; CUDA as a parameter that is skipped, with a reason, without a GPU.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device"
        ),
    ),
]


def random_bits(shape, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` filled with random bytes.

    Any bit pattern is allowed (NaN payloads included): the tests that use it
    compare bytes, never values.
    """
    shape = tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw_shape = (*shape[:-1], shape[-1] * itemsize) if shape else (itemsize,)
    raw = torch.randint(0, 256, raw_shape, dtype=torch.uint8, generator=gen)
    out = raw.view(dtype)
    return out.reshape(shape).to(device)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of contiguous ``t`` as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)
