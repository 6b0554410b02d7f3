# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The in-place preparation owns its state: re-run, reload, interruption and
bad scales never leave a silently wrong layer."""

import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.kernels.moe.nvfp4_w4a16_utils import PACKED_FIELDS
from tests.kernels.moe.utils import (
    bf16_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    split_cat_halves,
)
from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    swizzle_blockscale_bounded,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ChunkProgress,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

BACKEND = "flashinfer_b12x_emulated"
# (E, H, I, gated): I = 80 pads the scale rows (160 or 80 -> 256 or 128) and
# H = 192 pads the w13 scale columns (12 -> 12, but w2's I/16 = 5 -> 8).
SHAPES = [(3, 192, 80, True), (2, 320, 80, False), (4, 256, 128, True)]
SHAPE_IDS = ["E3_H192_I80_silu", "E2_H320_I80_relu2", "E4_H256_I128_silu"]
CAP = 16 << 10  # many chunks per step at these shapes
W4A16_CAP = 64 << 10


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt (a BaseException, not an Exception)."""


class RaiseAtCall(TorchFunctionMode):
    """Raise ``Interrupt`` instead of running the ``k``-th torch call (1-based);
    ``k=None`` only counts calls."""

    def __init__(self, k: int | None = None):
        super().__init__()
        self.k, self.calls, self.names = k, 0, set()
        #: storages (data pointers) an in-place op wrote into, except a copy
        #: of a tensor onto itself (torch skips it)
        self.written: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        name = getattr(func, "__name__", str(func))
        self.names.add(name)
        if name.endswith("_") and not name.startswith("__") and args:
            dst = args[0]
            src = args[1] if len(args) > 1 else None
            same = (
                name == "copy_"
                and isinstance(src, torch.Tensor)
                and src.data_ptr() == dst.data_ptr()
                and src.shape == dst.shape
                and src.stride() == dst.stride()
            )
            if isinstance(dst, torch.Tensor) and not same:
                self.written.add(dst.untyped_storage().data_ptr())
        if self.calls == self.k:
            raise Interrupt(f"call {self.k}: {getattr(func, '__name__', func)}")
        return func(*args, **(kwargs or {}))


def _tensors(e, h, i, gated, seed):
    w1, w2 = bf16_experts(e, i, h, gated=gated, seed=seed)
    return quantize_experts_modelopt(w1, w2, gated=gated)


def _layer(shape, tensors, **kwargs):
    e, h, i, gated = shape
    # W4A16 needs one 64-row strip and an expert's cycle plan at the least.
    cap = CAP if kwargs.get("quant_mode", "w4a4") == "w4a4" else W4A16_CAP
    kwargs.setdefault("max_transient_bytes", cap)
    layer = make_nvfp4_layer(
        e, 2, h, i, gated, BACKEND, bf16_activations=True, **kwargs
    )
    load_nvfp4_experts(layer, tensors)
    return layer


def _prepare(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _snapshot(layer) -> dict[str, torch.Tensor]:
    """Every parameter's bytes and shape, plus what the kernel reads."""
    params = dict(layer.named_parameters())
    snap = {n: bytes_of(p.detach().contiguous()).clone() for n, p in params.items()}
    snap |= {f"shape:{n}": torch.tensor(p.shape) for n, p in params.items()}
    experts = layer.quant_method.experts
    kernel = experts.prepared
    if experts.weight_only:  # W4A16: the packed views and global scales
        for key in PACKED_FIELDS:
            snap[key] = bytes_of(getattr(kernel, key).contiguous()).clone()
        return snap
    for key in ("w1_alpha", "w2_alpha", "fc2_input_scale"):
        snap[key] = getattr(kernel, key).clone()
    for key in ("w1_sf_mma", "w2_sf_mma"):
        view = getattr(kernel, key)
        snap[key] = bytes_of(view.permute(5, 2, 4, 0, 1, 3).contiguous())
    return snap


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _io(shape, seed=5):
    e, h = shape[0], shape[1]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, h, generator=gen).bfloat16(), torch.randn(8, e, generator=gen)


