# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the bounded preparation walks its tensors: the fold's lookup tables,
the swizzle on 4-byte words in chunks that span experts, the number of
operations, and the thread setting. Speed itself is measured by
``benchmarks/kernels/benchmark_moe_weight_prep_steps.py``, not here."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.kernels.moe.utils import (
    fold_reference,
    load_nvfp4_experts,
    make_nvfp4_layer,
    random_layer_tensors,
)
from tests.kernels.utils import bytes_of, random_bits
from vllm.model_executor.layers.quantization.utils import blockscale_fold as fp4
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    swizzle_blockscale_bounded,
    unswizzle_blockscale_bounded_,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    swizzled_blockscale_shape,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

BACKEND = "flashinfer_b12x_emulated"

# --- the fold's lookup tables ---------------------------------------------------

# Factors from 2^-40 (every product underflows to 0 or a subnormal) to 2^20
# (every non-zero product saturates at 448), checkpoint-like values
# (ModelOpt weight_scale_2 ~ 1e-5..1e-4 for expert weight std 0.005-0.05),
# ratios below 1 (the alpha mode's differing halves), non-powers of two
# whose products round (ties included: 1.5 * 0x09 = 1.5 * 2^-9 * 9/8 ...).
FACTORS = [
    2.0**-40,
    2.0**-20,
    3.7e-5,
    1.1e-4,
    0.0053,
    0.3,
    0.7,
    1.0,
    1.5,
    3.3,
    7.0,
    2.0**10,
    2.0**20,
]


def test_fold_table_is_bit_identical_to_the_formula_on_all_256_codes():
    # Each (expert, half) segment holds all 256 bytes (NaN 0x7F / 0xFF,
    # subnormals 0x01..0x07, -0.0, negatives included), each half with its
    # own factor: the table path must give the formula's exact bytes.
    e = len(FACTORS)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)
    scale = codes.repeat(e, 2, 1).contiguous().view(torch.float8_e4m3fn)  # [E, 32, 16]
    scale_2 = torch.tensor([FACTORS, FACTORS[::-1]], dtype=torch.float32).T.contiguous()
    want = fold_reference(scale, scale_2)
    # Something is tested: saturation, underflow, NaN and rounding all occur.
    w = bytes_of(want)
    assert (w == 0x7E).any() and (w == 0x00).any() and (w == 0x7F).any()
    assert (w != bytes_of(scale)).sum() > 1000
    for cap in (fp4._fold_min_cap(2 * e), 4096, 1 << 20):
        got = scale.clone()
        fold_global_scale_into_blockscale_(got, scale_2, max_transient_bytes=cap)
        assert torch.equal(bytes_of(got), w), f"cap {cap}"


def test_fold_at_its_smallest_cap_stays_within_it():
    scale = (random_bits((6, 64, 24), torch.uint8, "cpu", seed=5) % 0x7F).view(
        torch.float8_e4m3fn
    )
    scale_2 = torch.rand(6, 2) * 1e-3 + 1e-5
    want = fold_reference(scale, scale_2)
    cap = fp4._fold_min_cap(12)
    untouched = scale.clone()
    with pytest.raises(ValueError, match=f"at least {cap} for the fold of 12"):
        fold_global_scale_into_blockscale_(scale, scale_2, max_transient_bytes=cap - 1)
    assert torch.equal(bytes_of(scale), bytes_of(untouched))
    with measure_peak_memory("cpu") as mem:
        fold_global_scale_into_blockscale_(scale, scale_2, max_transient_bytes=cap)
    assert mem.peak_bytes <= cap
    assert torch.equal(bytes_of(scale), bytes_of(want))


# --- the swizzle: 4-byte words, chunks spanning experts --------------------------

# (E, R, C): rows padded (300 -> 384) with columns padded (5 -> 8); rows a
# multiple of 128 (walked as one expert) with columns padded; no padding;
# Nemotron-like rows (1856 -> 1920).
SWIZZLE_SHAPES = [(8, 300, 5), (8, 256, 12), (6, 128, 4), (5, 130, 168)]


