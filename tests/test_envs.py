# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's VLLM_* variables, read through ``vllm.envs`` when accessed
and parsed as vLLM parses its own; the two the branch dropped stay gone."""

import pytest

import vllm.envs as envs
from tests.kernels.moe.utils import make_nvfp4_layer

MODE = "VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE"


def _experts():
    layer = make_nvfp4_layer(4, 2, 256, 128, True, "flashinfer_b12x_emulated")
    return layer.quant_method.experts_for(layer)


@pytest.mark.parametrize(
    "value, want", [(None, "alpha"), ("alpha", "alpha"), ("fold", "fold")]
)
def test_the_global_scale_mode_reaches_the_experts(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(MODE, raising=False)
    else:
        monkeypatch.setenv(MODE, value)
    mode = envs.VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE
    assert mode == want
    assert _experts().global_scale_mode == want


def test_a_bad_global_scale_mode_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(MODE, "folded")
    with pytest.raises(ValueError, match=rf"'folded' for {MODE}.*alpha.*fold"):
        _experts()


@pytest.mark.parametrize("value, want", [(None, False), ("0", False), ("1", True)])
def test_verify_is_a_0_or_1_flag(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("VLLM_MOE_PREP_VERIFY", raising=False)
    else:
        monkeypatch.setenv("VLLM_MOE_PREP_VERIFY", value)
    assert envs.VLLM_MOE_PREP_VERIFY is want


@pytest.mark.parametrize(
    "name", ["VLLM_MOE_PREP_CPU_THREADS", "VLLM_MOE_PREP_MAX_TRANSIENT_BYTES"]
)
def test_the_dropped_variables_are_not_settings(name):
    # Threads are the commands' policy, the cap an argument of the API.
    assert name not in envs.environment_variables
    with pytest.raises(AttributeError):
        getattr(envs, name)
