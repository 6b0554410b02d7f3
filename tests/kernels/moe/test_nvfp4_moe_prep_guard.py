# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prepared layer against the idioms loaders use (``param.data``, state
dicts, copies), failed and partial reloads, threads and bad forward inputs:
never a silently wrong layer, never a stuck one."""

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    CAP,
    SHAPE_IDS,
    SHAPES,
    Interrupt,
    RaiseAtCall,
    _assert_same,
    _io,
    _layer,
    _load_through_loader,
    _prepare,
    _snapshot,
    _tensors,
)
from tests.kernels.moe.utils import (
    bf16_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
    split_cat_halves,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a4 import (
    B12xW4A4Weights,
)
from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)

UNPADDED = SHAPES[2]  # E4_H256_I128: swizzled scales have the linear shapes
MODES = ["alpha", "fold"]
#: W4A4 (the swizzled layout) and W4A16 (FlashInfer's packed one, whose
#: kernel views are int32 views of the uint8 parameters): copies, saves and
#: state dicts of either must work alike.
QUANT_MODES = ["w4a4", "w4a16"]


def _fresh(shape, tensors, **kwargs):
    return _prepare(_layer(shape, tensors, **kwargs))


def _mixed(old, new, experts, keys=None):
    """``old`` with ``new``'s tensors of ``experts`` (only ``keys``)."""
    out = {k: v.clone() for k, v in old.items()}
    for k in keys or out:
        for e in experts:
            out[k][e] = new[k][e]
    return out


# --- item 3: partial reload with differing w1/w3 global scales ----------------


def _tensors_differing(shape, seed):
    e, h, i, gated = shape
    w1, w2 = bf16_experts(e, i, h, gated=gated, seed=seed)
    w1[:, :i] *= 1.37  # gate larger than up: their global scales differ
    return quantize_experts_modelopt(w1, w2, gated=gated, shared_w13_scale=False)


@pytest.mark.parametrize("mode", MODES)
def test_partial_reload_with_differing_gate_up_scales_is_exact(mode):
    shape = SHAPES[0]
    old, new = _tensors_differing(shape, 1), _tensors_differing(shape, 2)
    s2 = old["w13_weight_scale_2"]
    assert not torch.equal(s2[:, 0], s2[:, 1])
    layer = _fresh(shape, old, global_scale_mode=mode)
    # Only expert 1's w13 weight and block scales (its global scales stay).
    i = shape[2]
    params = dict(layer.named_parameters())
    for shard, rows in (("w1", slice(0, i)), ("w3", slice(i, 2 * i))):
        for name in ("w13_weight", "w13_weight_scale"):
            layer.weight_loader(params[name], new[name][1, rows], name, shard, 1)
    want = _fresh(
        shape,
        _mixed(old, new, [1], ["w13_weight", "w13_weight_scale"]),
        global_scale_mode=mode,
    )
    _assert_same(_snapshot(_prepare(layer)), _snapshot(want))


# --- item 4: threads ----------------------------------------------------------


class PauseAtCall(TorchFunctionMode):
    """At the ``k``-th torch call of this thread: say so, wait for ``go``."""

    def __init__(self, k, started, go):
        super().__init__()
        self.k, self.calls, self.started, self.go = k, 0, started, go

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if self.calls == self.k:
            self.started.set()
            self.go.wait(30)
        return func(*args, **(kwargs or {}))


def _run_paused(first, second, k=40):
    """Run ``first`` in a thread paused at its k-th torch call; meanwhile run
    ``second`` in another thread. Returns (second finished while first was
    paused, errors, second's result)."""
    started, go = threading.Event(), threading.Event()
    errors, result = [], []

    def a():
        try:
            with PauseAtCall(k, started, go):
                first()
        except BaseException as e:  # noqa: BLE001
            errors.append(("first", e))

    def b():
        try:
            result.append(second())
        except BaseException as e:  # noqa: BLE001
            errors.append(("second", e))

    ta = threading.Thread(target=a)
    ta.start()
    assert started.wait(30)
    tb = threading.Thread(target=b)
    tb.start()
    tb.join(1.0)
    early = not tb.is_alive()
    go.set()
    ta.join(60)
    tb.join(60)
    return early, errors, result


