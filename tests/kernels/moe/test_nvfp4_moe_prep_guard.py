# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prepared layer against the idioms loaders use (``param.data``, state
dicts, copies), failed and partial reloads, threads and bad forward inputs:
never a silently wrong layer, never a stuck one."""

import copy
import io
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
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk
from vllm.model_executor.layers.fused_moe.weight_prep_guard import weight_checksum
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


# --- item 2: the guard against the loaders' idioms ---------------------------


@pytest.mark.parametrize("name", ["w13_weight_scale", "w2_weight"])
def test_a_view_with_other_strides_is_seen_as_replaced(name):
    # param.data = a view of the same storage at the same offset, same shape
    # and dtype, sharing the version counter: only the strides tell it
    # (here every expert reads expert 0's bytes, as .t() of a square tensor
    # would read them transposed).
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    param = getattr(layer, name)
    strides = (0, *param.data.stride()[1:])
    param.data = param.data.as_strided(param.shape, strides, param.storage_offset())
    with pytest.raises(RuntimeError, match=rf"{name} replaced"):
        layer(*_io(shape))


def test_the_checksum_sees_a_permutation_of_the_bytes(monkeypatch):
    # The same bytes in another order (experts rolled by one: the same sum)
    # through param.data (no version bump): the opt-in checksum sees it.
    monkeypatch.setenv("VLLM_MOE_PREP_VERIFY", "1")
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    data = layer.w2_weight.data
    rolled = data.roll(1, dims=0)
    assert not torch.equal(rolled, data)
    data.copy_(rolled)
    with pytest.raises(RuntimeError, match=r"w2_weight modified in place.*bytes"):
        layer(*_io(shape))


def test_the_checksum_sees_rows_of_a_power_of_two_size_swapped():
    # Weights' rows are powers of two bytes long: position weights with a
    # period of 2^16 would give two 64 KiB rows the same weights, so their
    # swap would keep the checksum (the prime modulus does not).
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (2, 1 << 16), dtype=torch.uint8, generator=gen)
    assert weight_checksum(rows) != weight_checksum(rows.flip(0))


def test_data_copy_into_a_prepared_layer_is_refused_in_verify_mode(monkeypatch):
    # param.data.copy_ does not move the version counter: only the checksum
    # (VLLM_MOE_PREP_VERIFY=1) sees it.
    monkeypatch.setenv("VLLM_MOE_PREP_VERIFY", "1")
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    new = _tensors(*shape, seed=2)
    version = layer.w13_weight._version
    layer.w13_weight.data.copy_(new["w13_weight"])  # checkpoint layout
    assert layer.w13_weight._version == version  # invisible to the counter
    with pytest.raises(RuntimeError, match=r"w13_weight modified in place.*bytes"):
        layer(*_io(shape))
    with pytest.raises(RuntimeError, match="modified in place"):
        _prepare(layer)
    # The way out: a reload through the loader (the layer is torn until all
    # of it is written again), then a preparation.
    _load_through_loader(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


@pytest.mark.parametrize("name", ["w2_weight", "w13_weight_scale"])
def test_data_assignment_on_a_prepared_layer_is_refused(name):
    shape = SHAPES[0]
    layer = _fresh(shape, _tensors(*shape, seed=1))
    param = getattr(layer, name)
    param.data = param.data.clone()  # same bytes, new storage: views are stale
    with pytest.raises(RuntimeError, match=rf"{name} replaced"):
        layer(*_io(shape))
    with pytest.raises(RuntimeError, match=rf"{name} replaced"):
        _prepare(layer)


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_prepared_state_dict_loads_only_into_a_prepared_layer(quant_mode):
    shape = UNPADDED  # shapes equal: only the layout can tell them apart
    tensors = _tensors(*shape, seed=1)
    prepared = _fresh(shape, tensors, quant_mode=quant_mode)
    sd = prepared.state_dict()
    assert sd["_extra_state"]["status"] == "prepared"
    fresh = _layer(shape, _tensors(*shape, seed=2), quant_mode=quant_mode)
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with pytest.raises(
        RuntimeError, match="prepared state dict loads only into a prepared layer"
    ):
        fresh.load_state_dict(sd)
    for n, p in fresh.named_parameters():  # nothing written
        assert torch.equal(
            p.view(torch.uint8) if p.dtype.itemsize == 1 else p,
            before[n].view(torch.uint8) if p.dtype.itemsize == 1 else before[n],
        ), n
    # Into a prepared layer: the same bytes, views and forward.
    _prepare(fresh)
    fresh.load_state_dict(sd)
    _assert_same(_snapshot(fresh), _snapshot(prepared))
    x, logits = _io(shape)
    assert torch.equal(fresh(x, logits), prepared(x, logits))
    # Without the layout, a state dict is refused whatever the layer.
    del sd["_extra_state"]
    with pytest.raises(RuntimeError, match="no preparation layout"):
        fresh.load_state_dict(sd, strict=False)


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
def test_loading_state_dict_into_a_prepared_layer_reloads_it(quant_mode):
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    # checkpoint layout, not prepared
    source = _layer(shape, new, quant_mode=quant_mode)
    layer = _fresh(shape, old, quant_mode=quant_mode)
    layer.load_state_dict(source.state_dict())
    assert layer.weight_prep_state.status is PrepStatus.LOADING
    want = _snapshot(_fresh(shape, new, quant_mode=quant_mode))
    _assert_same(_snapshot(_prepare(layer)), want)


def test_restore_then_checkpoint_layout_copy_is_reordered():
    # place_w3w1_at_load=False: the caller copies [w1; w3] itself. After a
    # restore the layer is [w1; w3] again, so the copy lands where it
    # should and the preparation reorders it.
    shape = SHAPES[0]
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _fresh(shape, old)
    layer.quant_method.restore_load_layout(layer)
    load_nvfp4_experts(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


def _copy(layer, how):
    if how == "deepcopy":
        return copy.deepcopy(layer)
    buf = io.BytesIO()
    torch.save(layer, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_faithful_copies_of_a_prepared_layer_work(how, quant_mode):
    shape = SHAPES[0] if quant_mode == "w4a4" else UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _fresh(shape, old, quant_mode=quant_mode)
    twin = _copy(layer, how)
    x, logits = _io(shape)
    assert torch.equal(twin(x, logits), layer(x, logits))
    _assert_same(_snapshot(twin), _snapshot(layer))
    # The copy's kernel views are its own parameters' (not the original's).
    twin_kernel = twin.quant_method.experts.prepared
    first = twin_kernel.w13 if quant_mode == "w4a16" else twin_kernel.w1_sf_mma
    assert first.data_ptr() == twin.w13_weight.data_ptr() or (
        first.data_ptr() == twin.w13_weight_scale.data_ptr()
    )
    # The copy is its own layer: a reload of it leaves the original alone.
    _load_through_loader(twin, new)
    want = _snapshot(_fresh(shape, new, quant_mode=quant_mode))
    _assert_same(_snapshot(_prepare(twin)), want)
    _assert_same(_snapshot(layer), _snapshot(_fresh(shape, old, quant_mode=quant_mode)))


@pytest.mark.parametrize("how", ["deepcopy", "torch.save", "state_dict"])
def test_w4a16_kernel_experts_copy_save_and_take_state_dicts(how):
    # The kernel's experts class (FlashInferB12xExperts; the oracle picks it
    # only where CUDA is, so it is swapped in for the emulation it is the
    # base of) prepares on CPU: only its apply needs the kernel. Its copies,
    # saves and state dicts make the W4A16 views from their own parameters.
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1), quant_mode="w4a16")
    layer.quant_method.experts.__class__ = FlashInferB12xExperts
    if how == "state_dict":
        twin = _fresh(shape, _tensors(*shape, seed=2), quant_mode="w4a16")
        twin.quant_method.experts.__class__ = FlashInferB12xExperts
        twin.load_state_dict(layer.state_dict())
    else:
        twin = _copy(layer, how)
    experts = twin.quant_method.experts
    assert type(experts) is FlashInferB12xExperts
    experts._check_prepared()  # what apply does first
    _assert_same(_snapshot(twin), _snapshot(layer))
    assert experts.prepared.w13.data_ptr() == twin.w13_weight.data_ptr()
    assert experts.prepared.w2_scale.data_ptr() == twin.w2_weight_scale.data_ptr()
    assert experts.prepared.w13.data_ptr() != layer.w13_weight.data_ptr()


@pytest.mark.parametrize("quant_mode", QUANT_MODES)
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_modified_prepared_layer_refuses_like_the_original(how, quant_mode):
    shape = UNPADDED
    layer = _fresh(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    with torch.no_grad():
        layer.w2_weight.add_(1)  # behind the layer's back: counter moves
    x, logits = _io(shape)
    with pytest.raises(RuntimeError, match="w2_weight modified in place"):
        layer(x, logits)
    twin = _copy(layer, how)
    with pytest.raises(RuntimeError, match="modified in place or replaced"):
        twin(x, logits)
    with pytest.raises(RuntimeError, match="modified in place or replaced"):
        _prepare(twin)
    # Control: a copy of the unmodified layer runs.
    clean = _fresh(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    assert torch.equal(_copy(clean, how)(x, logits), clean(x, logits))


class _VllmStyleLoader:
    """A parameter ``weight_loader`` as vLLM's ``RoutedExperts`` sets one:
    it writes the shard straight into ``param.data[expert]`` (no restore of
    the load layout; ``param.data`` moves no version counter). An object,
    as picklable as vLLM's bound method."""

    def __init__(self, layer):
        self.i = layer.moe_config.intermediate_size_per_partition

    def __call__(
        self,
        param,
        loaded_weight,
        weight_name,
        shard_id,
        expert_id,
        return_success=False,
    ):
        dst = param.data[expert_id]
        if weight_name.startswith("w13_"):
            g = 0 if shard_id == "w1" else 1
            dst = dst[g] if dst.dim() == 1 else dst[g * self.i : (g + 1) * self.i]
        dst.copy_(loaded_weight.reshape(dst.shape))
        return True if return_success else None


