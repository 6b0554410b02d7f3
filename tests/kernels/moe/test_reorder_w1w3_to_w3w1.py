# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exactness, aliasing, memory bound and input checks of the in-place reorder."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.moe.utils import split_cat_halves
from tests.kernels.utils import DEVICES, bytes_of, random_bits
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
)
from vllm.model_executor.layers.quantization.utils.bounded_halves_swap import (
    _bounce_buffer_bytes,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.utils.mem_utils import measure_peak_memory

DTYPES = [
    torch.uint8,
    torch.float8_e4m3fn,
    torch.bfloat16,
    torch.float16,
    torch.float32,
]

# (weight shape, scale shape) with [w1; w3] along dim -2: E, 2I, H/2 and H/16.
# Real model shapes scaled down (Qwen3.6-35B-A3B: 256, 1024, 1024 / 128;
# Mixtral: 8, 28672, 2048 / 256), then awkward sizes.
LAYER_SHAPES = [
    ((8, 64, 64), (8, 64, 8)),
    ((2, 112, 128), (2, 112, 16)),
    ((3, 6, 5), (3, 6, 1)),
    ((1, 2, 1), (1, 2, 1)),
    ((5, 38, 7), (5, 38, 3)),
]

# For each dim, a weight/scale pair that agrees only along that dim.
DIM_SHAPES = {
    0: ((6, 3, 5), (6, 2, 1)),
    1: ((3, 4, 5), (2, 4, 7)),
    -1: ((3, 5, 8), (1, 2, 8)),
    -2: ((3, 10, 4), (3, 10, 2)),
    -3: ((4, 3, 5), (4, 1, 2)),
}

CAPS = [1, 7, 96, 4096, DEFAULT_MAX_TRANSIENT_BYTES]


def assert_reorders_exactly(weight, scale, dim, **kwargs):
    want_w = split_cat_halves(weight, dim)
    want_s = split_cat_halves(scale, dim)
    ptrs = (weight.data_ptr(), scale.data_ptr())
    strides = (weight.stride(), scale.stride())
    out_w, out_s = reorder_w1w3_to_w3w1(weight, scale, dim, **kwargs)
    assert out_w is weight and out_s is scale
    assert (weight.data_ptr(), scale.data_ptr()) == ptrs
    assert (weight.stride(), scale.stride()) == strides
    assert weight.is_contiguous() and scale.is_contiguous()
    assert torch.equal(bytes_of(weight), bytes_of(want_w))
    assert torch.equal(bytes_of(scale), bytes_of(want_s))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", LAYER_SHAPES, ids=lambda s: "x".join(map(str, s[0])))
@pytest.mark.parametrize("cap", CAPS)
def test_matches_split_cat_layer_shapes(device, dtype, shapes, cap):
    w_shape, s_shape = shapes
    weight = random_bits(w_shape, torch.uint8, device, seed=1)
    scale = random_bits(s_shape, dtype, device, seed=2)
    assert_reorders_exactly(weight, scale, -2, max_transient_bytes=cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", sorted(DIM_SHAPES))
@pytest.mark.parametrize("cap", [3, DEFAULT_MAX_TRANSIENT_BYTES])
def test_matches_split_cat_every_dim(device, dtype, dim, cap):
    w_shape, s_shape = DIM_SHAPES[dim]
    weight = random_bits(w_shape, dtype, device, seed=3)
    scale = random_bits(s_shape, torch.float8_e4m3fn, device, seed=4)
    assert_reorders_exactly(weight, scale, dim, max_transient_bytes=cap)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_matches_split_cat_property(data):
    ndim = data.draw(st.integers(1, 4), label="ndim")
    dim = data.draw(st.integers(-ndim, ndim - 1), label="dim")
    half = data.draw(st.integers(1, 6), label="half")
    w_shape = [data.draw(st.integers(1, 5)) for _ in range(ndim)]
    s_shape = [data.draw(st.integers(1, 5)) for _ in range(ndim)]
    w_shape[dim] = s_shape[dim] = 2 * half
    w_dtype = data.draw(st.sampled_from(DTYPES), label="weight dtype")
    s_dtype = data.draw(st.sampled_from(DTYPES), label="scale dtype")
    cap = data.draw(st.integers(1, 4096), label="cap")
    weight = random_bits(w_shape, w_dtype, "cpu", seed=5)
    scale = random_bits(s_shape, s_dtype, "cpu", seed=6)
    assert_reorders_exactly(weight, scale, dim, max_transient_bytes=cap)


@pytest.mark.parametrize("device", DEVICES)
def test_twice_is_identity(device):
    weight = random_bits((4, 12, 9), torch.uint8, device, seed=7)
    scale = random_bits((4, 12, 3), torch.float8_e4m3fn, device, seed=8)
    w0, s0 = weight.clone(), scale.clone()
    reorder_w1w3_to_w3w1(weight, scale, max_transient_bytes=5)
    assert not torch.equal(weight, w0)
    # Both halves of both tensors moved: the scale is swapped too.
    assert torch.equal(bytes_of(scale), bytes_of(split_cat_halves(s0, -2)))
    reorder_w1w3_to_w3w1(weight, scale, max_transient_bytes=5)
    assert torch.equal(weight, w0)
    assert torch.equal(bytes_of(scale), bytes_of(s0))


def test_readable_rows():
    # Gate rows hold 1..4 and up rows 10..40: a wrong order is obvious.
    gate = torch.arange(1, 5, dtype=torch.float32).repeat_interleave(2).view(4, 2)
    up = 10 * gate
    weight = torch.cat([gate, up]).unsqueeze(0)  # [1, 8, 2]
    scale = torch.cat([gate[:, :1], up[:, :1]]).unsqueeze(0)  # [1, 8, 1]
    reorder_w1w3_to_w3w1(weight, scale, max_transient_bytes=4)
    assert weight[0, :, 0].tolist() == [10, 20, 30, 40, 1, 2, 3, 4]
    assert scale[0, :, 0].tolist() == [10, 20, 30, 40, 1, 2, 3, 4]


def test_views_of_the_parameters_see_the_swap():
    weight = torch.nn.Parameter(
        random_bits((2, 4, 3), torch.bfloat16, "cpu", seed=9), requires_grad=True
    )
    scale = torch.nn.Parameter(
        random_bits((2, 4, 1), torch.uint8, "cpu", seed=10), requires_grad=False
    )
    view = weight.data[:, :2]
    scale_view = scale.data[:, 2:]
    want = split_cat_halves(weight.detach(), -2)
    want_scale = split_cat_halves(scale.detach(), -2)
    out_w, out_s = reorder_w1w3_to_w3w1(weight, scale)
    assert out_w is weight and out_s is scale
    assert torch.equal(bytes_of(view), bytes_of(want[:, :2].contiguous()))
    assert torch.equal(scale_view, want_scale[:, 2:])


@pytest.mark.parametrize("device", DEVICES)
def test_zero_size_is_noop(device):
    weight = torch.empty((0, 4, 8), dtype=torch.uint8, device=device)
    scale = torch.empty((0, 4, 1), dtype=torch.float8_e4m3fn, device=device)
    assert reorder_w1w3_to_w3w1(weight, scale) == (weight, scale)
    empty_dim = torch.empty((3, 0, 2), dtype=torch.uint8, device=device)
    assert reorder_w1w3_to_w3w1(empty_dim, empty_dim.clone())[0] is empty_dim


# Qwen3.6-35B-A3B, one MoE layer at TP=1: E=256, 2I=1024, H=2048.
QWEN36_WEIGHT = (256, 1024, 1024)
QWEN36_SCALE = (256, 1024, 128)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cap", [DEFAULT_MAX_TRANSIENT_BYTES, 1 << 20], ids=["64MiB", "1MiB"]
)
def test_peak_memory_within_cap_at_qwen36_shape(device, cap):
    weight = random_bits(QWEN36_WEIGHT, torch.uint8, device, seed=11)
    scale = random_bits(QWEN36_SCALE, torch.float8_e4m3fn, device, seed=12)
    head_w = bytes_of(weight[0]).clone()
    with measure_peak_memory(device) as mem:
        reorder_w1w3_to_w3w1(weight, scale, max_transient_bytes=cap)
    assert 0 < mem.peak_bytes <= cap
    assert mem.net_bytes == 0
    assert torch.equal(bytes_of(weight[0]), split_cat_halves(head_w, 0))

    # Control: the meter sees the pre-change split+cat's full copy (288 MiB).
    with measure_peak_memory(device) as legacy:
        out = (split_cat_halves(weight, -2), split_cat_halves(scale, -2))
    del out
    full = weight.numel() * weight.element_size() + scale.numel()
    assert legacy.peak_bytes >= full > 4 * cap


@pytest.mark.parametrize("device", DEVICES)
def test_failed_allocation_leaves_inputs_untouched(device, monkeypatch):
    weight = random_bits((4, 8, 16), torch.uint8, device, seed=13)
    scale = random_bits((4, 8, 2), torch.float8_e4m3fn, device, seed=14)
    w0, s0 = weight.clone(), bytes_of(scale).clone()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated: no room for the bounce buffer")

    monkeypatch.setattr(torch, "empty", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        reorder_w1w3_to_w3w1(weight, scale, max_transient_bytes=8)
    monkeypatch.undo()
    assert torch.equal(weight, w0)
    assert torch.equal(bytes_of(scale), s0)


def _bad_inputs():
    w = random_bits((2, 4, 6), torch.uint8, "cpu", seed=15)
    s = random_bits((2, 4, 2), torch.float8_e4m3fn, "cpu", seed=16)
    odd_w = random_bits((2, 5, 6), torch.uint8, "cpu", seed=17)
    odd_s = random_bits((2, 5, 2), torch.uint8, "cpu", seed=18)
    return [
        ("weight must be a torch.Tensor", TypeError, (w.numpy(), s), {}),
        ("scale must be a torch.Tensor", TypeError, (w, [1, 2]), {}),
        ("weight must be contiguous", ValueError, (w.transpose(1, 2), s), {}),
        ("scale must be contiguous", ValueError, (w, s.transpose(0, 1)), {}),
        ("must be even", ValueError, (odd_w, odd_s), {}),
        ("same size along dim", ValueError, (w, s[:, :2].contiguous()), {}),
        ("out of range for weight", ValueError, (w, s), {"dim": 3}),
        ("out of range for weight", ValueError, (w, s), {"dim": -4}),
        ("dim must be an int", TypeError, (w, s), {"dim": 1.0}),
        (
            "max_transient_bytes must be positive",
            ValueError,
            (w, s),
            {"max_transient_bytes": 0},
        ),
        (
            "max_transient_bytes must be positive",
            ValueError,
            (w, s),
            {"max_transient_bytes": -5},
        ),
        (
            "max_transient_bytes must be an int",
            TypeError,
            (w, s),
            {"max_transient_bytes": 1.5},
        ),
        ("must not share memory", ValueError, (w, w), {}),
        ("at least one dimension", ValueError, (torch.tensor(3), s), {"dim": 0}),
    ]


@pytest.mark.parametrize(
    "case", range(len(_bad_inputs())), ids=lambda i: _bad_inputs()[i][0]
)
def test_bad_input_is_rejected_and_changes_nothing(case):
    message, error, args, kwargs = _bad_inputs()[case]
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    with pytest.raises(error, match=message):
        reorder_w1w3_to_w3w1(*args, **kwargs)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    for b, a in zip(before, after, strict=True):
        assert torch.equal(bytes_of(b), bytes_of(a))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_different_devices_rejected():
    w = random_bits((2, 4, 6), torch.uint8, "cpu", seed=19)
    s = random_bits((2, 4, 2), torch.uint8, "cuda", seed=20)
    with pytest.raises(ValueError, match="same device"):
        reorder_w1w3_to_w3w1(w, s)


def test_different_devices_rejected_on_cpu_with_meta():
    # The meta device lets the device check run on a CPU-only machine.
    w = random_bits((2, 4, 6), torch.uint8, "cpu", seed=21)
    s = torch.empty((2, 4, 2), dtype=torch.uint8, device="meta")
    w0 = w.clone()
    with pytest.raises(ValueError, match="same device.*cpu.*meta"):
        reorder_w1w3_to_w3w1(w, s)
    assert torch.equal(w, w0)


def test_adjacent_weight_and_scale_of_one_buffer_are_accepted():
    # Weight and scale packed back to back in one allocation share no byte:
    # not refused as overlapping, each reordered exactly, the rest untouched.
    buf = random_bits((8 * 64 + 8 * 8 + 16,), torch.uint8, "cpu", seed=3)
    weight = buf[: 8 * 64].view(8, 8, 8)
    scale = buf[8 * 64 : 8 * 64 + 8 * 8].view(8, 8, 1)
    want_w, want_s = split_cat_halves(weight), split_cat_halves(scale)
    tail = buf[8 * 64 + 8 * 8 :].clone()
    reorder_w1w3_to_w3w1(weight, scale, max_transient_bytes=16)
    assert torch.equal(weight, want_w) and torch.equal(scale, want_s)
    assert torch.equal(buf[8 * 64 + 8 * 8 :], tail)


@pytest.mark.parametrize("cap", [700, 1023, 1024, 300])
def test_bounce_buffer_fits_the_cap_as_the_allocator_counts(cap):
    # CUDA rounds a block up to 512 bytes: a 700-byte buffer would count as
    # 1024, past the cap; below 512 the cap itself (no smaller block).
    size = _bounce_buffer_bytes([1 << 20], torch.device("cpu"), cap)
    assert size == {700: 512, 1023: 512, 1024: 1024, 300: 300}[cap]
