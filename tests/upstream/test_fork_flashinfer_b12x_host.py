# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer 0.7.4's host code under the fork's real b12x experts, through
upstream's own kernel object, on CPU.

A layer prepared by upstream's ModelOpt method (W4A4, FLASHINFER_B12X) runs
the experts of ``layer.quant_method.moe_kernel`` (the fork's
``FlashInferB12xExperts.apply``, upstream's 15 arguments) into FlashInfer's
``B12xMoEWrapper.run`` down to the kernel launch. (The modular kernel's own
``apply`` needs vLLM's worker WorkspaceManager, which queries accelerator
memory and cannot run on CPU.) Stubbed, as
in tests/kernels/moe/test_flashinfer_b12x_host.py, because they need a GPU:
the kernel compile and launch, the CUDA version, the device properties and
the stream-capture query. Every module-level cache of FlashInfer's SM12x
MoE dispatch (names ending in ``_CACHE``) keeps its size over 100 calls
after the first.
"""

import types

import pytest
import torch
from upstream_reports import experts_apply, moe_inputs

from upstream_layers import MoEShape, prepare_layer

#: I = 256: whole 128-row tiles, FlashInfer pads nothing.
HOST = MoEShape("host", 8, 256, 256, 2)
TOKENS = [1, 8, 512]
CALLS = 100


class _Launches:
    def __init__(self):
        self.counts: dict[str, int] = {}

    def stub(self, name, result):
        def fn(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return result

        return fn

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@pytest.fixture
def fi_host(monkeypatch):
    """FlashInfer runnable on CPU up to the kernel launch, its caches
    emptied. Yields (dispatch module, launches)."""
    import flashinfer.jit.cpp_ext as cpp_ext
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch as md

    launches = _Launches()
    props = types.SimpleNamespace(
        multi_processor_count=48,
        major=12,
        minor=0,
        name="sm120 stand-in",
        total_memory=16 << 30,
    )
    cuda13 = types.SimpleNamespace(major=13, minor=0)
    monkeypatch.setattr(cpp_ext, "get_cuda_version", lambda: cuda13)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    compiled = launches.stub("launch", None)
    for getter in ("_get_static_kernel", "_get_micro_kernel", "_get_dynamic_kernel"):
        monkeypatch.setattr(md, getter, launches.stub(getter, (compiled, 1)))
    direct = launches.stub("_get_direct_micro_kernel", (compiled, 1, True))
    monkeypatch.setattr(md, "_get_direct_micro_kernel", direct)
    monkeypatch.setattr(md.MoEDirectMicroKernel, "launch", staticmethod(compiled))
    md.clear_sm120_moe_caches()
    yield md, launches
    md.clear_sm120_moe_caches()


def _cache_sizes(md) -> dict[str, int]:
    return {
        name: len(value)
        for name, value in vars(md).items()
        if name.endswith("_CACHE") and isinstance(value, dict)
    }


def _apply(layer, seed: int, tokens: int) -> torch.Tensor:
    """The experts of upstream's kernel object (``moe_kernel.fused_experts``,
    the fork's real FlashInferB12xExperts) called with upstream's 15
    arguments. (``moe_kernel.apply`` itself takes its workspaces from vLLM's
    worker WorkspaceManager, which queries accelerator memory: not on CPU.)"""
    x, weights, ids = moe_inputs(HOST, tokens, seed)
    experts = layer.quant_method.moe_kernel.fused_experts
    return experts_apply(experts, layer, x, weights, ids)


@pytest.mark.parametrize("tokens", TOKENS)
def test_upstream_kernel_object_reaches_flashinfers_launch_with_constant_caches(
    one_rank_b12x_vllm, fi_host, tokens
):
    md, launches = fi_host
    layer, _, _ = prepare_layer(HOST, "modelopt")
    experts = layer.quant_method.moe_kernel.fused_experts
    assert type(experts).__name__ == "FlashInferB12xExperts"
    out = _apply(layer, 0, tokens)  # the first call builds what is cached
    assert out.shape == (tokens, HOST.hidden_size) and out.dtype == torch.bfloat16
    assert launches.total >= 1
    sizes = _cache_sizes(md)
    assert sizes, "no module-level _CACHE found in FlashInfer's dispatch"
    assert sizes["_WEIGHT_CACHE"] >= 1, sizes
    wrapper = experts._wrapper
    assert (
        wrapper.use_cuda_graph
        and wrapper.max_num_tokens == experts.moe_config.max_num_tokens
    )
    per_call = set()
    for seed in range(1, CALLS + 1):
        before = launches.total
        _apply(layer, seed, tokens)
        per_call.add(launches.total - before)
        assert _cache_sizes(md) == sizes, seed
    assert len(per_call) == 1 and per_call.pop() >= 1
    assert experts._wrapper is wrapper