def test_a_second_preparation_waits_for_the_first():
    shape = SHAPES[0]
    tensors = _tensors(*shape, seed=3)
    want = _snapshot(_fresh(shape, tensors))
    layer = _layer(shape, tensors)
    early, errors, _ = _run_paused(lambda: _prepare(layer), lambda: _prepare(layer))
    assert not early  # it waited for the layer's lock
    assert errors == []
    _assert_same(_snapshot(layer), want)


def test_forward_during_a_reload_waits_then_refuses():
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    new = _tensors(*shape, seed=2)
    params = dict(layer.named_parameters())
    x, logits = _io(shape)

    def reload_one():  # restores the layout (many torch calls), then writes
        layer.weight_loader(params["w2_weight"], new["w2_weight"][0], "w", "w2", 0)

    early, errors, result = _run_paused(reload_one, lambda: layer(x, logits))
    assert not early
    assert [(who, type(e)) for who, e in errors] == [("second", RuntimeError)]
    assert "load layout" in str(errors[0][1])


@pytest.mark.parametrize("trial", range(12))
def test_threads_preparing_reloading_and_running_never_give_a_wrong_layer(trial):
    # Real threads, no pauses: 3 threads prepare, 1 reloads, 2 run forward.
    # Every forward sees the old or the new layer, never a mix.
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    x, logits = _io(shape)
    out_old = _fresh(shape, old)(x, logits)
    want_new = _fresh(shape, new)
    out_new = want_new(x, logits)
    layer = _layer(shape, old)
    barrier = threading.Barrier(6)
    errors, outs = [], []

    def run(fn):
        barrier.wait()
        try:
            fn()
        except RuntimeError as e:  # forward refused while not prepared: fine
            if "process_weights_after_loading" not in str(e):
                errors.append(e)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def forward():
        for _ in range(3):
            outs.append(layer(x, logits))

    def reload():  # a whole reload under the layer's lock, as a loader does
        with layer.loading_weights():
            _load_through_loader(layer, new)

    jobs = [lambda: _prepare(layer)] * 3 + [reload] + [forward] * 2
    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    for out in outs:
        assert torch.equal(out, out_old) or torch.equal(out, out_new)
    _prepare(layer)  # always preparable afterwards, to the new weights
    _assert_same(_snapshot(layer), _snapshot(want_new))


# --- item 6: forward inputs ---------------------------------------------------


def test_forward_checks_its_inputs():
    shape = SHAPES[0]
    e, h = shape[0], shape[1]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    x, logits = _io(shape)
    t = x.shape[0]
    for bad in (logits[:, : e - 1], torch.randn(t, e + 1), logits[:-1]):
        with pytest.raises(ValueError, match=r"router_logits must be \[T, 3\]"):
            layer(x, bad)
    with pytest.raises(ValueError, match=rf"hidden_states must be \[T, {h}\]"):
        layer(torch.randn(t, h + 16).bfloat16(), logits)
    with pytest.raises(TypeError, match="hidden_states must be floating"):
        layer(torch.ones(t, h, dtype=torch.int32), logits)
    with pytest.raises(TypeError, match="router_logits must be floating"):
        layer(x, torch.ones(t, e, dtype=torch.int64))
    layer(x, logits)  # the right shapes still run


# --- item 7: a failed reload tears the layer ------------------------------------


def test_failed_reload_is_all_or_nothing():
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    bad = {k: v.clone() for k, v in new.items()}
    bad["w2_weight_scale_2"][2] = float("nan")  # the last expert's, loaded last
    layer = _fresh(shape, old)
    with pytest.raises(ValueError, match="w2_weight_scale_2 of expert 2 is nan"):
        _load_through_loader(layer, bad)
    with pytest.raises(RuntimeError, match=r"torn \(a reload failed at w2_weight_"):
        _prepare(layer)  # experts 0, 1 new, expert 2 half old: refused
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(*_io(shape))
    _load_through_loader(layer, new, experts=[0, 1])  # still incomplete
    with pytest.raises(RuntimeError, match=r"torn.*local experts \[2\]"):
        _prepare(layer)
    _load_through_loader(layer, new)  # complete
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


