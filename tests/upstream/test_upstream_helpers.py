# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The helpers of tests/upstream do what they say: stand-ins restore what they
replaced, files of the slice load by path without the slice's vllm, and a
snippet's result comes back from the vllm it should have imported."""

import inspect
import sys
from pathlib import Path

import pytest
import torch

import cpu_stand_ins
from upstream_env import (
    SLICE_VLLM,
    SnippetError,
    load_slice_module,
    run_installed_json,
)


def test_stand_ins_restore_what_they_replace():
    from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe

    experts = flashinfer_b12x_moe.FlashInferB12xExperts
    before = (
        vars(torch.Tensor).get("cuda"),
        inspect.getattr_static(experts, "_supports_current_device"),
        getattr(flashinfer_b12x_moe, "flashinfer_convert_sf_to_mma_layout", None),
        torch.cuda.get_device_properties,
    )
    x = torch.zeros(3)
    with (
        cpu_stand_ins.b12x_preparation_on_cpu(),
        cpu_stand_ins.cuda_device_properties(),
    ):
        assert x.cuda() is x
        assert experts._supports_current_device() is True
        assert torch.cuda.get_device_properties(0).major == 12
    after = (
        vars(torch.Tensor).get("cuda"),
        inspect.getattr_static(experts, "_supports_current_device"),
        getattr(flashinfer_b12x_moe, "flashinfer_convert_sf_to_mma_layout", None),
        torch.cuda.get_device_properties,
    )
    assert after == before
    assert isinstance(after[1], staticmethod)


def test_patched_attribute_refuses_a_missing_attribute():
    with (
        pytest.raises(AttributeError, match="no_such_thing"),
        cpu_stand_ins.patched_attribute(torch.Tensor, "no_such_thing", None),
    ):
        pass


def test_slice_module_loads_by_path_beside_the_installed_vllm():
    import vllm

    mem_utils = load_slice_module("vllm/utils/mem_utils.py")
    assert Path(mem_utils.__file__) == SLICE_VLLM / "utils/mem_utils.py"
    assert sys.modules["vllm"] is vllm
    assert not Path(vllm.__file__).resolve().is_relative_to(SLICE_VLLM)
    assert load_slice_module("vllm/utils/mem_utils.py") is mem_utils
    with mem_utils.measure_peak_memory("cpu") as mem:
        y = torch.empty(1 << 20, dtype=torch.uint8)
    assert mem.peak_bytes == 1 << 20
    del y


def test_slice_module_importing_vllm_is_refused():
    # The slice's MoE layer imports vllm.*: loaded by path it would bind the
    # installed package's modules.
    with pytest.raises(ValueError, match="imports vllm"):
        load_slice_module("vllm/model_executor/layers/fused_moe/layer.py")


def test_snippet_result_and_errors():
    assert run_installed_json("result = {'a': [1, 2]}") == {"a": [1, 2]}
    with pytest.raises(SnippetError, match="ZeroDivisionError"):
        run_installed_json("result = 1 / 0")
