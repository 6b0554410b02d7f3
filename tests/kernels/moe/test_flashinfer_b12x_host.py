# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer's own host code in the loop, on CPU: this tree's real b12x call.

A layer is prepared on CPU with the real ``flashinfer_b12x`` backend and its
``FlashInferB12xExperts.apply`` (not the emulation's) runs FlashInfer
0.7.4's Python from ``B12xMoEWrapper`` down to the kernel launch: signature,
alpha fold, weight views, backend selection, workspace, kernel-cache keys.
Stubbed, because they need a GPU: the kernel compile and launch, the CUDA
version and device-property queries, and the stream-capture query. Skipped
where flashinfer is not installed (``pip install -r
requirements/flashinfer-cpu.txt``; about 2 GB, not in the default suite).
"""

import functools
import importlib.util
import inspect
import types

import pytest
import torch

from tests.kernels.moe.utils import (
    bf16_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None,
    reason="flashinfer-python is not installed (requirements/flashinfer-cpu.txt)",
)

# (E, H, I, top-k): I = 256 is a whole number of 128-row tiles, so FlashInfer
# pads nothing and its weight views must be views of this tree's tensors.
E, H, I, TOPK = 8, 256, 256, 2  # noqa: E741
# Token counts reaching FlashInfer's direct-micro, static and dynamic
# backends (its own selection, from the routed rows).
TOKENS = [1, 8, 512]
MAX_TOKENS = max(TOKENS)  # the wrapper's CUDA-graph buffers are sized for it
FORWARDS = 100


class _Launches:
    """Counts of the stubbed kernel getters and launches, by name."""

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
    """FlashInfer importable and runnable on CPU up to the kernel launch;
    its module caches emptied. Yields (dispatch module, launches)."""
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
    monkeypatch.setattr(
        cpp_ext, "get_cuda_version", lambda: types.SimpleNamespace(major=13, minor=0)
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    compiled = launches.stub("launch", None)
    for getter in ("_get_static_kernel", "_get_micro_kernel", "_get_dynamic_kernel"):
        monkeypatch.setattr(md, getter, launches.stub(getter, (compiled, 1)))
    direct = launches.stub("_get_direct_micro_kernel", (compiled, 1, True))
    monkeypatch.setattr(md, "_get_direct_micro_kernel", direct)
    monkeypatch.setattr(md.MoEDirectMicroKernel, "launch", staticmethod(compiled))
    # The real backend's device gate (SM12x) is the only thing not run here.
    monkeypatch.setattr(
        FlashInferB12xExperts, "_supports_current_device", staticmethod(lambda: True)
    )
    md.clear_sm120_moe_caches()
    yield md, launches
    md.clear_sm120_moe_caches()


def _cache_sizes(md) -> dict[str, int]:
    """Every module-level cache of FlashInfer's SM12x MoE dispatch."""
    return {
        name: len(value)
        for name, value in vars(md).items()
        if name.endswith("_CACHE") and isinstance(value, dict)
    }


def _layer(mode="alpha", ratios=(1.0, 1.0), max_num_tokens=MAX_TOKENS, **kwargs):
    w1, w2 = bf16_experts(E, I, H, gated=True, seed=5)
    w1[1::2, I:] *= ratios[1]  # odd experts: up scaled, so s_up != s_gate
    w1[0::2, I:] *= ratios[0]
    tensors = quantize_experts_modelopt(w1, w2, gated=True, shared_w13_scale=False)
    layer = make_nvfp4_layer(
        E,
        TOPK,
        H,
        I,
        True,
        "flashinfer_b12x",
        max_num_tokens=max_num_tokens,
        global_scale_mode=mode,
        **kwargs,
    )
    load_nvfp4_experts(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _inputs(t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, H, generator=gen).bfloat16(), torch.randn(t, E, generator=gen)


def test_this_trees_call_binds_flashinfers_signature(fi_host, monkeypatch):
    from flashinfer import B12xMoEWrapper

    real_run = B12xMoEWrapper.run
    seen = []

    @functools.wraps(real_run)  # the signature probe sees the real one
    def spy(self, *args, **kwargs):
        seen.append(inspect.signature(real_run).bind(self, *args, **kwargs).arguments)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(B12xMoEWrapper, "run", spy)
    layer = _layer()
    experts = layer.quant_method.experts
    kernel = experts.prepared
    for seed in range(3):
        layer(*_inputs(8, seed))
    assert len(seen) == 3
    for args in seen:
        # The same prepared tensors on every call: nothing made per call.
        assert args["w1_weight"] is layer.w13_weight
        assert args["w2_weight"] is layer.w2_weight
        assert args["w1_weight_sf"] is experts.w1_sf_mma
        assert args["w2_weight_sf"] is experts.w2_sf_mma
        assert args["w1_alpha"] is kernel.w1_alpha
        assert args["w2_alpha"] is kernel.w2_alpha
        assert args["fc2_input_scale"] is kernel.fc2_input_scale
        assert args["input_global_scale"] is kernel.fc1_input_scale
    assert torch.equal(kernel.fc1_input_scale, torch.ones(E))
    assert torch.equal(kernel.fc2_input_scale, torch.ones(E))
    # The wrapper was built for this layer's geometry, W4A4.
    wrapper = experts._wrapper
    assert (
        wrapper.num_experts,
        wrapper.top_k,
        wrapper.hidden_size,
        wrapper.intermediate_size,
    ) == (E, TOPK, H, I)
    assert wrapper.quant_mode == "nvfp4" and wrapper.activation == "silu"


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("mode", ["alpha", "fold"])
def test_repeated_forwards_keep_flashinfers_caches(fi_host, tokens, mode):
    md, launches = fi_host
    layer = _layer(mode)
    experts = layer.quant_method.experts
    out = layer(*_inputs(tokens, 0))  # the first call builds what is cached
    assert out.shape == (tokens, H) and out.dtype == torch.bfloat16
    sizes = _cache_sizes(md)
    # The weight views are cached; the workspaces are the wrapper's own
    # (built for max_num_tokens, CUDA-graph mode, as vLLM runs it).
    assert sizes["_WEIGHT_CACHE"] >= 1 and sizes["_WORKSPACE_CACHE"] == 0, sizes
    folded = experts._wrapper._folded_w1_alpha
    per_call = set()
    for seed in range(1, FORWARDS + 1):
        before = launches.total
        layer(*_inputs(tokens, seed))
        per_call.add(launches.total - before)
        assert _cache_sizes(md) == sizes, seed
    # Every forward reached the kernel launch, the same number of times.
    assert len(per_call) == 1 and per_call.pop() >= 1
    # The alpha fold (alpha mode) happened once: w1_alpha * 1 = the gate's
    # global scale, in FlashInfer's own tensor, never remade.
    assert experts._wrapper._folded_w1_alpha is folded
    if mode == "alpha":
        assert torch.equal(folded, experts.prepared.w1_alpha)
    else:
        assert folded is None


def test_functional_call_grows_the_weight_cache(fi_host):
    # Negative control of the test above: the functional b12x_fused_moe with
    # input_global_scale (what this tree called before) adds an entry per call.
    from flashinfer import b12x_fused_moe

    md, _ = fi_host
    layer = _layer()
    experts = layer.quant_method.experts
    kernel = experts.prepared
    x, logits = _inputs(8, 0)
    weights, ids = torch.softmax(logits, -1).topk(TOPK)
    sizes = []
    for _ in range(5):
        b12x_fused_moe(
            x,
            layer.w13_weight,
            experts.w1_sf_mma,
            layer.w2_weight,
            experts.w2_sf_mma,
            ids.int(),
            weights,
            E,
            TOPK,
            w1_alpha=kernel.w1_alpha,
            w2_alpha=kernel.w2_alpha,
            fc2_input_scale=kernel.fc2_input_scale,
            input_global_scale=kernel.fc1_input_scale,
        )
        sizes.append(_cache_sizes(md)["_WEIGHT_CACHE"])
    assert sizes == sorted(sizes) and sizes[-1] >= sizes[0] + 4, sizes


def test_weight_views_reuse_this_trees_scale_storage(fi_host):
    layer = _layer(ratios=(1.37, 0.6))
    experts = layer.quant_method.experts
    layer(*_inputs(8, 0))
    views = experts._wrapper._weight_views
    # FlashInfer's contiguous scale operands are this tree's swizzled scale
    # parameters themselves (the MMA-layout view converted back: no copy).
    for got, param in (
        (views._w13_sf_storage, layer.w13_weight_scale),
        (views._down_sf_storage, layer.w2_weight_scale),
    ):
        assert got.data_ptr() == param.data_ptr()
        assert got.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
        assert torch.equal(
            got.reshape(-1).view(torch.uint8), param.reshape(-1).view(torch.uint8)
        )
    # The alphas FlashInfer multiplies by: the gate's scale, and w2's with
    # the up/gate ratio (1.37 and 0.6 here).
    kernel = experts.prepared
    assert views.w1_alpha.data_ptr() == experts._wrapper._folded_w1_alpha.data_ptr()
    assert torch.equal(views.w1_alpha, kernel.w1_alpha)
    assert views.w2_alpha is kernel.w2_alpha


def test_cuda_graph_capture_after_warm_up_prepares_nothing(fi_host, monkeypatch):
    # With max_num_tokens the wrapper preallocates; after one eager call,
    # every FlashInfer first-use preparation would raise during capture.
    tokens = 8
    layer = _layer(max_num_tokens=tokens)
    layer(*_inputs(tokens, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for seed in range(1, 4):
        out = layer(*_inputs(tokens, seed))
        assert out.shape == (tokens, H)
    # Control: a layer never warmed up is refused during capture.
    cold = _layer(max_num_tokens=tokens)
    with pytest.raises(RuntimeError, match="capture"):
        cold(*_inputs(tokens, 0))