# --- 1. a second preparation ----------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_second_preparation_is_a_no_op(shape):
    layer = _prepare(_layer(shape, _tensors(*shape, seed=1)))
    x, logits = _io(shape)
    before, out = _snapshot(layer), layer(x, logits)
    assert layer.weight_prep_state.status is PrepStatus.PREPARED
    with RaiseAtCall() as counter:
        _prepare(layer)
    _assert_same(_snapshot(layer), before)
    # No preparation step ran again: no torch op wrote into a parameter
    # (the conversion and the kernel's views are rebuilt: tiny tensors).
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    assert not counter.written & params, counter.names
    assert torch.equal(layer(x, logits), out)


@pytest.mark.parametrize("quant_mode", ["w4a4", "w4a16"])
def test_steps_run_one_by_one_in_order_equal_the_whole_preparation(quant_mode):
    # The public sequence (what the steps benchmark times): each entry runs
    # its own step only, recorded; together they are the preparation.
    shape = SHAPES[2]  # W4A16: w13 rows a multiple of 64
    whole = _prepare(_layer(shape, _tensors(*shape, seed=1), quant_mode=quant_mode))
    layer = _layer(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    steps = layer.quant_method.preparation_steps(layer)
    state = layer.weight_prep_state
    names = [n for n, _ in steps]
    for i, (name, step) in enumerate(steps):
        step()
        assert state.done == names[: i + 1], name
        if i < len(steps) - 1:
            assert state.status is PrepStatus.PREPARING
    assert state.status is PrepStatus.PREPARED
    _assert_same(_snapshot(layer), _snapshot(whole))


@pytest.mark.parametrize("quant_mode", ["w4a4", "w4a16"])
def test_a_step_before_its_predecessor_is_refused_and_changes_nothing(quant_mode):
    # Control of the test above: a later step does not silently run the
    # earlier ones, it refuses naming the step it waits for.
    shape = SHAPES[2]  # W4A16: w13 rows a multiple of 64
    layer = _layer(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    experts = layer.quant_method.experts_for(layer)
    names = [n for n, _ in experts.preparation_steps(layer)]
    before = {n: bytes_of(p.detach()).clone() for n, p in layer.named_parameters()}
    with pytest.raises(RuntimeError, match=f"runs after {names[1]!r}"):
        experts.run_preparation_step(layer, names[2])
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    for n, p in layer.named_parameters():
        assert torch.equal(bytes_of(p.detach()), before[n]), n
    experts.run_preparation_step(layer, names[0])
    with pytest.raises(RuntimeError, match=f"runs after {names[1]!r}"):
        experts.run_preparation_step(layer, names[2])
    assert layer.weight_prep_state.done == names[:1]
    with pytest.raises(ValueError, match="unknown preparation step 'nope'"):
        experts.run_preparation_step(layer, "nope")


def test_direct_write_into_a_prepared_layer_is_refused():
    # Copying checkpoint-layout tensors straight into a prepared layer would
    # leave unswizzled bytes in a layer that says "prepared": refused loudly.
    shape = SHAPES[0]
    layer = _prepare(_layer(shape, _tensors(*shape, seed=1)))
    with torch.no_grad():
        layer.w13_weight.copy_(layer.w13_weight.flip(0))
    with pytest.raises(RuntimeError, match=r"modified in place.*weight_loader"):
        _prepare(layer)
    with pytest.raises(RuntimeError, match="modified in place"):
        layer(*_io(shape))


# --- 2. reload into a prepared layer -------------------------------------------


def _load_through_loader(layer, tensors, experts=None):
    """Load ModelOpt tensors [E, ...] (checkpoint layout, [w1; w3]) through
    FusedMoE.weight_loader, shard by shard, as a checkpoint reader does."""
    gated = layer.activation.is_gated
    i = layer.moe_config.intermediate_size_per_partition
    params = dict(layer.named_parameters())  # taken once, as vLLM does
    for ex in experts if experts is not None else range(layer.global_num_experts):
        shards = (
            {"w1": slice(0, i), "w3": slice(i, 2 * i)} if gated else {"w1": slice(0, i)}
        )
        for shard, rows in shards.items():
            g = 0 if shard == "w1" else 1
            for suffix in ("weight", "weight_scale"):
                name = f"w13_{suffix}"
                layer.weight_loader(
                    params[name], tensors[name][ex, rows], name, shard, ex
                )
            for suffix in ("weight_scale_2", "input_scale"):
                name = f"w13_{suffix}"
                value = tensors[name].reshape(layer.global_num_experts, -1)[ex, g]
                layer.weight_loader(params[name], value, name, shard, ex)
        for suffix in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            name = f"w2_{suffix}"
            layer.weight_loader(params[name], tensors[name][ex], name, "w2", ex)
        params = dict(layer.named_parameters()) | params  # stale objects still work


@pytest.mark.parametrize("place", [True, False], ids=["place_w3w1", "reorder"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_reload_into_prepared_layer_equals_fresh_layer(shape, place):
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    e, h, i, gated = shape
    layer = make_nvfp4_layer(
        e, 2, h, i, gated, BACKEND, max_transient_bytes=CAP, bf16_activations=True
    )
    layer.w13_loaded_as_w3w1 = place and gated
    _load_through_loader(layer, old)
    _prepare(layer)
    x, logits = _io(shape)
    out_old = layer(x, logits)
    storages = {n: p.untyped_storage().data_ptr() for n, p in layer.named_parameters()}

    with measure_peak_memory("cpu") as mem:
        _load_through_loader(layer, new)
        _prepare(layer)
    # Within the cap, plus what the prepared layer keeps: the kernel's
    # per-expert alphas and scales, a few [E] float32 tensors.
    kept = max(mem.net_bytes, 0)
    assert kept <= 16 * 4 * e
    assert mem.peak_bytes <= CAP + kept
    # The parameters kept their storage: nothing was reallocated.
    for n, p in layer.named_parameters():
        assert p.untyped_storage().data_ptr() == storages[n], n

    fresh = make_nvfp4_layer(
        e, 2, h, i, gated, BACKEND, max_transient_bytes=CAP, bf16_activations=True
    )
    _load_through_loader(fresh, new)
    _prepare(fresh)
    _assert_same(_snapshot(layer), _snapshot(fresh))
    out = layer(x, logits)
    assert torch.equal(out, fresh(x, logits))
    assert not torch.equal(out, out_old)  # control: the new weights do differ


def test_partial_reload_keeps_the_other_experts():
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _prepare(_layer(shape, old))
    _load_through_loader(layer, new, experts=[1])
    _prepare(layer)
    mixed = {k: v.clone() for k, v in old.items()}
    for k in mixed:
        mixed[k][1] = new[k][1]
    _assert_same(_snapshot(layer), _snapshot(_prepare(_layer(shape, mixed))))


def test_forward_refuses_between_reload_and_preparation():
    shape = SHAPES[0]
    layer = _prepare(_layer(shape, _tensors(*shape, seed=1)))
    _load_through_loader(layer, _tensors(*shape, seed=2), experts=[0])
    with pytest.raises(RuntimeError, match="load layout"):
        layer(*_io(shape))


# --- 3. interruption at every torch call ---------------------------------------


def _count_calls(fn) -> int:
    with RaiseAtCall() as counter:
        fn()
    return counter.calls


@pytest.mark.parametrize("shape", SHAPES[:2], ids=SHAPE_IDS[:2])
def test_interrupted_preparation_resumes_to_the_same_bytes(shape):
    tensors = _tensors(*shape, seed=3)
    want = _snapshot(_prepare(_layer(shape, tensors)))
    x, logits = _io(shape)
    layer = _layer(shape, tensors)
    n = _count_calls(lambda: _prepare(layer))
    assert n > 50
    for k in range(1, n + 1):
        layer = _layer(shape, tensors)
        with pytest.raises(Interrupt), RaiseAtCall(k):
            _prepare(layer)
        # Refused in between, even when the steps were done and the binding
        # or the guard's record was interrupted: the call did not return.
        with pytest.raises(RuntimeError, match="process_weights_after_loading"):
            layer(x, logits)
        _prepare(layer)  # the retry
        _assert_same(_snapshot(layer), want)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=SHAPE_IDS[:2])
def test_interrupted_reload_then_retry_equals_fresh_layer(shape):
    old, new = _tensors(*shape, seed=3), _tensors(*shape, seed=4)
    want = _snapshot(_prepare(_layer(shape, new)))
    layer = _prepare(_layer(shape, old))
    n = _count_calls(lambda: _load_through_loader(layer, new))
    for k in range(1, n + 1, 3):
        layer = _prepare(_layer(shape, old))
        with pytest.raises(Interrupt), RaiseAtCall(k):
            _load_through_loader(layer, new)
        _load_through_loader(layer, new)  # the retry: load everything again
        _prepare(layer)
        _assert_same(_snapshot(layer), want)


def test_interrupted_swap_loses_no_byte():
    # Without a progress record, an interrupted reorder leaves each chunk
    # whole: every row of each half is either swapped or as it was, never a
    # byte left only in the bounce buffer. An interrupt between a.copy_(b)
    # and b.copy_(tmp) (the third call of a chunk) is undone.
    gen = torch.Generator().manual_seed(9)
    w = torch.randint(0, 256, (8, 2 * 4, 64), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (8, 2 * 4, 8), dtype=torch.uint8, generator=gen)
    wc, sc = w.clone(), s.clone()
    n = _count_calls(lambda: reorder_w1w3_to_w3w1(wc, sc, max_transient_bytes=256))
    for k in range(1, n + 1):
        wk, sk = w.clone(), s.clone()
        with pytest.raises(Interrupt), RaiseAtCall(k):
            reorder_w1w3_to_w3w1(wk, sk, max_transient_bytes=256)
        for got, orig in ((wk, w), (sk, s)):
            swapped = split_cat_halves(orig, -2)
            for e in range(8):
                for h in range(2):
                    rows = slice(4 * h, 4 * h + 4)
                    assert torch.equal(got[e, rows], orig[e, rows]) or torch.equal(
                        got[e, rows], swapped[e, rows]
                    ), (k, e, h)
        # With a progress record the retry completes the swap exactly.
        wk, sk, progress = w.clone(), s.clone(), ChunkProgress()
        with pytest.raises(Interrupt), RaiseAtCall(k):
            reorder_w1w3_to_w3w1(wk, sk, max_transient_bytes=256, progress=progress)
        reorder_w1w3_to_w3w1(wk, sk, max_transient_bytes=256, progress=progress)
        assert torch.equal(wk, split_cat_halves(w, -2)), k
        assert torch.equal(sk, split_cat_halves(s, -2)), k


# --- 5. the swizzle writes only the tensor's own bytes ---------------------------


def test_swizzle_never_writes_past_a_view_without_recorded_room():
    # A [2, 300, 5] scale (padded to [2, 384, 8]) that is a view at the start
    # of a larger buffer: the bytes after it belong to someone else.
    buf = torch.full((2 * 384 * 8 + 100,), 0x5A, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(11)
    src = torch.randint(0x08, 0x78, (2, 300, 5), dtype=torch.uint8, generator=gen)
    buf[: src.numel()].copy_(src.reshape(-1))
    scale = buf[: src.numel()].view(2, 300, 5).view(torch.float8_e4m3fn)
    out = swizzle_blockscale_bounded(scale, max_transient_bytes=1024)
    assert out.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert torch.equal(buf[: src.numel()], src.reshape(-1))  # source untouched
    assert (buf[src.numel() :] == 0x5A).all()  # nothing written past it
    want = swizzle_blockscale(src.view(torch.float8_e4m3fn))
    assert torch.equal(bytes_of(out), bytes_of(want))
    with pytest.raises(ValueError, match="storage_has_room=True but"):
        small = torch.zeros(2 * 300 * 5 + 10, dtype=torch.float8_e4m3fn)
        swizzle_blockscale_bounded(small[:3000].view(2, 300, 5), storage_has_room=True)


# --- 4. scales set in memory are validated before anything is written -----------

NAN, INF = float("nan"), float("inf")
# (parameter, index, bad value, message); the layer holds [w1; w3] (place
# False), so column 1 of the w13 scales is w3's.
BAD_IN_MEMORY = [
    ("w13_weight_scale_2", (1, 1), NAN, "w13_weight_scale_2 of expert 1 (w3) is nan"),
    ("w13_weight_scale_2", (0, 0), -0.5, "of expert 0 (w1) is -0.5"),
    ("w2_weight_scale_2", (2,), 0.0, "w2_weight_scale_2 of expert 2 (w2) is 0.0"),
    ("w13_input_scale", (2, 0), INF, "w13_input_scale of expert 2 (w1) is inf"),
    ("w2_input_scale", (1,), -INF, "w2_input_scale of expert 1 (w2) is -inf"),
    (
        "w13_weight_scale",
        (1, 5, 3),
        0x7F,
        "w13_weight_scale: block scale of expert 1 is NaN (FP8 byte 0x7f)",
    ),
    ("w2_weight_scale", (2, 0, 0), 0xFF, "block scale of expert 2 is NaN"),
    ("w2_weight_scale", (0, 7, 1), 0xC0, "block scale of expert 0 is negative"),
]


@pytest.mark.parametrize("bad", BAD_IN_MEMORY, ids=lambda b: f"{b[0]}={b[2]}")
def test_bad_scales_in_memory_are_refused_and_change_nothing(bad):
    name, index, value, message = bad
    shape = SHAPES[0]
    tensors = _tensors(*shape, seed=6)
    layer = _layer(shape, tensors)
    param = getattr(layer, name)
    good = param.data[index].clone()
    with torch.no_grad():
        if param.dtype == torch.float8_e4m3fn:
            param.data.view(torch.uint8)[index] = value
        else:
            param.data[index] = value
    before = {n: bytes_of(p.detach()).clone() for n, p in layer.named_parameters()}
    with pytest.raises(ValueError, match=re.escape(message)):
        _prepare(layer)
    for n, p in layer.named_parameters():
        assert torch.equal(bytes_of(p.detach()), before[n]), n
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    # Fixed in place, the same layer prepares to the expected bytes.
    with torch.no_grad():
        param.data[index] = good
    want = _snapshot(_prepare(_layer(shape, tensors)))
    _assert_same(_snapshot(_prepare(layer)), want)


def test_a_bad_global_scale_names_the_shard_of_a_w3w1_load():
    # Loaded as [w3; w1] (w13_loaded_as_w3w1): column 0 holds w3's scale.
    shape = SHAPES[0]
    layer = _layer(shape, _tensors(*shape, seed=6))
    layer.w13_loaded_as_w3w1 = True
    with torch.no_grad():
        layer.w13_weight_scale_2.data[1, 0] = NAN
    with pytest.raises(ValueError, match=re.escape("of expert 1 (w3) is nan")):
        _prepare(layer)


class FailAtCall(TorchFunctionMode):
    """Raise RuntimeError (an Exception: a failing kernel, not an interrupt)
    instead of running the ``k``-th torch call."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.calls = k, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.k:
            raise RuntimeError(f"failed at call {self.k}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [1, 5])
def test_a_restore_whose_completion_of_the_preparation_fails_tears_the_layer(k):
    # W4A16's inverse needs an interrupted preparation completed first: when
    # that completion fails, the layer is reset and torn (refused until a
    # complete reload), never left half-way with the exception escaping.
    shape = SHAPES[2]
    tensors = _tensors(*shape, seed=3)
    layer = _layer(shape, tensors, quant_mode="w4a16")
    n = _count_calls(lambda: _prepare(_layer(shape, tensors, quant_mode="w4a16")))
    with pytest.raises(Interrupt), RaiseAtCall(n // 2):
        _prepare(layer)
    state = layer.weight_prep_state
    assert state.status is PrepStatus.PREPARING
    with FailAtCall(k):
        layer.quant_method.restore_load_layout(layer)
    assert state.status is PrepStatus.LOADING
    assert state.torn and "restoring the load layout failed" in state.torn_reason
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)
    _load_through_loader(layer, tensors)  # a complete reload
    _assert_same(
        _snapshot(_prepare(layer)),
        _snapshot(_prepare(_layer(shape, tensors, quant_mode="w4a16"))),
    )
