# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM's forward and FlashInfer's host code reach that only a GPU
provides, stood in on CPU. Each is a context manager that restores what it
replaces, with its reason; the loading stand-ins are
``benchmarks/vllm_cpu_stand_ins.py``'s.

Besides these, a CPU forward sets vLLM's own switch
``compilation_config.custom_ops=["-rotary_embedding"]``: RoPE's custom op
calls ``torch.ops._C.rotary_embedding``, which this build lacks, and the
switch selects upstream's torch implementation.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import torch
from upstream_b12x_test import b12x_test_module

__all__ = ["b12x_kernels_in_torch", "causal_sdpa_attention", "sm_count"]


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
def b12x_kernels_in_torch() -> Iterator[None]:
    """``flashinfer.fused_moe.B12xMoEWrapper`` is upstream's
    ``_TorchB12xMoEWrapper``: the b12x kernels' arithmetic in torch, run on
    exactly the tensors and arguments vLLM's experts pass the wrapper.

    The b12x kernels run only on SM120/SM121; FlashInfer's wrapper stops on
    CPU at ``torch.cuda.is_current_stream_capturing()`` ("Torch not compiled
    with CUDA enabled"). vLLM's experts build the wrapper lazily, on their
    first ``apply``, from this attribute.
    """
    import flashinfer.fused_moe

    wrapper = b12x_test_module()._TorchB12xMoEWrapper
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