def _load_only(layer, tensors, names, shards=("w1", "w3")):
    """Load only the parameters ``names`` of every expert through the layer's
    weight_loader (of w13, only the ``shards``)."""
    i = layer.moe_config.intermediate_size_per_partition
    e = layer.global_num_experts
    params = dict(layer.named_parameters())
    for ex in range(e):
        for name in names:
            t = tensors[name]
            if not name.startswith("w13_"):
                layer.weight_loader(params[name], t[ex], name, "w2", ex)
                continue
            for g, shard in enumerate(("w1", "w3")):
                if shard not in shards:
                    continue
                if name.endswith(("_weight", "_weight_scale")):
                    value = t[ex, g * i : (g + 1) * i]
                else:
                    value = t.reshape(e, -1)[ex, g]
                layer.weight_loader(params[name], value, name, shard, ex)


def test_a_torn_layer_needs_every_slot_of_every_required_parameter_back():
    # Torn by a failed reload: every (expert, shard) of weight, weight_scale
    # and weight_scale_2 must be written again. One parameter written whole
    # clears its own slots only; without the global scales it is not whole.
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    bad = {k: v.clone() for k, v in new.items()}
    bad["w2_weight_scale_2"][2] = float("nan")
    layer = _fresh(shape, old)
    with pytest.raises(ValueError, match="is nan"):
        _load_through_loader(layer, bad)
    _load_only(layer, new, ["w2_weight"])
    with pytest.raises(RuntimeError, match=r"torn.*w13_weight of local experts"):
        _prepare(layer)
    # One shard's rows clear that shard's slots, not the other's.
    _load_only(layer, new, ["w13_weight"], shards=("w1",))
    with pytest.raises(RuntimeError, match="torn") as err:
        _prepare(layer)
    assert "w13_weight of local experts [0, 1, 2]" in str(err.value)
    assert "w2_weight of" not in str(err.value)
    _load_only(layer, new, ["w13_weight", "w13_weight_scale", "w2_weight_scale"])
    with pytest.raises(RuntimeError, match=r"torn") as err:
        _prepare(layer)
    for name in ("w13_weight_scale_2", "w2_weight_scale_2"):
        assert f"{name} of local experts [0, 1, 2]" in str(err.value)
    _load_only(layer, new, ["w13_weight_scale_2", "w2_weight_scale_2"])
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


def test_failure_before_any_write_keeps_the_prepared_layer():
    shape = SHAPES[0]
    old = _tensors(*shape, seed=1)
    layer = _fresh(shape, old)
    with pytest.raises(ValueError, match="finite and positive"):
        layer.weight_loader(
            layer.w2_weight_scale_2,
            torch.tensor(float("nan")),
            "w2.weight_scale_2",
            "w2",
            0,
        )
    assert layer.weight_prep_state.status is PrepStatus.PREPARED
    _assert_same(_snapshot(layer), _snapshot(_fresh(shape, old)))


# --- item 8: a reload from any state ------------------------------------------


def test_reload_after_a_failed_preparation():
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _layer(shape, old, global_scale_mode="fold")
    layer.quant_method.experts_kwargs["max_transient_bytes"] = 2048  # fold refuses
    with pytest.raises(ValueError, match="max_transient_bytes"):
        _prepare(layer)
    # A partial reload: no re-run of the failing preparation, and the
    # experts not reloaded keep their bytes (the layer is not torn).
    _load_through_loader(layer, new, experts=[1])
    layer.quant_method.experts_kwargs["max_transient_bytes"] = CAP
    want = _fresh(shape, _mixed(old, new, [1]), global_scale_mode="fold")
    _assert_same(_snapshot(_prepare(layer)), _snapshot(want))


