# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each CPU stand-in answers what it stands in for, and only while entered.
(That each one is needed: without it the worker fails, see the module.)"""

import pytest
import torch

import vllm.model_executor.layers.utils as layer_utils
import vllm.triton_utils
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)

import vllm_cpu_stand_ins as s


def test_triton_reported_present_only_inside():
    before = vllm.triton_utils.HAS_TRITON
    with s.triton_reported_present():
        assert vllm.triton_utils.HAS_TRITON is True
    assert vllm.triton_utils.HAS_TRITON is before


def test_b12x_backend_selectable_only_inside():
    assert FlashInferB12xExperts._supports_current_device() is False  # no SM12x
    with s.b12x_backend_selectable():
        assert FlashInferB12xExperts._supports_current_device() is True
    assert FlashInferB12xExperts._supports_current_device() is False


def test_dense_layers_unpacked_only_inside():
    before = layer_utils.check_cpu_sgl_kernel
    with s.dense_layers_unpacked():
        assert layer_utils.check_cpu_sgl_kernel(256, 256, torch.bfloat16) is False
    assert layer_utils.check_cpu_sgl_kernel is before


def test_cuda_is_identity_only_inside():
    before, t = torch.Tensor.cuda, torch.ones(2)
    with s.cuda_is_identity():
        assert t.cuda() is t
    assert torch.Tensor.cuda is before


def test_cpu_worker_torch_patches_restored():
    before = torch.accelerator.empty_cache, torch.Tensor.pin_memory
    with pytest.raises(RuntimeError, match="accelerator"):
        torch.accelerator.empty_cache()  # what BaseModelLoader.load_model calls
    with s.cpu_worker_torch_patches():
        torch.accelerator.empty_cache()
        t = torch.ones(2)
        assert t.pin_memory() is t
    assert (torch.accelerator.empty_cache, torch.Tensor.pin_memory) == before
