# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every bounded step keeps its cap as the CUDA caching allocator counts.

The allocator rounds every block up to 512 bytes (``memory_allocated``
counts the rounded sizes), so a cap planned in exact bytes can be exceeded
on a GPU (the fold at its minimum cap: 66,048 B against 65,536). Simulated
here on CPU with the meter's ``round_to``, for each bounded step at caps
that are not multiples of 512, at the step's minimum, and large.
"""

import pytest
import torch

from tests.kernels.moe.utils import (
    bf16_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
)
from tests.kernels.utils import random_bits
from vllm.model_executor.layers.quantization.utils import blockscale_fold
from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_values,
)
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    blockscale_storage_for_swizzle,
    swizzle_blockscale_bounded,
    unswizzle_blockscale_bounded_,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.utils.mem_utils import CUDA_ALLOCATION_ROUNDING, measure_peak_memory

E, R, C = 6, 256, 16  # 6 experts, 256 rows (two halves), 16 scale columns
CAPS = [4096 + 100, (16 << 10) - 1, 65536, 1 << 20]


def _peak(fn, round_to=CUDA_ALLOCATION_ROUNDING) -> int:
    with measure_peak_memory("cpu", round_to=round_to) as mem:
        fn()
    return mem.peak_bytes


def _scales(e=E, r=R, c=C, seed=0):
    return (
        random_bits((e, r, c), torch.uint8, "cpu", seed)
        .clamp_(8, 0x77)
        .view(torch.float8_e4m3fn)
    )


def _assert_within(name: str, cap: int, fn, allocates: bool = True) -> int:
    peak = _peak(fn)
    assert peak <= cap, f"{name}: {peak} B (512-B rounded) > cap {cap} B"
    assert peak > 0 or not allocates, f"{name}: nothing measured"
    return peak


@pytest.mark.parametrize("factors", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("cap", CAPS + ["min"], ids=str)
def test_fold_keeps_its_cap_under_rounding(cap, factors):
    # float64 global scales: the fold's float32 factors are then a copy,
    # a block of their own (float32 ones are a view).
    scale, scale_2 = _scales(), (torch.rand(E, 2) + 0.5).to(factors)
    if cap == "min":
        cap = blockscale_fold._fold_min_cap(2 * E)
    _assert_within(
        "fold",
        cap,
        lambda: fold_global_scale_into_blockscale_(
            scale, scale_2, max_transient_bytes=cap
        ),
    )


@pytest.mark.parametrize("cap", CAPS + [1000], ids=str)
def test_reorder_keeps_its_cap_under_rounding(cap):
    w = random_bits((E, R, 96), torch.uint8, "cpu", 1)
    s = _scales(seed=2)
    _assert_within(
        "reorder",
        cap,
        lambda: reorder_w1w3_to_w3w1(w, s, dim=-2, max_transient_bytes=cap),
    )


@pytest.mark.parametrize("cap", CAPS + [2048 + 100], ids=str)
def test_validation_keeps_its_cap_under_rounding(cap):
    s = _scales(seed=3)
    s.view(torch.uint8)[E - 1, R - 1, C - 1] = 0x7F  # a NaN at the very end

    # It scans every chunk (and raises at the last): the peak is the scan's.
    def scan():
        with pytest.raises(ValueError, match="NaN"):
            check_blockscale_values("s", s, max_transient_bytes=cap)

    _assert_within("validate", cap, scan)


@pytest.mark.parametrize("cap", CAPS, ids=str)
def test_swizzle_and_unswizzle_keep_their_cap_under_rounding(cap):
    r, c = R - 40, C - 2  # padding needed: 216 rows, 14 columns
    s = blockscale_storage_for_swizzle(E, r, c)
    s.view(torch.uint8).copy_(random_bits(s.shape, torch.uint8, "cpu", 4)).clamp_(
        8, 0x77
    )
    out = {}
    _assert_within(
        "swizzle",
        cap,
        lambda: out.setdefault(
            "s",
            swizzle_blockscale_bounded(
                s, max_transient_bytes=cap, storage_has_room=True
            ),
        ),
    )
    _assert_within(
        "unswizzle",
        cap,
        lambda: unswizzle_blockscale_bounded_(out["s"], r, c, max_transient_bytes=cap),
    )


@pytest.mark.parametrize("mode", ["alpha", "fold"])
@pytest.mark.parametrize("cap", [8192 + 100, 65536 - 1], ids=str)
def test_every_preparation_step_keeps_its_cap_under_rounding(cap, mode):
    e, h, i = 4, 256, 80  # I = 80: row and column padding
    w1, w2 = bf16_experts(e, i, h, gated=True, seed=9)
    tensors = quantize_experts_modelopt(w1, w2, gated=True, shared_w13_scale=False)
    layer = make_nvfp4_layer(
        e,
        2,
        h,
        i,
        True,
        "flashinfer_b12x_emulated",
        max_transient_bytes=cap,
        global_scale_mode=mode,
    )
    load_nvfp4_experts(layer, tensors)
    steps = layer.quant_method.preparation_steps(layer)
    for name, step in steps:
        # (The fold allocates nothing in alpha mode; finalize tiny tensors.)
        _assert_within(name, cap, step, allocates=False)
    _assert_within(
        "restore", cap, lambda: layer.quant_method.restore_load_layout(layer)
    )


def test_rounding_matters_at_small_caps():
    # Control: the simulation changes the figure where blocks are small (the
    # fold at its minimum cap allocates several sub-512-byte blocks).
    scale, scale_2 = _scales(), torch.rand(E, 2) + 0.5
    cap = blockscale_fold._fold_min_cap(2 * E)

    def fold():
        fold_global_scale_into_blockscale_(scale, scale_2, max_transient_bytes=cap)

    assert _peak(fold) > _peak(fold, round_to=1)