def test_reload_after_converting_a_prepared_layer():
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _fresh(shape, old)
    layer.to(torch.bfloat16)  # FP8 and float32 scales become BF16
    with pytest.raises(RuntimeError, match="replaced"):
        layer(*_io(shape))
    _load_through_loader(layer, new, experts=[0])
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    with pytest.raises(RuntimeError, match=r"torn.*local experts \[1, 2\]"):
        _prepare(layer)  # the bytes of experts 1, 2 are gone
    _load_through_loader(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


# --- tests the mutants showed missing -------------------------------------------


def test_interrupted_restore_then_preparation_gives_the_same_layer():
    shape = SHAPES[0]
    tensors = _tensors(*shape, seed=3)
    want = _snapshot(_fresh(shape, tensors))
    layer = _fresh(shape, tensors)
    with RaiseAtCall() as counter:
        layer.quant_method.restore_load_layout(layer)
    for k in range(1, counter.calls + 1, 2):
        layer = _fresh(shape, tensors)
        with pytest.raises(Interrupt), RaiseAtCall(k):
            layer.quant_method.restore_load_layout(layer)
        _assert_same(_snapshot(_prepare(layer)), want)


def test_interrupted_preparation_then_partial_reload():
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=3), _tensors(*shape, seed=4)
    want = _snapshot(_fresh(shape, _mixed(old, new, [1])))
    layer = _layer(shape, old)
    with RaiseAtCall() as counter:
        _prepare(layer)
    for k in range(1, counter.calls + 1, 5):
        layer = _layer(shape, old)
        with pytest.raises(Interrupt), RaiseAtCall(k):
            _prepare(layer)
        _load_through_loader(layer, new, experts=[1])
        _assert_same(_snapshot(_prepare(layer)), want)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_partial_reload_at_every_shape(shape):
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    last = shape[0] - 1
    layer = _fresh(shape, old)
    _load_through_loader(layer, new, experts=[last])
    _assert_same(
        _snapshot(_prepare(layer)), _snapshot(_fresh(shape, _mixed(old, new, [last])))
    )


