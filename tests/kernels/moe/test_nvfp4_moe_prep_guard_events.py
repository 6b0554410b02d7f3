# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The guard of a prepared layer at the events that change its weights
(preparation, ``weight_loader``, ``load_state_dict``, weight reload,
``.to()``): a write between the preparation and the next forward is refused
there, with the guard's message, or repaired; ``apply`` checks nothing per
call, so a CUDA-graph-style replay (the kernel's inputs captured once) is
guarded alike."""

import copy

import pytest
import torch

import vllm.model_executor.layers.fused_moe.weight_prep_guard as guard
from tests.kernels.moe.test_nvfp4_moe_prep_guard import (
    QUANT_MODES,
    UNPADDED,
    _fresh,
    _mixed,
)
from tests.kernels.moe.test_nvfp4_moe_prep_guard_loaders import (
    _load_through_param_loaders,
    _with_vllm_style_loaders,
)
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
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
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_emulated import (
    _local_routes,
)
from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.model_loader.reload.prepared_layers import (
    begin_prepared_reload,
    check_prepared_reload,
    finish_prepared_reload,
)

#: The guard's refusal, as the per-call check gave it: every event gives it.
GUARD = (
    r"parameters of a prepared MoE layer were modified in place or replaced "
    r"after its preparation \("
)
NOT_PREPARED = "process_weights_after_loading"


class _Count:
    """Counts the calls of one function of the guard module."""

    def __init__(self, monkeypatch, name):
        self.calls, fn = 0, getattr(guard, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(guard, name, counted)


def _capture(layer):
    """What a CUDA graph captured at a first call holds: the experts and the
    very tensors the kernel reads (addresses), never looked up again."""
    experts = layer.quant_method.experts
    return experts, experts.prepared, layer.w13_weight.data, layer.w2_weight.data


def _replay(captured, layer, x, logits):
    """The kernel's computation on the captured tensors, no Python guard on
    the way (as a graph replay): the emulation's own arithmetic."""
    experts, binding, w1, w2 = captured
    topk_weights, topk_ids = fused_topk(x, logits, layer.top_k, layer.renormalize)
    routes = _local_routes(topk_ids, topk_weights, None)
    current, experts.prepared = experts.prepared, binding
    try:
        if experts.weight_only:
            return experts._emulate_w4a16(x, routes)
        return experts._emulate_w4a4(x, w1, w2, routes)
    finally:
        experts.prepared = current


# --- apply: one flag test per call ----------------------------------------------


@pytest.mark.parametrize("verify", ["0", "1"])
@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_apply_checks_nothing_per_call(quant_mode, verify, monkeypatch):
    # The work counted, not timed: no parameter walk and no checksum per
    # call, in the verify mode too; the checksums run at the events (one
    # per parameter at the preparation and at a re-preparation).
    monkeypatch.setenv("VLLM_MOE_PREP_VERIFY", verify)
    walks = _Count(monkeypatch, "changed_parameters")
    sums = _Count(monkeypatch, "weight_checksum")
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    n_params = len(list(layer.parameters()))
    assert sums.calls == (n_params if verify == "1" else 0)
    x, logits = _io(shape)
    walks.calls = sums.calls = 0
    want = layer(x, logits)
    for _ in range(20):
        assert torch.equal(layer(x, logits), want)
    assert (walks.calls, sums.calls) == (0, 0)
    _prepare(layer)  # an event: checked once
    assert walks.calls == 1
    assert sums.calls == (n_params if verify == "1" else 0)


def test_an_event_costs_one_check_at_the_next_apply(monkeypatch):
    walks = _Count(monkeypatch, "changed_parameters")
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    x, logits = _io(shape)
    want = layer(x, logits)
    layer.to("cpu")  # an event that changes nothing
    walks.calls = 0
    for _ in range(5):
        assert torch.equal(layer(x, logits), want)
    assert walks.calls == 1


# --- preparation and re-preparation -------------------------------------------


@pytest.mark.parametrize("name", ["w13_weight_scale", "w2_weight"])
def test_a_view_with_other_strides_is_refused_at_the_preparation(name):
    # param.data = a view of the same storage at the same offset, same shape
    # and dtype, sharing the version counter: only the strides tell it
    # (here every expert reads expert 0's bytes).
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    param = getattr(layer, name)
    strides = (0, *param.data.stride()[1:])
    param.data = param.data.as_strided(param.shape, strides, param.storage_offset())
    with pytest.raises(RuntimeError, match=rf"{GUARD}{name} replaced"):
        _prepare(layer)
    with pytest.raises(RuntimeError, match=rf"{GUARD}{name} replaced"):
        layer(*_io(shape))  # refused from the event on


@pytest.mark.parametrize("name", ["w2_weight", "w13_weight_scale"])
def test_data_assignment_is_refused_at_the_preparation(name):
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    param = getattr(layer, name)
    param.data = param.data.clone()  # same bytes, new storage: views are stale
    with pytest.raises(RuntimeError, match=rf"{GUARD}{name} replaced"):
        _prepare(layer)
    with pytest.raises(RuntimeError, match=rf"{GUARD}{name} replaced"):
        layer(*_io(shape))


def test_an_in_place_write_is_refused_at_the_preparation():
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    with torch.no_grad():
        layer.w2_weight.add_(1)  # the version counter moves
    with pytest.raises(RuntimeError, match=rf"{GUARD}w2_weight modified in place"):
        _prepare(layer)
    with pytest.raises(RuntimeError, match=rf"{GUARD}w2_weight modified in place"):
        layer(*_io(shape))


def test_verify_mode_sees_a_permutation_of_the_bytes_at_the_preparation(monkeypatch):
    # The same bytes in another order (experts rolled by one: the same sum)
    # through param.data (no version bump): the opt-in checksum sees it.
    monkeypatch.setenv("VLLM_MOE_PREP_VERIFY", "1")
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    data = layer.w2_weight.data
    rolled = data.roll(1, dims=0)
    assert not torch.equal(rolled, data)
    data.copy_(rolled)
    with pytest.raises(RuntimeError, match=rf"{GUARD}w2_weight modified.*bytes"):
        _prepare(layer)


def test_verify_mode_sees_a_data_copy_then_a_reload_repairs(monkeypatch):
    monkeypatch.setenv("VLLM_MOE_PREP_VERIFY", "1")
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    new = _tensors(*shape, seed=2)
    version = layer.w13_weight._version
    layer.w13_weight.data.copy_(new["w13_weight"])  # checkpoint layout
    assert layer.w13_weight._version == version  # invisible to the counter
    with pytest.raises(RuntimeError, match=rf"{GUARD}w13_weight modified.*bytes"):
        _prepare(layer)
    with pytest.raises(RuntimeError, match=rf"{GUARD}w13_weight modified.*bytes"):
        layer(*_io(shape))
    # The way out: a reload through the loader (torn until all of it is
    # written again), then a preparation.
    _load_through_loader(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


# --- weight_loader ------------------------------------------------------------------


def test_a_param_weight_loader_write_is_refused_at_the_write():
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _with_vllm_style_loaders(_layer(shape, old))
    _prepare(layer)
    captured = _capture(layer)
    x, logits = _io(shape)
    i = shape[2]
    loader = layer.w13_weight.weight_loader
    msg = rf"{GUARD}w13_weight written through its weight_loader"
    with pytest.raises(RuntimeError, match=msg):
        loader(layer.w13_weight, new["w13_weight"][0, :i], "w13_weight", "w1", 0)
    with pytest.raises(RuntimeError, match=msg):
        layer(x, logits)
    # Repaired by a reload: the restore tears the mixed layer, every shard
    # again, the preparation; a direct reload's finish would then give the
    # captured tensors the new values (test_direct_reload_...).
    layer.quant_method.restore_load_layout(layer)
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)
    _load_through_param_loaders(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))
    assert captured[2].data_ptr() == layer.w13_weight.data_ptr()


