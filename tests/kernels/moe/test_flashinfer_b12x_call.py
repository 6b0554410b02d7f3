# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The b12x W4A4 backend refuses, when the layer is built, what FlashInfer's
kernel cannot run; and its fall-back from "alpha" to "fold" says why.

Runs without flashinfer (CPU): only the device gate is bypassed, to build
the real ``flashinfer_b12x`` backend's layer here.
"""

import logging

import pytest
import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    nvfp4_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts import (
    flashinfer_b12x_call,
    flashinfer_b12x_moe,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import Support
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_emulated import (
    FlashInferB12xEmulatedExperts,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

E, H, I, TOPK = 8, 256, 128, 2  # noqa: E741


@pytest.fixture
def sm12x(monkeypatch):
    """The real backend's device gate answers yes (nothing else changes)."""
    monkeypatch.setattr(
        FlashInferB12xExperts, "_supports_current_device", staticmethod(lambda: True)
    )


def _layer(backend="flashinfer_b12x", **kwargs):
    args = dict(
        num_experts=E,
        top_k=TOPK,
        hidden_size=H,
        intermediate_size=I,
        quant_config=ModelOptNvFp4Config.for_mode(),
        moe_backend=backend,
        device="cpu",
    )
    args.update(kwargs)
    return FusedMoE(**args)


# (FusedMoE arguments, the requirement the message must name)
REFUSED = {
    "fp16 activations": ({"params_dtype": torch.float16}, "must be bfloat16"),
    "hidden 192": ({"hidden_size": 192}, "multiple of 128"),
    "hidden 64": ({"hidden_size": 64}, "multiple of 128"),
    "expert parallel": (
        {"enable_expert_parallel": True, "tp_rank": 1, "tp_size": 2},
        "expert parallelism",
    ),
    "ep_size 2": ({"ep_rank": 0, "ep_size": 2}, "expert parallelism"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_kernel_backend_refuses_at_construction(sm12x, case):
    kwargs, requirement = REFUSED[case]
    with pytest.raises(ValueError, match=requirement):
        _layer(**kwargs)
    # The same layer builds with the emulation (which may keep EP and any
    # shape), and the unchanged arguments build with the kernel backend.
    _layer("flashinfer_b12x_emulated", **kwargs)
    _layer()


def _moe(**kwargs) -> FusedMoEConfig:
    args = dict(
        num_experts=E,
        experts_per_token=TOPK,
        hidden_dim=H,
        intermediate_size=I,
        num_local_experts=E,
        activation=MoEActivation.SILU,
        moe_parallel_config=FusedMoEParallelConfig(),
    )
    args.update(kwargs)
    return FusedMoEConfig(**args)


def _w4a4_config():
    return nvfp4_moe_quant_config(None, None, None, None, None, None)


@pytest.mark.parametrize("case", ["expert parallel", "intermediate"])
def test_experts_check_their_config_when_created(case):
    # Directly, as a modular-kernel user would build them.
    if case == "expert parallel":
        config = _moe(
            num_local_experts=E // 4,
            moe_parallel_config=FusedMoEParallelConfig(ep_size=4, use_ep=True),
        )
        want = "2 of 8 experts on this rank.*quant_mode='w4a16'"
    else:
        config = _moe(intermediate_size=8)
        want = "intermediate size per partition must be a positive multiple of 16"
    with pytest.raises(ValueError, match=want):
        FlashInferB12xExperts(config, _w4a4_config())
    if case == "expert parallel":
        FlashInferB12xEmulatedExperts(config, _w4a4_config())


def test_every_problem_is_listed_in_one_message():
    moe = _moe(
        hidden_dim=200,
        intermediate_size=8,
        in_dtype=torch.float32,
        num_local_experts=E // 2,
        moe_parallel_config=FusedMoEParallelConfig(ep_size=2, use_ep=True),
    )
    problems = flashinfer_b12x_call.b12x_config_problems(moe, weight_only=False)
    assert len(problems) == 4, problems
    ok = _moe(activation=MoEActivation.RELU2_NO_MUL)
    assert flashinfer_b12x_call.b12x_config_problems(ok, weight_only=False) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_max_num_tokens_must_be_a_positive_int(sm12x, bad):
    with pytest.raises(ValueError, match="max_num_tokens"):
        _layer(max_num_tokens=bad)


def test_fold_fallback_warns_once_with_the_reason(sm12x, monkeypatch, caplog):
    reason = "this flashinfer's B12xMoEWrapper.run has no input_global_scale"
    monkeypatch.setattr(
        flashinfer_b12x_moe,
        "flashinfer_takes_input_global_scale",
        lambda: Support.no(reason),
    )
    flashinfer_b12x_call.warn_fold_fallback.cache_clear()
    layer = _layer()
    experts = layer.quant_method.experts_for(layer)
    with caplog.at_level(logging.WARNING):
        modes = [experts.effective_global_scale_mode for _ in range(3)]
        other = _layer().quant_method.global_scale_mode
    assert modes == ["fold"] * 3 and other == "fold"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert reason in warnings[0].getMessage()
    assert '"alpha" falls back to "fold"' in warnings[0].getMessage()
    # Control: where the kernel takes the unfolded alpha, no warning.
    caplog.clear()
    monkeypatch.setattr(
        flashinfer_b12x_moe,
        "flashinfer_takes_input_global_scale",
        lambda: Support.yes(),
    )
    with caplog.at_level(logging.WARNING):
        assert experts.effective_global_scale_mode == "alpha"
    assert not caplog.records
