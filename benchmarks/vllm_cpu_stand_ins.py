# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What vLLM 0.34.0's loading path needs to run on a CPU-only x86 machine.

Each stand-in is a context manager that restores what it replaces. None of them
touches the weight preparation itself: they let the engine config, the b12x
backend and the dense layers be built where no GPU is.
"""

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from unittest import mock

import torch

__all__ = [
    "b12x_backend_selectable",
    "cpu_worker_torch_patches",
    "cuda_is_identity",
    "dense_layers_unpacked",
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
