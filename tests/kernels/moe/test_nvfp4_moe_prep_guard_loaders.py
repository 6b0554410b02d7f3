# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A prepared layer against vLLM's own parameter ``weight_loader``s (they
write ``param.data[...]``, which moves no version counter): a write into a
layer that is not in its load layout is refused at the write, with the
guard's message; the restore and a reload through the same loaders repair
it."""

import copy
import io

import pytest
import torch

from tests.kernels.moe.test_nvfp4_moe_prep_guard import UNPADDED, _fresh
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    PrepStatus,
    _assert_same,
    _io,
    _layer,
    _prepare,
    _snapshot,
    _tensors,
)

#: The guard's refusal of a write through a parameter's loader.
WRITTEN = (
    r"parameters of a prepared MoE layer were modified in place or replaced "
    r"after its preparation \(w13_weight written through its weight_loader"
)


def _saved(layer):
    buf = io.BytesIO()
    torch.save(layer, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


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


def _with_vllm_style_loaders(layer):
    """``layer``, with a :class:`_VllmStyleLoader` as each parameter's
    ``weight_loader``."""
    for p in layer.parameters():
        p.weight_loader = _VllmStyleLoader(layer)
    return layer


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


def test_a_param_weight_loader_write_leaves_a_trace_the_counter_misses():
    # vLLM's own loaders (the fork: RoutedExperts' params) write param.data;
    # the version counters cannot see it, so the experts guard the loaders.
    shape = UNPADDED
    layer = _with_vllm_style_loaders(_layer(shape, _tensors(*shape, seed=1)))
    _prepare(layer)
    version, i = layer.w13_weight._version, shape[2]
    part = _tensors(*shape, seed=2)["w13_weight"][0, :i]
    with pytest.raises(RuntimeError, match=WRITTEN):
        layer.w13_weight.weight_loader(layer.w13_weight, part, "w13_weight", "w1", 0)
    assert layer.w13_weight._version == version  # the counter saw nothing
    with pytest.raises(RuntimeError, match=WRITTEN):
        _prepare(layer)


@pytest.mark.parametrize("how", ["layer", "deepcopy"])
def test_a_param_weight_loader_writing_between_steps_is_refused(how):
    # An interrupted preparation (some steps done), then a write through a
    # vLLM loader into the half-prepared bytes: resuming would finish a mix
    # of layouts, so it is refused at the write, and after it until the
    # restore tears the layer; a copy of the layer remembers the write.
    shape = UNPADDED
    layer = _with_vllm_style_loaders(_layer(shape, _tensors(*shape, seed=1)))
    for _, step in layer.quant_method.preparation_steps(layer)[:3]:
        step()
    assert layer.weight_prep_state.status is PrepStatus.PREPARING
    new = _tensors(*shape, seed=2)["w13_weight"][0, : shape[2]]
    with pytest.raises(RuntimeError, match=WRITTEN):
        layer.w13_weight.weight_loader(layer.w13_weight, new, "w13_weight", "w1", 0)
    if how == "deepcopy":
        layer = copy.deepcopy(layer)
    with pytest.raises(RuntimeError, match=WRITTEN):
        _prepare(layer)
    layer.quant_method.restore_load_layout(layer)
    with pytest.raises(RuntimeError, match="torn"):
        _prepare(layer)


def test_restore_then_param_weight_loaders_equal_a_fresh_layer():
    shape = UNPADDED
    old, new = _tensors(*shape, seed=1), _tensors(*shape, seed=2)
    layer = _with_vllm_style_loaders(_layer(shape, old))
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
    layer = _with_vllm_style_loaders(_layer(shape, old))
    _prepare(layer)
    x, logits = _io(shape)
    want = layer(x, logits)
    twin = _saved(layer)
    assert twin.w13_weight.weight_loader.layer is twin
    i = shape[2]
    with pytest.raises(RuntimeError, match=WRITTEN):
        twin.w13_weight.weight_loader(
            twin.w13_weight, new["w13_weight"][0, :i], "w13_weight", "w1", 0
        )
    with pytest.raises(RuntimeError, match=WRITTEN):
        twin(x, logits)
    assert torch.equal(layer(x, logits), want)
