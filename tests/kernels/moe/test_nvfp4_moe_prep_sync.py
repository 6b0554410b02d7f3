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
from vllm.model_executor.layers.fused_moe import weight_prep_state
from vllm.model_executor.layers.fused_moe.weight_prep_guard import get_prep_state

E, H, I, TOPK = 4, 256, 128, 2  # noqa: E741
STEPS = ["validate", "fold", "reorder", "swizzle", "finalize"]


def _loaded_layer(device, cap=4096):
    # A small cap: every step runs in several chunks, yet waits once.
    w1, w2 = bf16_experts(E, I, H, gated=True, seed=3)
    layer = make_nvfp4_layer(
        E,
        TOPK,
        H,
        I,
        True,
        "flashinfer_b12x_emulated",
        device=device,
        max_transient_bytes=cap,
    )
    load_nvfp4_experts(layer, quantize_experts_modelopt(w1, w2, gated=True))
    return layer


def test_each_step_waits_once_before_it_is_recorded(monkeypatch):
    layer = _loaded_layer("cpu")
    state = get_prep_state(layer)
    seen = []

    def wait(device):
        seen.append((device, list(state.done)))

    monkeypatch.setattr(weight_prep_state, "wait_for_step", wait)
    layer.quant_method.process_weights_after_loading(layer)
    # One wait per step, each before its step is in ``done``.
    assert [done for _, done in seen] == [STEPS[:i] for i in range(len(STEPS))]
    assert all(device == layer.w13_weight.device for device, _ in seen)


@pytest.mark.parametrize(
    "device,waits",
    [
        ("cuda", True),
        ("cuda:0", True),
        ("cuda:1", True),
        ("cpu", False),
        ("meta", False),
    ],
)
def test_the_wait_synchronizes_exactly_the_cuda_devices(monkeypatch, device, waits):
    # The decision the CUDA test alone would see, on CPU: torch.device
    # objects of any index stand in for the step's device, a CUDA
    # accelerator is reported, a recorder stands in for
    # torch.accelerator.synchronize. mark_done waits before it records.
    dev = torch.device(device)
    state = weight_prep_state.MoEWeightPrepState()
    calls = []

    def synchronize(d=None):
        calls.append((d, list(state.done)))

    monkeypatch.setattr(torch.accelerator, "synchronize", synchronize)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda: torch.device("cuda")
    )
    weight_prep_state.wait_for_step(dev)
    assert calls == ([(dev, [])] if waits else [])
    calls.clear()
    state.mark_done("validate", dev)
    assert calls == ([(dev, [])] if waits else [])
    assert state.done == ["validate"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_preparation_synchronizes_once_per_step(monkeypatch):
    layer = _loaded_layer("cuda")
    real, count = torch.accelerator.synchronize, []

    def counting(device=None):
        count.append(device)
        real(device)

    monkeypatch.setattr(torch.accelerator, "synchronize", counting)
    layer.quant_method.process_weights_after_loading(layer)
    assert len(count) == len(STEPS)


def test_w4a16_steps_wait_once_before_they_are_recorded(monkeypatch):
    # The W4A16 experts record their steps through the same function: each
    # step waits once, before it is in ``done`` (it did not wait at all when
    # the W4A16 class kept its own copy of the loop).
    from tests.kernels.moe.nvfp4_w4a16_utils import w4a16_layer, w4a16_tensors

    layer = w4a16_layer(E, H, I, True, cap=64 * 1024)
    load_nvfp4_experts(layer, w4a16_tensors(E, H, I, True, seed=3))
    state = get_prep_state(layer)
    steps = [n for n, _ in layer.quant_method.preparation_steps(layer)]
    seen = []
    monkeypatch.setattr(
        weight_prep_state, "wait_for_step", lambda device: seen.append(list(state.done))
    )
    layer.quant_method.process_weights_after_loading(layer)
    assert len(steps) > 2 and seen == [steps[:i] for i in range(len(steps))]


def _restore_waits(layer, monkeypatch):
    layer.quant_method.process_weights_after_loading(layer)
    state = get_prep_state(layer)
    seen = []
    monkeypatch.setattr(
        weight_prep_state, "wait_for_step", lambda device: seen.append(list(state.done))
    )
    layer.quant_method.restore_load_layout(layer)
    return seen


def test_restore_steps_wait_once_before_they_are_recorded(monkeypatch):
    # Restore steps are recorded the same way (they did not wait before).
    seen = _restore_waits(_loaded_layer("cpu"), monkeypatch)
    steps = ["unswizzle.w13_weight_scale", "unswizzle.w2_weight_scale", "unreorder"]
    assert seen == [steps[:i] for i in range(len(steps))]


def test_w4a16_restore_steps_wait_once_before_they_are_recorded(monkeypatch):
    from tests.kernels.moe.nvfp4_w4a16_utils import w4a16_layer, w4a16_tensors

    layer = w4a16_layer(E, H, I, True, cap=64 * 1024)
    load_nvfp4_experts(layer, w4a16_tensors(E, H, I, True, seed=3))
    seen = _restore_waits(layer, monkeypatch)
    assert seen == [[], ["unpack.w13"]]


class _DeviceError(RuntimeError):
    pass


@pytest.mark.parametrize("failing", [0, 2], ids=["validate", "reorder"])
def test_a_failed_wait_records_nothing_and_a_retry_completes(monkeypatch, failing):
    # A device error raised by a step's wait: that step is not recorded (the
    # validation's leaves the layer LOADING, as a ValueError would), and a
    # second call completes the preparation with the bytes of a clean one.
    clean = _loaded_layer("cpu")
    clean.quant_method.process_weights_after_loading(clean)
    layer = _loaded_layer("cpu")
    state = get_prep_state(layer)
    calls = []

    def wait(device):
        calls.append(list(state.done))
        if len(calls) == failing + 1:
            raise _DeviceError("the device failed")

    monkeypatch.setattr(weight_prep_state, "wait_for_step", wait)
    with pytest.raises(_DeviceError):
        layer.quant_method.process_weights_after_loading(layer)
    assert state.done == STEPS[:failing]
    if failing == 0:
        assert state.status is weight_prep_state.PrepStatus.LOADING
    layer.quant_method.process_weights_after_loading(layer)
    assert state.status is weight_prep_state.PrepStatus.PREPARED
    for name, p in clean.named_parameters():
        assert torch.equal(
            getattr(layer, name).view(torch.uint8), p.view(torch.uint8)
        ), name