def test_scale_replaced_without_recorded_room_then_prepared():
    shape = SHAPES[0]  # padded: the swizzle needs a new tensor
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _layer(shape, old)
    layer.w2_weight_scale.data = layer.w2_weight_scale.data.clone()  # no room
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, old)))
    _load_through_loader(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


def test_emulation_quantizes_each_experts_input_with_its_fc1_input_scale():
    shape = SHAPES[0]
    e, h, i, gated = shape
    layer = make_nvfp4_layer(
        e, 2, h, i, gated, "flashinfer_b12x_emulated", max_transient_bytes=CAP
    )  # W4A4: inputs quantized
    load_nvfp4_experts(layer, _tensors(*shape, seed=1))
    _prepare(layer)
    x, logits = _io(shape)
    base = layer(x, logits)
    kernel = layer.quant_method.experts.prepared
    # Powers of two scale the FP8 block scales exactly: the same output.
    kernel.fc1_input_scale.copy_(torch.tensor([4.0, 0.5, 2.0]))
    assert torch.equal(layer(x, logits), base)
    # 3 for expert 2 only: exactly the tokens routed to expert 2 change.
    kernel.fc1_input_scale.copy_(torch.tensor([1.0, 1.0, 3.0]))
    out = layer(x, logits)
    _, ids = fused_topk(x, logits, 2, True)
    routed = (ids == 2).any(dim=1)
    assert 0 < int(routed.sum()) < x.shape[0]
    assert torch.equal(out[~routed], base[~routed])
    assert not torch.equal(out[routed], base[routed])


def test_reorder_takes_weight_and_scale_adjacent_in_one_buffer():
    # The overlap check's boundary: the scale starting at the weight's last
    # byte + 1 is accepted (and only their own bytes move); one byte
    # earlier is refused.
    gen = torch.Generator().manual_seed(12)
    n_w, n_s = 2 * 8 * 16, 2 * 8 * 2
    buf = torch.randint(0, 256, (n_w + n_s + 4,), dtype=torch.uint8, generator=gen)
    orig = buf.clone()
    w, s = buf[:n_w].view(2, 8, 16), buf[n_w : n_w + n_s].view(2, 8, 2)
    reorder_w1w3_to_w3w1(w, s, max_transient_bytes=256)
    assert torch.equal(w, split_cat_halves(orig[:n_w].view(2, 8, 16), -2))
    assert torch.equal(s, split_cat_halves(orig[n_w : n_w + n_s].view(2, 8, 2), -2))
    assert torch.equal(buf[n_w + n_s :], orig[n_w + n_s :])
    overlapping = buf[n_w - 1 : n_w - 1 + n_s].view(2, 8, 2)
    with pytest.raises(ValueError, match="must not share memory"):
        reorder_w1w3_to_w3w1(w, overlapping, max_transient_bytes=256)


def test_reset_never_reuses_a_foreign_storage_for_a_block_scale():
    # A prepared block scale replaced (param.data = ...) by a view, at an
    # offset, of a buffer that is someone else's: the reset that follows
    # gives it new storage; the reload writes none of the buffer's bytes.
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _fresh(shape, old)
    param = layer.w13_weight_scale
    n = param.numel()
    buf = torch.full((n + 4096,), 0x5A, dtype=torch.uint8)
    view = buf[64 : 64 + n].view(torch.float8_e4m3fn).view(param.shape)
    view.copy_(param.detach())
    param.data = view
    before = buf.clone()
    layer.quant_method.restore_load_layout(layer)  # replaced: torn, reset
    assert layer.weight_prep_state.torn
    scale = layer.w13_weight_scale
    assert scale.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    _load_through_loader(layer, new)
    assert torch.equal(buf, before)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_interrupted_re_preparation_resumes_to_the_same_layer(quant_mode):
    # A preparation after a reload, interrupted anywhere (in a step, the
    # binding or the record): the retry finishes it. The record of the first
    # preparation describes bytes the second one rewrote; it must not make
    # the retry refuse them as modified in place.
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    kwargs = {"quant_mode": quant_mode}
    fresh = _fresh(shape, new, **kwargs)
    want, x, logits = _snapshot(fresh), *_io(shape)
    out = fresh(x, logits)
    layer = _fresh(shape, old, **kwargs)
    _load_through_loader(layer, new)
    with RaiseAtCall() as counter:
        _prepare(layer)
    for k in [*range(1, counter.calls, 7), counter.calls]:
        layer = _fresh(shape, old, **kwargs)
        _load_through_loader(layer, new)
        with pytest.raises(Interrupt), RaiseAtCall(k):
            _prepare(layer)
        _prepare(layer)  # the retry
        _assert_same(_snapshot(layer), want)
        assert torch.equal(layer(x, logits), out)


def test_an_interrupted_binding_leaves_the_layer_unrecorded(monkeypatch):
    # The guard records a prepared layer only when its block ends normally:
    # an interrupt in the binding leaves apply refusing and the retry binds.
    shape = UNPADDED
    tensors = _tensors(*shape, seed=1)
    want = _snapshot(_fresh(shape, tensors))
    layer = _layer(shape, tensors)

    def interrupted(*args, **kwargs):
        raise Interrupt("in the binding")

    monkeypatch.setattr(B12xW4A4Weights, "bind", interrupted)
    with pytest.raises(Interrupt):
        _prepare(layer)
    state = layer.weight_prep_state
    assert state.status is PrepStatus.PREPARED
    assert not state.ready and not state.fingerprints
    with pytest.raises(RuntimeError, match="process_weights_after_loading"):
        layer(*_io(shape))
    monkeypatch.undo()
    _assert_same(_snapshot(_prepare(layer)), want)
    assert state.ready


def test_the_experts_w4a4_fields_read_the_binding():
    # w1_sf_mma, w2_sf_mma and _fc2_input_scale (what upstream's callers
    # read) are the binding's own tensors, and None once it is dropped.
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    experts = layer.quant_method.moe_kernel.fused_experts
    bound = experts.prepared
    assert bound.fc1_input_scale is not None and bound.fc2_input_scale is not None
    assert experts.w1_sf_mma is bound.w1_sf_mma
    assert experts.w2_sf_mma is bound.w2_sf_mma
    assert experts._fc2_input_scale is bound.fc2_input_scale
    experts.drop_prepared()
    assert experts.w1_sf_mma is None and experts._fc2_input_scale is None


def test_restoring_a_converted_unprepared_layer_resets_it():
    # Never prepared, then converted (layer.to): the restore gives the
    # parameters the load layout's dtypes again, torn, so the reload that
    # follows is a complete one.
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _layer(shape, old)
    layer.to(torch.bfloat16)
    layer.quant_method.restore_load_layout(layer)
    assert layer.w13_weight_scale.dtype == torch.float8_e4m3fn
    assert layer.w2_weight_scale_2.dtype == torch.float32
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)
    _load_through_loader(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))
