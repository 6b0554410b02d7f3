# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""On CUDA a step is recorded done only after the device has finished it:
one synchronization at the end of each step (not per chunk), before the
record. The CPU test watches the one sync point; the CUDA test counts real
synchronizations."""

import pytest
import torch

from tests.kernels.moe.utils import (
    bf16_experts,
    load_nvfp4_experts,
    make_nvfp4_layer,
    quantize_experts_modelopt,
)
from vllm.model_executor.layers.fused_moe.experts import flashinfer_b12x_moe
from vllm.model_executor.layers.fused_moe.weight_prep_state import get_prep_state

E, H, I, TOPK = 4, 256, 128, 2  # noqa: E741
STEPS = ["validate", "fold", "reorder", "swizzle", "finalize"]


def _loaded_layer(device, cap=4096):
    # A small cap: every step runs in several chunks, yet waits once.
    w1, w2 = bf16_experts(E, I, H, gated=True, seed=3)
    layer = make_nvfp4_layer(E, TOPK, H, I, True, "flashinfer_b12x_emulated",
                             device=device, max_transient_bytes=cap)  # fmt: skip
    load_nvfp4_experts(layer, quantize_experts_modelopt(w1, w2, gated=True))
    return layer


def test_each_step_waits_once_before_it_is_recorded(monkeypatch):
    layer = _loaded_layer("cpu")
    state = get_prep_state(layer)
    seen = []

    def wait(device):
        seen.append((device, list(state.done)))

    monkeypatch.setattr(flashinfer_b12x_moe, "_wait_for_step", wait)
    layer.quant_method.process_weights_after_loading(layer)
    # One wait per step, each before its step is in ``done``.
    assert [done for _, done in seen] == [STEPS[:i] for i in range(len(STEPS))]
    assert all(device == layer.w13_weight.device for device, _ in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_preparation_synchronizes_once_per_step(monkeypatch):
    layer = _loaded_layer("cuda")
    real, count = torch.cuda.synchronize, []

    def counting(device=None):
        count.append(device)
        real(device)

    monkeypatch.setattr(torch.cuda, "synchronize", counting)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(count) == len(STEPS)
