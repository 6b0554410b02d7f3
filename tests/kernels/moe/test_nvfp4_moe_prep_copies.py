# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prepared layer's copies (``copy.deepcopy``, ``torch.save``) and state
dicts: the layout travels with the bytes, a copy's views are its own
parameters', and a copy of a layer written behind its back refuses at the
events as the original does."""

import copy
import io

import pytest
import torch

from tests.kernels.moe.test_nvfp4_moe_prep_guard import (
    QUANT_MODES,
    SHAPES,
    UNPADDED,
    _fresh,
)
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    _assert_same,
    _io,
    _layer,
    _load_through_loader,
    _prepare,
    _snapshot,
    _tensors,
)
from tests.kernels.moe.utils import load_nvfp4_experts
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.fused_moe.weight_prep_guard import weight_checksum
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus


def test_the_checksum_sees_rows_of_a_power_of_two_size_swapped():
    # Weights' rows are powers of two bytes long: position weights with a
    # period of 2^16 would give two 64 KiB rows the same weights, so their
    # swap would keep the checksum (the prime modulus does not).
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (2, 1 << 16), dtype=torch.uint8, generator=gen)
    assert weight_checksum(rows) != weight_checksum(rows.flip(0))


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
        _prepare(layer)  # the event that sees it
    twin = _copy(layer, how)
    with pytest.raises(RuntimeError, match="modified in place or replaced"):
        twin(x, logits)
    with pytest.raises(RuntimeError, match="modified in place or replaced"):
        _prepare(twin)
    # Control: a copy of the unmodified layer runs.
    clean = _fresh(shape, _tensors(*shape, seed=1), quant_mode=quant_mode)
    assert torch.equal(_copy(clean, how)(x, logits), clean(x, logits))