_vllm_style_loader = _VllmStyleLoader


def _load_through_param_loaders(layer, tensors):
    """Every shard of ModelOpt ``tensors`` through each parameter's own
    ``weight_loader`` attribute, as vLLM's model loader calls it."""
    i = layer.moe_config.intermediate_size_per_partition
    e = layer.global_num_experts
    for name, value in tensors.items():
        param = getattr(layer, name)
        for ex in range(e):
            if name.startswith("w13_"):
                for g, shard in enumerate(("w1", "w3")):
                    if value.dim() == 2:  # a per-shard scalar, [E, 2]
                        part = value[ex, g]
                    else:
                        part = value[ex, g * i : (g + 1) * i]
                    param.weight_loader(param, part, name, shard, ex)
            else:
                param.weight_loader(param, value[ex], name, "w2", ex)


def test_a_param_weight_loader_writing_into_a_prepared_layer_is_refused():
    # vLLM's own loaders (the fork: RoutedExperts' params) write param.data;
    # the version counters cannot see it, so the experts guard the loaders.
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _layer(shape, old)
    for p in layer.parameters():
        p.weight_loader = _vllm_style_loader(layer)
    _prepare(layer)
    x, logits = _io(shape)
    version = layer.w13_weight._version
    i = shape[2]
    layer.w13_weight.weight_loader(
        layer.w13_weight, new["w13_weight"][0, :i], "w13_weight", "w1", 0
    )
    assert layer.w13_weight._version == version  # the counter saw nothing
    with pytest.raises(
        RuntimeError, match="w13_weight written through its weight_loader"
    ):
        layer(x, logits)
    with pytest.raises(RuntimeError, match="weight_loader"):
        _prepare(layer)
    # The way out: the restore (the bytes are mixed: torn), then every shard
    # again through the same loaders, then the preparation.
    layer.quant_method.restore_load_layout(layer)
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)
    _load_through_param_loaders(layer, new)
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))


