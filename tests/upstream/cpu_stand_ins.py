# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU stand-ins vLLM 0.33.0's NVFP4 MoE path needs, as context managers
that restore what they replace (conftest.py wraps them as fixtures; snippets
run in a subprocess use them directly).

What each replaces and why (read from the 0.33.0 wheel, run on CPU):

* ``torch.Tensor.cuda`` -> returns the tensor itself. Upstream's
  ``swizzle_blockscale`` (quantization/utils/nvfp4_utils.py) ends in
  ``.contiguous().cuda()``; a CPU build of torch raises there.
* ``FlashInferB12xExperts._supports_current_device`` -> True. The backend
  oracle asks it (SM12x, CUDA, FlashInfer b12x present) before it accepts
  ``moe_backend="flashinfer_b12x"``; everything else in the selection runs.
* vLLM's lazy ``flashinfer_convert_sf_to_mma_layout`` (vllm/utils/flashinfer.py,
  bound in experts/flashinfer_b12x_moe.py) -> FlashInfer 0.7.4's own
  ``flashinfer.cute_dsl.utils.convert_sf_to_mma_layout``. Not a replacement
  of FlashInfer's code: that function runs on CPU as it is (a view of the
  swizzled bytes). vLLM's wrapper calls it only when ``has_flashinfer()``,
  which asks for flashinfer-cubin or nvcc and ninja on PATH; on a machine
  without a CUDA toolkit it would raise instead. (With this branch the
  experts module makes the view itself and has no such name: nothing to bind.)
* ``torch.cuda.get_device_properties`` -> an SM120-like namespace. Not used
  by the weight preparation; FlashInfer's host code (``B12xMoEWrapper``)
  sizes its workspace from the SM count, so tests that run ``apply`` need it.

Nothing here imports vllm or flashinfer at module level.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "b12x_device_supported",
    "b12x_preparation_on_cpu",
    "cuda_device_properties",
    "flashinfer_mma_layout_bound",
    "patched_attribute",
    "tensor_cuda_returns_self",
]

_MISSING = object()


@contextlib.contextmanager
def patched_attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name = value`` for the block; afterwards restore the
    attribute exactly as it was in ``vars(owner)`` (a staticmethod stays a
    staticmethod; an inherited attribute is deleted again). Raises
    AttributeError if ``owner`` has no such attribute at all, so a renamed
    upstream attribute fails loudly instead of being patched into being."""
    if not hasattr(owner, name):
        raise AttributeError(f"{owner!r} has no attribute {name!r} to replace")
    own = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def _cuda_returns_self(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def tensor_cuda_returns_self() -> contextlib.AbstractContextManager[None]:
    """``tensor.cuda()`` returns ``tensor`` itself (no copy, stays on CPU)."""
    return patched_attribute(torch.Tensor, "cuda", _cuda_returns_self)


def b12x_device_supported() -> contextlib.AbstractContextManager[None]:
    """``FlashInferB12xExperts._supports_current_device()`` answers True."""
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    return patched_attribute(
        FlashInferB12xExperts, "_supports_current_device", staticmethod(lambda: True)
    )


def flashinfer_mma_layout_bound() -> contextlib.AbstractContextManager[None]:
    """The b12x experts module calls FlashInfer's real
    ``convert_sf_to_mma_layout`` directly, whatever ``has_flashinfer()``
    says on this machine."""
    from flashinfer.cute_dsl.utils import convert_sf_to_mma_layout

    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe

    if not hasattr(flashinfer_b12x_moe, "flashinfer_convert_sf_to_mma_layout"):
        # This branch's experts make the view themselves (pure torch).
        return contextlib.nullcontext()
    return patched_attribute(
        flashinfer_b12x_moe,
        "flashinfer_convert_sf_to_mma_layout",
        convert_sf_to_mma_layout,
    )


def _sm120_properties(*args: Any, **kwargs: Any) -> types.SimpleNamespace:
    # An RTX 5070 Ti-like SM120 card; FlashInfer reads the SM count.
    return types.SimpleNamespace(
        name="SM120 stand-in",
        major=12,
        minor=0,
        multi_processor_count=70,
        total_memory=16 << 30,
    )


def cuda_device_properties(
    properties: Callable[..., Any] = _sm120_properties,
) -> contextlib.AbstractContextManager[None]:
    """``torch.cuda.get_device_properties(...)`` returns ``properties(...)``
    (default: an SM120-like namespace with 70 SMs and 16 GiB)."""
    return patched_attribute(torch.cuda, "get_device_properties", properties)


@contextlib.contextmanager
def b12x_preparation_on_cpu() -> Iterator[None]:
    """Every stand-in vLLM 0.33.0's FLASHINFER_B12X weight preparation needs
    on CPU (``process_weights_after_loading`` of the ModelOpt and the
    compressed-tensors NVFP4 MoE methods): ``tensor.cuda()`` is the tensor,
    the b12x device gate answers yes, FlashInfer's MMA-layout view is
    called directly."""
    with (
        tensor_cuda_returns_self(),
        b12x_device_supported(),
        flashinfer_mma_layout_bound(),
    ):
        yield
