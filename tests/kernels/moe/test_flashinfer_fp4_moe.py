# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""reorder_w1w3_to_w3w1: the bytes of split + cat, in place, through one
expert's half."""

import pytest
import torch

from tests.kernels.moe.utils import peak_memory_bytes
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (E, I, H): Qwen3.6-35B-A3B's routed experts, and an odd small shape.
SHAPES = [(256, 512, 2048), (3, 96, 64)]


def _split_cat(t: torch.Tensor) -> torch.Tensor:
    half = t.size(1) // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e,i,h", SHAPES, ids=lambda s: str(s))
@pytest.mark.parametrize(
    "weight_dtype,pack,scale_dtype,group",
    [
        (torch.uint8, 2, torch.float8_e4m3fn, 16),  # NVFP4
        (torch.int32, 8, torch.bfloat16, 32),  # MXINT4 (flashinfer_mxint4_moe)
    ],
    ids=["nvfp4", "mxint4"],
)
def test_reorder_w1w3_to_w3w1_in_place_through_one_expert_half(
    device, e, i, h, weight_dtype, pack, scale_dtype, group
):
    weight = torch.randint(-(2**7), 2**7, (e, 2 * i, h // pack), device=device)
    weight = weight.to(weight_dtype)
    scale = torch.randn(e, 2 * i, h // group, device=device).to(scale_dtype)
    expected = [_split_cat(weight), _split_cat(scale)]

    peak = peak_memory_bytes(lambda: reorder_w1w3_to_w3w1(weight, scale), device)

    for got, want in zip((weight, scale), expected):
        assert got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # One expert's weight half plus its scale half: 576 KiB at Qwen3.6-35B-A3B
    # in NVFP4 (the 64 MB-chunked swap takes 72 MiB there).
    assert peak <= i * weight[0, 0].nbytes + i * scale[0, 0].nbytes