def test_a_layer_repaired_after_a_loader_write_reloads_exactly_again():
    # The write the reset forgave is not held against the repaired layer: a
    # second preparation is a no-op and the next partial reload is exact
    # (not torn again).
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _prepare(_with_vllm_style_loaders(_layer(shape, old)))
    loader, w1 = layer.w13_weight.weight_loader, new["w13_weight"][0, : shape[2]]
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        loader(layer.w13_weight, w1, "w13_weight", "w1", 0)
    layer.quant_method.restore_load_layout(layer)  # torn
    _load_through_param_loaders(layer, new)
    snap = _snapshot(_prepare(layer))
    _assert_same(_snapshot(_prepare(layer)), snap)
    _load_through_loader(layer, old, experts=[1])
    assert not layer.weight_prep_state.torn
    want = _fresh(shape, _mixed(new, old, [1]))
    _assert_same(_snapshot(_prepare(layer)), _snapshot(want))


def test_a_loader_write_into_an_interrupted_restore_tears_the_layer():
    # The preparation that resumes the restore finds the write: the bytes are
    # a mix of the half-restored layout and the loader's, so the layer is
    # torn (every shard again), never restored and prepared from them.
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _prepare(_with_vllm_style_loaders(_layer(shape, old)))
    with RaiseAtCall() as counter:
        layer.quant_method.restore_load_layout(layer)
    layer = _prepare(_with_vllm_style_loaders(_layer(shape, old)))
    with pytest.raises(Interrupt), RaiseAtCall(counter.calls // 2):
        layer.quant_method.restore_load_layout(layer)
    assert layer.weight_prep_state.status is PrepStatus.RESTORING
    loader, w1 = layer.w13_weight.weight_loader, new["w13_weight"][0, : shape[2]]
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        loader(layer.w13_weight, w1, "w13_weight", "w1", 0)
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)
    _load_through_param_loaders(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


def test_direct_reload_accepts_an_interrupted_re_preparation():
    # Interrupted after a reload, in its steps: what the record saw is no
    # write (the first preparation's record describes other bytes), so a
    # direct reload brings it back and prepares the new weights.
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _fresh(shape, old)
    _load_through_loader(layer, new)
    with RaiseAtCall() as counter:
        _prepare(_layer(shape, new))
    with pytest.raises(Interrupt), RaiseAtCall(counter.calls // 2):
        _prepare(layer)
    assert layer.weight_prep_state.status is PrepStatus.PREPARING
    model = _model(layer)
    check_prepared_reload(model)
    assert begin_prepared_reload(model, direct=True) == 1
    _load_through_loader(layer, old)
    _prepare(layer)
    finish_prepared_reload(model)
    _assert_same(_snapshot(layer), _snapshot(_fresh(shape, old)))


# --- load_state_dict ----------------------------------------------------------------


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_load_state_dict_repairs_a_written_layer_and_a_captured_graph(quant_mode):
    # A prepared state dict into a prepared layer written behind its back:
    # the bytes are copied in place and the derived tensors refilled, so
    # the tensors a graph captured hold the state dict's layer.
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    other = _fresh(shape, _tensors(*shape, seed=2), quant_mode=quant_mode)
    x, logits = _io(shape)
    captured = _capture(layer)
    before = _replay(captured, layer, x, logits)
    want = _replay(_capture(other), other, x, logits)
    assert not torch.equal(before, want)  # control: the layers differ
    with torch.no_grad():
        layer.w2_weight.add_(1)
    layer.load_state_dict(other.state_dict())
    _assert_same(_snapshot(layer), _snapshot(other))
    assert torch.equal(layer(x, logits), other(x, logits))
    assert torch.equal(_replay(captured, layer, x, logits), want)


def test_a_checkpoint_state_dict_into_a_prepared_layer_needs_a_preparation():
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    source = _layer(shape, _tensors(*shape, seed=2))  # load layout
    layer.load_state_dict(source.state_dict())
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    with pytest.raises(RuntimeError, match=NOT_PREPARED):
        layer(*_io(shape))


# --- weight reload (direct and layerwise) -------------------------------------


def _model(layer):
    return torch.nn.ModuleDict({"experts": layer})


def test_direct_reload_refuses_a_written_layer_before_any_byte_changes():
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    with torch.no_grad():
        layer.w2_weight.add_(1)
    snap = _snapshot(layer)
    with pytest.raises(
        RuntimeError, match=rf"direct reload: experts: {GUARD}w2_weight modified"
    ):
        check_prepared_reload(_model(layer))
    assert layer.weight_prep_state.status is PrepStatus.PREPARED
    _assert_same(_snapshot(layer), snap)


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_direct_reload_repairs_a_captured_graph(quant_mode):
    shape = UNPADDED
    new = _tensors(*shape, seed=2)
    layer = _fresh(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    fresh = _fresh(shape, new, quant_mode=quant_mode)
    x, logits = _io(shape)
    captured = _capture(layer)
    want = _replay(_capture(fresh), fresh, x, logits)
    assert not torch.equal(_replay(captured, layer, x, logits), want)
    model = _model(layer)
    check_prepared_reload(model)
    assert begin_prepared_reload(model, direct=True) == 1
    with pytest.raises(RuntimeError, match=NOT_PREPARED):
        layer(x, logits)  # between begin and finish
    _load_through_loader(layer, new)
    _prepare(layer)
    assert finish_prepared_reload(model) == 1
    assert torch.equal(_replay(captured, layer, x, logits), want)
    assert torch.equal(layer(x, logits), fresh(x, logits))


def test_layerwise_reload_refuses_apply_until_its_finish():
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    x, logits = _io(shape)
    want = layer(x, logits)
    model = _model(layer)
    assert begin_prepared_reload(model, direct=False) == 1
    with pytest.raises(RuntimeError, match=NOT_PREPARED):
        layer(x, logits)
    # Nothing was loaded: the finish gives the layer its record back.
    finish_prepared_reload(model)
    assert torch.equal(layer(x, logits), want)


# --- .to() ---------------------------------------------------------------------


def test_a_conversion_is_refused_at_the_next_apply():
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1))
    layer.to(torch.float64)  # the float scales become new float64 tensors
    with pytest.raises(RuntimeError, match=rf"{GUARD}w13_weight_scale replaced"):
        layer(*_io(shape))
    with pytest.raises(RuntimeError, match=rf"{GUARD}w13_weight_scale replaced"):
        _prepare(layer)


# --- inference mode -------------------------------------------------------------


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_a_layer_made_and_prepared_in_inference_mode(quant_mode):
    # Inference tensors have no version counter (reading it raises): the
    # guard fingerprints them without it and still refuses at the events.
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    want = _fresh(shape, old, quant_mode=quant_mode)
    x, logits = _io(shape)
    with torch.inference_mode():
        layer = _fresh(shape, old, quant_mode=quant_mode)
        assert layer.w13_weight.is_inference()
        assert torch.equal(layer(x, logits), want(x, logits))
        _prepare(layer)  # a no-op
        _assert_same(_snapshot(layer), _snapshot(want))
        layer.w2_weight.data = layer.w2_weight.data.clone()
        with pytest.raises(RuntimeError, match=rf"{GUARD}w2_weight replaced"):
            _prepare(layer)
        _load_through_loader(layer, new)
        _prepare(layer)
    _assert_same(_snapshot(layer), _snapshot(_fresh(shape, new, quant_mode=quant_mode)))


def test_a_copy_made_in_inference_mode_runs():
    shape = UNPADDED
    with torch.inference_mode():
        layer = _fresh(shape, _tensors(*shape, seed=1))
        twin = copy.deepcopy(layer)
        x, logits = _io(shape)
        assert torch.equal(twin(x, logits), layer(x, logits))
