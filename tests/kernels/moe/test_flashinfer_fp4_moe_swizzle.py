# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""NVFP4 MoE block scales swizzled in place, one expert at a time, in the
preparation for the FlashInfer CUTLASS and b12x kernels."""

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.moe.utils import make_dummy_moe_config, peak_memory_bytes
from tests.kernels.quantization.nvfp4_utils import convert_swizzled_to_linear
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    prepare_nvfp4_moe_layer_for_fi_or_cutlass,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale_,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (E, I, H) whose block scales need no padding for the 128x4 swizzle:
# Qwen3.6-35B-A3B's routed experts, and a small shape.
SHAPES = [(256, 512, 2048), (3, 64, 128)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e,m,k", [(3, 256, 8), (2, 128, 4)])
def test_swizzle_blockscale_in_place_is_the_128x4_layout(device, e, m, k):
    scale = torch.randint(0, 127, (e, m, k), dtype=torch.uint8, device=device)
    linear = scale.clone()

    out = swizzle_blockscale_(scale.view(torch.float8_e4m3fn))

    assert out.data_ptr() == scale.data_ptr() and out.shape == (e, m, k)
    for x in range(e):
        back = convert_swizzled_to_linear(out[x].view(torch.uint8), m, k * 16, 16)
        assert torch.equal(back, linear[x])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("e,i,h", SHAPES, ids=lambda s: str(s))
def test_fi_cutlass_preparation_peak_is_one_expert(device, e, i, h):
    """Reorder and swizzle of a gated layer, as the FlashInfer CUTLASS and
    b12x backends prepare it."""
    moe = SimpleNamespace(
        activation=MoEActivation.SILU, moe_config=make_dummy_moe_config()
    )
    w13 = torch.empty(e, 2 * i, h // 2, dtype=torch.uint8, device=device)
    w13_scale = torch.zeros(e, 2 * i, h // 16, dtype=torch.float8_e4m3fn, device=device)
    w2 = torch.empty(e, h, i // 2, dtype=torch.uint8, device=device)
    w2_scale = torch.zeros(e, h, i // 16, dtype=torch.float8_e4m3fn, device=device)
    ones = torch.ones(e, device=device)

    def prepare():
        return prepare_nvfp4_moe_layer_for_fi_or_cutlass(
            NvFp4MoeBackend.FLASHINFER_CUTLASS,
            moe,
            w13,
            w13_scale,
            ones,
            ones.expand(2, e).T,
            w2,
            w2_scale,
            ones,
            ones,
            is_act_and_mul=True,
        )

    peak = peak_memory_bytes(prepare, device)

    # The reorder's one-expert halves (576 KiB at Qwen3.6-35B-A3B) and the
    # per-expert input scales; 0.34.0's swizzle of w13's scales takes 64 MiB.
    assert peak <= i * h // 2 + i * h // 16 + (4 << 10)
