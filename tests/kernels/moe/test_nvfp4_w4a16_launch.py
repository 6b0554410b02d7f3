# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The prepared W4A16 layer as FlashInfer 0.7.4 sees it: its packed weights
equal FlashInfer's own prepare (the oracle, where installed), and the launch
arguments, expert parallelism and expert map included."""

import dataclasses
import importlib.util
import types

import pytest
import torch

from tests.kernels.moe.flashinfer_b12x_utils import apply_experts
from tests.kernels.moe.nvfp4_w4a16_utils import (
    LAYER_IDS,
    LAYERS,
    PACKED_FIELDS,
    packed_bytes,
    prepare,
    w4a16_layer,
    w4a16_tensors,
)
from tests.kernels.moe.test_nvfp4_moe_prep_state import (
    _load_through_loader,
)
from tests.kernels.utils import bytes_of
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="needs flashinfer-python (the oracle)",
)
@pytest.mark.parametrize("shape", LAYERS, ids=LAYER_IDS)
def test_layer_packed_weights_equal_flashinfer(shape, monkeypatch):
    sms = types.SimpleNamespace(multi_processor_count=2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: sms)
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_prepare as fi

    e, h, i, gated = shape
    t = w4a16_tensors(e, h, i, gated, seed=15)
    out = fi.prepare_w4a16_modelopt_nvfp4_weights(
        t["w13_weight"],
        swizzle_blockscale(t["w13_weight_scale"]),
        t["w13_weight_scale_2"][:, 0].contiguous(),
        t["w2_weight"],
        swizzle_blockscale(t["w2_weight_scale"]),
        t["w2_weight_scale_2"],
        activation="silu" if gated else "relu2",
        w13_layout="w31",
    )
    layer = w4a16_layer(e, h, i, gated)
    _load_through_loader(layer, t)
    got = packed_bytes(prepare(layer))
    for field in got:
        ref = getattr(out, field)
        assert getattr(layer.quant_method.experts.prepared, field).shape == ref.shape
        assert torch.equal(got[field], bytes_of(ref.contiguous())), field


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="needs flashinfer-python (the real signature)",
)
def test_kernel_call_binds_to_flashinfers_launch(monkeypatch):
    # The call FlashInferB12xW4A16Experts.apply makes, bound to FlashInfer
    # 0.7.4's own launch_sm120_moe signature and W4A16PackedWeights fields:
    # the prepared weights go in as they are (the same tensors, no copy), with
    # the expert map of expert parallelism.
    import inspect

    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch

    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_w4a16 as m
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        flashinfer_w4a16_prepared_call,
    )

    sms = types.SimpleNamespace(multi_processor_count=3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: sms)
    # vLLM caches the count (num_compute_units): uncached, the patch is seen.
    monkeypatch.setattr(m, "num_compute_units", m.num_compute_units.__wrapped__)
    assert flashinfer_w4a16_prepared_call()
    e, h, i = 4, 256, 128
    layer = w4a16_layer(2 * e, h, i, True, ep_rank=1, ep_size=2)
    _load_through_loader(layer, w4a16_tensors(2 * e, h, i, True, seed=16))
    prepare(layer)
    experts = layer.quant_method.experts
    pw = experts.prepared
    prepared = m.flashinfer_packed_weights(pw, torch.device("cpu"))
    assert prepared.workspace.shape == (3 * 4 + 2,)
    for field in PACKED_FIELDS:
        assert getattr(prepared, field) is getattr(pw, field)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]], dtype=torch.int32)
    kwargs = m.w4a16_launch_kwargs(
        experts.moe_config,
        pw,
        prepared,
        x,
        layer.w13_weight,
        layer.w2_weight,
        torch.ones(3, 2),
        ids,
        layer.expert_map,
        torch.empty_like(x),
    )
    bound = inspect.signature(moe_dispatch.launch_sm120_moe).bind(**kwargs)
    assert bound.arguments["_prepared_weights"] is prepared
    assert bound.arguments["num_experts"] == 2 * e
    assert bound.arguments["num_local_experts"] == e
    assert bound.arguments["quant_mode"] == "w4a16"
    # Rank 1 of 2 holds global experts 4..7 at local 0..3.
    emap = bound.arguments["expert_map"]
    assert emap.dtype == torch.int32 and emap.tolist() == [-1] * 4 + [0, 1, 2, 3]


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_launch_arguments_under_expert_parallelism_without_flashinfer(ep_rank):
    # The keyword arguments of launch_sm120_moe, built on CPU (FlashInfer not
    # needed: ``prepared`` stands in for its packed-weights object). Rank r
    # of 2 holds global experts 4r..4r+3 at local ids 0..3.
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
        w4a16_launch_kwargs,
    )

    e, h, i = 4, 256, 128
    layer = w4a16_layer(2 * e, h, i, True, ep_rank=ep_rank, ep_size=2)
    _load_through_loader(layer, w4a16_tensors(2 * e, h, i, True, seed=16))
    prepare(layer)
    experts = layer.quant_method.experts
    pw, prepared = experts.prepared, object()
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]], dtype=torch.int64)
    weights = torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    kw = w4a16_launch_kwargs(
        experts.moe_config,
        pw,
        prepared,
        x,
        layer.w13_weight,
        layer.w2_weight,
        weights,
        ids,
        layer.expert_map.long(),  # whatever map dtype: the kernel's is int32
        out,
    )
    assert kw["num_experts"] == 2 * e and kw["num_local_experts"] == e
    assert kw["top_k"] == 2 and kw["quant_mode"] == "w4a16"
    emap = kw["expert_map"]
    assert emap.dtype == torch.int32
    want = [-1] * 8
    want[4 * ep_rank : 4 * ep_rank + 4] = [0, 1, 2, 3]
    assert emap.tolist() == want
    assert kw["topk_ids"].dtype == torch.int32 and kw["topk_ids"].tolist() == [
        [0, 5],
        [7, 4],
        [1, 2],
    ]
    assert kw["topk_weights"].dtype == torch.float32
    assert kw["_prepared_weights"] is prepared and kw["scatter_output"] is out
    assert kw["a"] is x and kw["w1_weight"] is layer.w13_weight
    assert kw["w1_weight_sf"] is pw.w13_scale and kw["w2_weight_sf"] is pw.w2_scale
    assert kw["w1_alpha"] is pw.w13_global_scale
    assert kw["w2_alpha"] is pw.w2_global_scale
    assert pw.num_experts == e and pw.w13.shape[0] == e
    # Without expert parallelism: no map, every expert local.
    single = w4a16_layer(e, h, i, True)
    _load_through_loader(single, w4a16_tensors(e, h, i, True, seed=17))
    prepare(single)
    ex1 = single.quant_method.experts
    kw = w4a16_launch_kwargs(
        ex1.moe_config,
        ex1.prepared,
        prepared,
        x,
        single.w13_weight,
        single.w2_weight,
        weights,
        ids % e,
        single.expert_map,
        out,
    )
    assert kw["expert_map"] is None
    assert kw["num_experts"] == kw["num_local_experts"] == e
    # top_k is the config's (3 here), not a constant.
    top3 = dataclasses.replace(ex1.moe_config, experts_per_token=3)
    ids3 = torch.tensor([[0, 1, 2], [3, 2, 1], [1, 0, 3]])
    kw = w4a16_launch_kwargs(
        top3,
        ex1.prepared,
        prepared,
        x,
        single.w13_weight,
        single.w2_weight,
        torch.full((3, 3), 1 / 3),
        ids3,
        None,
        out,
    )
    assert kw["top_k"] == 3


def test_apply_launches_with_the_layers_expert_map(monkeypatch):
    # The kernel experts' apply under expert parallelism hands its expert map
    # on to launch_sm120_moe (a recorder here, FlashInfer not needed): rank 1
    # of 2 holds global experts 4..7 at local 0..3.
    import sys

    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe as m
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
        Support,
    )

    e, h, i = 4, 256, 128
    layer = w4a16_layer(2 * e, h, i, True, ep_rank=1, ep_size=2)
    _load_through_loader(layer, w4a16_tensors(2 * e, h, i, True, seed=16))
    prepare(layer)
    experts = layer.quant_method.experts
    experts.__class__ = m.FlashInferB12xExperts  # the emulation's base
    packed = object()  # FlashInfer's object, made of the binding
    experts._flashinfer_packed = (experts.prepared, packed)
    calls = []
    dispatch = types.SimpleNamespace(launch_sm120_moe=lambda **kw: calls.append(kw))
    monkeypatch.setitem(
        sys.modules,
        "flashinfer.fused_moe.cute_dsl.blackwell_sm12x",
        types.SimpleNamespace(moe_dispatch=dispatch),
    )
    monkeypatch.setattr(m, "flashinfer_w4a16_prepared_call", Support.yes)
    x = torch.zeros(3, h, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 5], [7, 4], [1, 2]], dtype=torch.int32)
    out = apply_experts(
        experts,
        layer,
        x,
        torch.ones(3, 2),
        ids,
        experts.moe_config.activation,
        2 * e,
        expert_map=layer.expert_map,
    )
    (kw,) = calls
    assert kw["_prepared_weights"] is packed and kw["scatter_output"] is out
    assert kw["expert_map"].tolist() == [-1] * 4 + [0, 1, 2, 3]
