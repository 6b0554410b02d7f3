# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each MoE layer's weight preparation measured inside vLLM's own loader: the
peak of torch's CPU allocations above the start while the layer's quant
method runs ``process_weights_after_loading`` (torch.profiler with
``profile_memory=True``: the running sum of ``self_cpu_memory_usage`` over
``prof.events()`` sorted by start, ``moe_weight_prep._running_peak``).
"""

from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from cpu_loading import load_model
from torch.profiler import ProfilerActivity, profile

from vllm.config import VllmConfig

from moe_weight_prep import _running_peak

__all__ = ["load_model_measured", "peak_bytes"]


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of torch's CPU allocations above the start while ``fn()`` runs."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _running_peak(prof.events())


def load_model_measured(
    checkpoint: str | Path, **engine_args
) -> tuple[torch.nn.Module, VllmConfig, dict[str, int]]:
    """``cpu_loading.load_model``, and per MoE layer (by module name) the
    peak of its preparation; nothing else changed."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
        FusedMoEMethodBase,
    )
    from vllm.model_executor.model_loader import base_loader

    process_all = base_loader.process_weights_after_loading
    peaks: dict[str, int] = {}

    def process_measured(model, model_config, target_device):
        wrapped = []
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, FusedMoEMethodBase):
                continue
            prepare = method.process_weights_after_loading

            def measured(layer, prepare=prepare, name=name):
                peaks[name] = peak_bytes(lambda: prepare(layer))

            method.process_weights_after_loading = measured
            wrapped.append(method)
        process_all(model, model_config, target_device)
        for method in wrapped:
            del method.process_weights_after_loading

    with mock.patch.object(
        base_loader, "process_weights_after_loading", process_measured
    ):
        model, cfg = load_model(checkpoint, **engine_args)
    return model, cfg, peaks