@pytest.mark.parametrize("how", ["layer", "deepcopy"])
def test_a_param_weight_loader_writing_between_steps_is_refused(how):
    # An interrupted preparation (some steps done), then a write through a
    # vLLM loader into the half-prepared bytes: resuming would finish a mix
    # of layouts, so it is refused and the restore tears the layer; a copy
    # of the layer remembers the write.
    shape = UNPADDED
    layer = _layer(shape, _tensors(*shape, seed=1))
    for p in layer.parameters():
        p.weight_loader = _vllm_style_loader(layer)
    for _, step in layer.quant_method.preparation_steps(layer)[:3]:
        step()
    assert layer.weight_prep_state.status is PrepStatus.PREPARING
    new = _tensors(*shape, seed=2)["w13_weight"][0, : shape[2]]
    layer.w13_weight.weight_loader(layer.w13_weight, new, "w13_weight", "w1", 0)
    if how == "deepcopy":
        layer = copy.deepcopy(layer)
    with pytest.raises(RuntimeError, match="w13_weight written through its weight"):
        _prepare(layer)
    layer.quant_method.restore_load_layout(layer)
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)


def test_restore_then_param_weight_loaders_equal_a_fresh_layer():
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _layer(shape, old)
    for p in layer.parameters():
        p.weight_loader = _vllm_style_loader(layer)
    _prepare(layer)
    layer.quant_method.restore_load_layout(layer)  # before loading: exact
    _load_through_param_loaders(layer, new)
    assert not layer.weight_prep_state.torn
    _assert_same(_snapshot(_prepare(layer)), _snapshot(_fresh(shape, new)))
    # Control: without the new weights the layer is the old one's.
    fresh_old = _snapshot(_fresh(shape, old))
    assert not torch.equal(_snapshot(layer)["w13_weight"], fresh_old["w13_weight"])


def test_a_saved_layers_param_weight_loaders_guard_the_copy():
    # torch.save keeps a parameter's attributes (deepcopy drops them): the
    # copy's loaders are its own, so a write through one is refused by the
    # copy, and the original, untouched, still runs.
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _layer(shape, old)
    for p in layer.parameters():
        p.weight_loader = _vllm_style_loader(layer)
    _prepare(layer)
    x, logits = _io(shape)
    want = layer(x, logits)
    twin = _copy(layer, "torch.save")
    assert twin.w13_weight.weight_loader.layer is twin
    i = shape[2]
    twin.w13_weight.weight_loader(
        twin.w13_weight, new["w13_weight"][0, :i], "w13_weight", "w1", 0
    )
    with pytest.raises(RuntimeError, match="written through its weight_loader"):
        twin(x, logits)
    assert torch.equal(layer(x, logits), want)


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
