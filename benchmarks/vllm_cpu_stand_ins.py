# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM 0.34.0's loading path and a model's forward need to run on a
CPU-only x86 machine: every stand-in the benchmarks and tests use, here.

Each stand-in is a context manager that restores what it replaces. None of them
touches the weight preparation itself: they let the engine config, the b12x
backend and the dense layers be built where no GPU is, and (the last three)
a forward run and FlashInfer's host code size its workspace. Besides these, a
CPU forward sets vLLM's own switch
``compilation_config.custom_ops=["-rotary_embedding"]``: RoPE's custom op calls
``torch.ops._C.rotary_embedding``, which this build lacks, and the switch
selects upstream's torch implementation.
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from unittest import mock

import torch

__all__ = [
    "b12x_backend_selectable",
    "b12x_kernels_in_torch",
    "causal_sdpa_attention",
    "cpu_worker_torch_patches",
    "cuda_is_identity",
    "dense_layers_unpacked",
    "sm_count",
    "triton_reported_present",
]


@contextmanager
def cpu_worker_torch_patches() -> Iterator[None]:
    """Import `vllm.v1.worker.cpu.shm`, as vLLM's CPU worker does first.

    It makes torch's accelerator calls no-ops on CPU: without it
    `BaseModelLoader.load_model` raises at `torch.accelerator.empty_cache()`
    ("Cannot access accelerator device when none is available"). Must run
    while `HAS_TRITON` is still False, else it imports Triton-only modules.
    """
    import vllm.utils.torch_utils as torch_utils

    owners = (torch, torch.cuda, torch.accelerator, torch.Tensor, torch_utils)
    before = [dict(vars(o)) for o in owners]
    module = "vllm.v1.worker.cpu.shm"
    if module in sys.modules:  # entered before: patch again
        del sys.modules[module]
    __import__(module)
    try:
        yield
    finally:
        for owner, saved in zip(owners, before, strict=True):
            # Importing may also register submodules on their parent
            # (torch._dynamo, ...): those stay.
            for name, value in dict(vars(owner)).items():
                if name not in saved and not isinstance(value, ModuleType):
                    delattr(owner, name)
                elif name in saved and saved[name] is not value:
                    setattr(owner, name, saved[name])


@contextmanager
def triton_reported_present() -> Iterator[None]:
    """`vllm.triton_utils.HAS_TRITON` reads True.

    `CpuPlatform.check_and_update_config` refuses x86 without triton-cpu
    (`platforms/cpu.py`), so `EngineArgs.create_engine_config()` fails here;
    hold this only while the config is built (nothing in loading needs Triton).
    """
    with mock.patch("vllm.triton_utils.HAS_TRITON", True):
        yield


@contextmanager
def b12x_backend_selectable() -> Iterator[None]:
    """`FlashInferB12xExperts._supports_current_device()` answers True.

    It wants CUDA on an SM12x card; otherwise the NVFP4 backend oracle refuses
    `moe_backend="flashinfer_b12x"` in the quant method's constructor.
    """
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    with mock.patch.object(
        FlashInferB12xExperts, "_supports_current_device", staticmethod(lambda: True)
    ):
        yield


@contextmanager
def dense_layers_unpacked() -> Iterator[None]:
    """`vllm.model_executor.layers.utils.check_cpu_sgl_kernel` answers False.

    On AMX machines the BF16 dense layers would be packed with the compiled
    `torch.ops._C.convert_weight_packed`, which a CPU build without vLLM's
    `_C` lacks; upstream's torch fallback serves instead.
    """
    with mock.patch(
        "vllm.model_executor.layers.utils.check_cpu_sgl_kernel", lambda *a: False
    ):
        yield


@contextmanager
def cuda_is_identity() -> Iterator[None]:
    """`torch.Tensor.cuda` returns the tensor itself (the release only).

    vLLM 0.34.0's `nvfp4_utils.swizzle_blockscale` ends in `.cuda()`, which a
    CPU build of torch refuses.
    """
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        yield


def _sdpa_forward(self, query, key, value, output_shape=None, output_dtype=None):
    """``Attention.forward`` for one sequence, no KV cache: causal SDPA with
    the layer's scale, grouped-query heads. query/key/value [T, heads * D];
    returns [T, heads * D] in ``output_dtype`` (default the query's)."""
    n = query.shape[0]
    q = query.view(n, self.num_heads, self.head_size).transpose(0, 1)
    k = key.view(n, self.num_kv_heads, self.head_size).transpose(0, 1)
    v = value.view(n, self.num_kv_heads, self.head_size_v).transpose(0, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=self.impl.scale, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(n, -1).to(output_dtype or query.dtype)


@contextmanager
def causal_sdpa_attention() -> Iterator[None]:
    """vLLM's ``Attention.forward`` runs torch's causal SDPA on its inputs.

    vLLM's CPU attention backend reads the KV cache and the metadata the
    model runner builds and runs vLLM's compiled ``_C`` CPU kernels, which
    this build lacks (``vllm._C`` does not import); without metadata it
    returns its output buffer uninitialised (``cpu_attn.py``: ``if
    attn_metadata is None: return output``). One sequence without a KV cache
    needs neither.
    """
    from vllm.model_executor.layers.attention.attention import Attention

    with mock.patch.object(Attention, "forward", _sdpa_forward):
        yield


@contextmanager
def b12x_kernels_in_torch(wrapper: type) -> Iterator[None]:
    """``flashinfer.fused_moe.B12xMoEWrapper`` is ``wrapper``: upstream's
    ``_TorchB12xMoEWrapper`` (tests/kernels/moe/test_flashinfer_b12x_moe.py of
    the tree), the b12x kernels' arithmetic in torch, run on exactly the
    tensors and arguments vLLM's experts pass the wrapper.

    The b12x kernels run only on SM120/SM121; FlashInfer's wrapper stops on
    CPU at ``torch.cuda.is_current_stream_capturing()`` ("Torch not compiled
    with CUDA enabled"). vLLM's experts build the wrapper lazily, on their
    first ``apply``, from this attribute.
    """
    import flashinfer.fused_moe

    with mock.patch.object(flashinfer.fused_moe, "B12xMoEWrapper", wrapper):
        yield


@contextmanager
def sm_count(count: int = 1) -> Iterator[None]:
    """``torch.cuda.get_device_properties`` answers an object with
    ``multi_processor_count=count``.

    FlashInfer 0.7.4's W4A16 prepare sizes its kernel workspace (``count *
    4 + 2`` int32 zeros) from it (``moe_w4a16_prepare._make_workspace``); a
    CPU build of torch has no device to ask.
    """
    props = SimpleNamespace(multi_processor_count=count)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda *a: props):
        yield