def _caps(e, r, c):
    rp, cp = swizzled_blockscale_shape(r, c)
    group, expert = 128 * cp, rp * cp
    # one group; less than an expert; 2.5 experts (chunks of 2 whole experts
    # then a last one); everything at once
    return [group, max(group, expert - group), 5 * expert // 2, 64 << 20]


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd_offset"])
@pytest.mark.parametrize("shape", SWIZZLE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_swizzle_in_place_in_chunks_spanning_experts(shape, offset):
    # offset 1 puts the scale at an odd address: the permutation then moves
    # bytes instead of 4-byte words, with the same result.
    e, r, c = shape
    rp, cp = swizzled_blockscale_shape(r, c)
    src = random_bits((e, r, c), torch.uint8, "cpu", seed=r + c) % 0x7F
    want = bytes_of(swizzle_blockscale(src.view(torch.float8_e4m3fn)))
    for cap in _caps(e, r, c):
        storage = torch.zeros(offset + e * rp * cp, dtype=torch.uint8)
        scale = storage[offset : offset + e * r * c].view(e, r, c)
        scale.copy_(src)
        scale = scale.view(torch.float8_e4m3fn)
        with measure_peak_memory("cpu") as mem:
            out = swizzle_blockscale_bounded(
                scale, max_transient_bytes=cap, storage_has_room=True
            )
        assert mem.peak_bytes <= cap
        assert out.data_ptr() == scale.data_ptr()
        assert torch.equal(bytes_of(out), want), f"cap {cap}"
        with measure_peak_memory("cpu") as mem:
            back = unswizzle_blockscale_bounded_(out, r, c, max_transient_bytes=cap)
        assert mem.peak_bytes <= cap
        assert torch.equal(bytes_of(back), bytes_of(src)), f"cap {cap}"


@pytest.mark.parametrize("shape", SWIZZLE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_swizzle_into_a_new_result_in_chunks_spanning_experts(shape):
    e, r, c = shape
    src = (random_bits((e, r, c), torch.uint8, "cpu", seed=e) % 0x7F).view(
        torch.float8_e4m3fn
    )
    want = bytes_of(swizzle_blockscale(src))
    for cap in _caps(e, r, c):
        out = swizzle_blockscale_bounded(src.clone(), max_transient_bytes=cap)
        assert torch.equal(bytes_of(out), want), f"cap {cap}"


# --- operations: O(bytes / tile), not O(experts x groups) ------------------------

# Torch calls that read or write tensor data (views and slicing are free).
DATA_OPS = {
    "copy_",
    "zero_",
    "index_select",
    "add_",
    "mul",
    "clamp_",
    "aminmax",
    "any",
    "fill_",
    "amax",
    "div",
    "ne",
    "__truediv__",
    "__ne__",
}


class CountDataOps(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in DATA_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _data_ops_of_preparation(e, h, i, mode):
    tensors = random_layer_tensors(e, h, i, True, seed=0, shared_w13_scale=True)
    if mode == "fold":  # differing w1 / w3 global scales: the fold runs
        tensors["w13_weight_scale_2"][:, 1] *= 0.5
    layer = make_nvfp4_layer(e, 2, h, i, True, BACKEND, global_scale_mode=mode)
    load_nvfp4_experts(layer, tensors)
    with CountDataOps() as counter:
        layer.quant_method.process_weights_after_loading(layer)
    return counter.count


@pytest.mark.parametrize("mode", ["alpha", "fold"])
def test_operation_count_follows_bytes_not_experts(mode):
    # Same bytes (w13 32 MiB, w2 16 MiB, scales 6 MiB), 4x the experts at a
    # quarter of the intermediate size. Chunking per expert (or per expert
    # and group) multiplies the operations by 4; chunks spanning experts
    # keep them. Default cap: 2 MiB tiles on CPU.
    few = _data_ops_of_preparation(64, 1024, 512, mode)
    many = _data_ops_of_preparation(256, 1024, 128, mode)
    assert many <= few * 1.1 + 8, (few, many)
    # And O(bytes / tile): about 54 MiB through 2 MiB tiles (41 and 125 when
    # written, 61 in alpha mode once the kernel's two [E] activation scales
    # were checked and inverted at the bind; chunks per expert gave 291 and
    # 327, and 1059 and 1095).
    assert few <= {"alpha": 80, "fold": 160}[mode], few  # was 291 and 327


# --- threads ----------------------------------------------------------------------


class RecordThreads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.threads = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_":
            self.threads.add(torch.get_num_threads())
        return func(*args, **(kwargs or {}))


def test_preparation_leaves_the_thread_setting_alone(two_threads):
    # The intra-op thread count is the process's: a command that prepares
    # weights sets it (vllm.entrypoints.process_policy), the layer does not.
    layer = make_nvfp4_layer(4, 2, 256, 128, True, BACKEND)
    load_nvfp4_experts(
        layer, random_layer_tensors(4, 256, 128, True, seed=1, shared_w13_scale=True)
    )
    experts = layer.quant_method.experts_for(layer)
    with RecordThreads() as rec:
        experts.process_weights_after_loading(layer)
    assert rec.threads == {2}
    assert torch.get_num_threads() == 2
