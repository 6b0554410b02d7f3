# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's weight reload of a layer the fork's experts prepared, both
modes (``VLLM_RELOAD_MODE`` layerwise, the default, and direct), ModelOpt
and compressed-tensors, W4A4 and W4A16, FLASHINFER_B12X: a reload with
another checkpoint leaves the bytes a cold start with that checkpoint
leaves; in direct mode every tensor reachable from the model (parameters,
the experts' views and derived tensors) keeps its address; or the reload is
refused before any byte changes, naming the reason (upstream_reload.py
drives it).
"""

from __future__ import annotations

import pytest
from upstream_reload import cold_start, layer_bytes, reload, tensor_addresses

from upstream_env import UPSTREAM_VERSION
from upstream_layers import QWEN36_35B_A3B, SMALL, synthetic_nvfp4_experts

pytestmark = pytest.mark.skipif(
    UPSTREAM_VERSION == "0.33.0",
    reason="vLLM 0.33.0 has no direct reload and no reload lifecycle "
    "(model_loader/reload/lifecycle.py, direct.py are 0.34.0's)",
)

CONFIGS = (
    "modelopt",
    "compressed-tensors",
    "modelopt-w4a16",
    "compressed-tensors-w4a16",
)
MODES = ("direct", "layerwise")
_MiB = 1 << 20


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_reload_gives_the_cold_start_bytes(
    one_rank_b12x_vllm, monkeypatch, upstream_measurements, config, mode
):
    monkeypatch.setenv("VLLM_RELOAD_MODE", mode)
    model, _ = cold_start(SMALL, config, seed=0, prefix="model.layers.0")
    old_bytes = layer_bytes(model, config)
    before = tensor_addresses(model)
    new = synthetic_nvfp4_experts(SMALL, seed=1)
    measured = reload(model, new, config)
    fresh, _ = cold_start(SMALL, config, seed=1, prefix="model.layers.1")
    got, want = layer_bytes(model, config), layer_bytes(fresh, config)
    assert got == want
    assert got != old_bytes  # control: the reload changed what the kernel reads
    after = tensor_addresses(model)
    moved = sorted(k for k, ptr in before.items() if after.get(k) != ptr)
    upstream_measurements(
        f"reload {mode} {config} {SMALL.id}",
        f"cold-start bytes; {len(moved)} of {len(before)} addresses moved; "
        f"peak {measured['peak_bytes'] / _MiB:.2f} MiB",
    )
    if mode == "direct":
        assert moved == []


def _layer_sizes(model) -> int:
    return sum(p.nbytes for p in model.experts.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", ["modelopt", "compressed-tensors-w4a16"])
def test_qwen36_layer_reload_peak(
    one_rank_b12x_vllm, monkeypatch, upstream_measurements, config, mode
):
    """At the Qwen3.6-35B-A3B layer: direct reload at most 4 MiB above the
    weights; layerwise at most 4 MiB above the layer copy upstream's
    layerwise reload materializes in the load layout (its own design)."""
    monkeypatch.setenv("VLLM_RELOAD_MODE", mode)
    model, _ = cold_start(QWEN36_35B_A3B, config, seed=0, prefix="model.layers.2")
    before = tensor_addresses(model)
    measured = reload(model, synthetic_nvfp4_experts(QWEN36_35B_A3B, seed=1), config)
    after = tensor_addresses(model)
    moved = sorted(k for k, ptr in before.items() if after.get(k) != ptr)
    copy = _layer_sizes(model) if mode == "layerwise" else 0
    upstream_measurements(
        f"reload {mode} {config} {QWEN36_35B_A3B.id}",
        f"peak {measured['peak_bytes'] / _MiB:.2f} MiB (layer copy of upstream's "
        f"layerwise reload: {copy / _MiB:.1f} MiB); {len(moved)} addresses moved",
    )
    assert measured["peak_bytes"] <= copy + 4 * _MiB
    if mode == "direct":
        assert moved == []


def test_direct_reload_of_a_changed_layer_is_refused_before_any_write(
    one_rank_b12x_vllm, monkeypatch
):
    import torch

    from vllm.model_executor.model_loader.reload import start_reload

    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    model, _ = cold_start(SMALL, "modelopt", seed=0, prefix="model.layers.4")
    with torch.no_grad():
        model.experts.w2_weight.add_(1)  # behind the experts' back
    before = layer_bytes(model, "modelopt")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"direct reload: experts: .*w2_weight"):
        start_reload(model)
    assert layer_bytes(model, "modelopt") == before
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
    assert not getattr(model, "_direct_reload_begun", False)


def test_direct_reload_in_fold_mode_is_refused_layerwise_reloads(
    one_rank_b12x_vllm, monkeypatch
):
    from vllm.model_executor.model_loader.reload import start_reload

    monkeypatch.setenv("VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE", "fold")
    monkeypatch.setenv("VLLM_RELOAD_MODE", "direct")
    model, _ = cold_start(SMALL, "modelopt", seed=0, prefix="model.layers.5")
    before = layer_bytes(model, "modelopt")
    with pytest.raises(RuntimeError, match="fold.*VLLM_RELOAD_MODE=layerwise"):
        start_reload(model)
    assert layer_bytes(model, "modelopt") == before
    monkeypatch.setenv("VLLM_RELOAD_MODE", "layerwise")
    model, _ = cold_start(SMALL, "modelopt", seed=0, prefix="model.layers.6")
    reload(model, synthetic_nvfp4_experts(SMALL, seed=1), "modelopt")
    fresh, _ = cold_start(SMALL, "modelopt", seed=1, prefix="model.layers.7")
    assert layer_bytes(model, "modelopt") == layer_bytes(fresh, "modelopt")
