# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's weight reload (vLLM 0.34.0's ``model_loader/reload``) driven
on CPU for one NVFP4 MoE layer the release's own quant method prepares.

The model is a ``torch.nn.Module`` holding the ``RoutedExperts`` layer that
``FusedMoEFactory`` builds (upstream_layers.make_nvfp4_moe_layer), as a
model's constructor leaves it: ``record_metadata_for_reloading`` runs right
after it is built (``initialize_model`` does). A cold start loads a
synthetic checkpoint through each parameter's ``weight_loader`` (shard by
shard, as the model loader calls it) and runs upstream's
``process_weights_after_loading(model, ...)`` (which, with
``VLLM_RELOAD_MODE=direct``, records the checkpoint layout first). A
reload is upstream's ``start_reload`` -> the same loader calls ->
``finish_reload``, in the mode ``VLLM_RELOAD_MODE`` selects.

Call inside ``cpu_stand_ins.b12x_preparation_on_cpu`` and
``upstream_layers.one_rank_vllm``.
"""

from __future__ import annotations

import gc
import hashlib
from types import SimpleNamespace
from typing import Any

import torch

from upstream_env import load_slice_module
from upstream_layers import (
    W4A16_CONFIGS,
    MoEShape,
    SyntheticNvfp4Experts,
    checkpoint_format_of,
    checkpoint_params,
    make_nvfp4_moe_layer,
    synthetic_nvfp4_experts,
)

__all__ = [
    "MODEL_CONFIG",
    "cold_start",
    "layer_bytes",
    "load_through_weight_loader",
    "reload",
    "tensor_addresses",
]

#: What upstream's ``process_weights_after_loading(model, model_config,
#: device)`` reads of a model config (upstream's own reload tests pass the
#: same).
MODEL_CONFIG = SimpleNamespace(
    word_embeddings_untied_by_checkpoint=False, quantization=None, dtype=torch.bfloat16
)
_CPU = torch.device("cpu")
_MEM_UTILS = "vllm/utils/mem_utils.py"


def load_through_weight_loader(
    layer: torch.nn.Module, experts: SyntheticNvfp4Experts, config: str
) -> None:
    """Every shard of ``experts`` through each parameter's ``weight_loader``
    (upstream's ``RoutedExperts.weight_loader``, shard ids w1 / w3 / w2, one
    expert at a time, scalars per shard), as vLLM's model loader calls it;
    under the tensor names of ``config``'s checkpoint format (a W4A16 config,
    upstream_layers.W4A16_CONFIGS, has no input scales)."""
    params = dict(layer.named_parameters())
    i = experts.w13.shape[1] // 2
    prefix = "model.layers.0.mlp.experts"
    for name, value in checkpoint_params(experts, checkpoint_format_of(config)).items():
        if config in W4A16_CONFIGS and "input" in name:
            continue
        param = params[name]
        for e in range(value.shape[0]):
            if name.startswith("w13_"):
                for half, shard in enumerate(("w1", "w3")):
                    if value.dim() == 2:
                        part = value[e, half]
                    else:
                        part = value[e, half * i : (half + 1) * i]
                    param.weight_loader(param, part, f"{prefix}.{name}", shard, e)
            else:
                param.weight_loader(param, value[e], f"{prefix}.{name}", "w2", e)


def cold_start(
    shape: MoEShape, config: str, seed: int = 0, prefix: str = "model.layers.0"
) -> tuple[torch.nn.Module, SyntheticNvfp4Experts]:
    """A model of one MoE layer (``model.experts``), built, recorded for
    reloading, loaded with the synthetic checkpoint of ``seed`` and
    processed by upstream's ``process_weights_after_loading``."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = torch.nn.Module()
    model.experts = make_nvfp4_moe_layer(shape, config, prefix=f"{prefix}.mlp.experts")
    record_metadata_for_reloading(model)
    checkpoint = synthetic_nvfp4_experts(shape, seed)
    load_through_weight_loader(model.experts, checkpoint, config)
    process_weights_after_loading(model, MODEL_CONFIG, _CPU)
    return model, checkpoint


def reload(
    model: torch.nn.Module, checkpoint: SyntheticNvfp4Experts, config: str
) -> dict[str, Any]:
    """Upstream's ``start_reload`` -> every shard of ``checkpoint`` through
    the loaders -> ``finish_reload``, measured: ``peak_bytes`` above what was
    allocated before (torch's CPU allocator accounting, this repository's
    ``measure_peak_memory``, loaded by path)."""
    from vllm.model_executor.model_loader.reload import finish_reload, start_reload

    mem_utils = load_slice_module(_MEM_UTILS)
    gc.collect()
    with mem_utils.measure_peak_memory("cpu") as mem:
        start_reload(model)
        load_through_weight_loader(model.experts, checkpoint, config)
        finish_reload(model, MODEL_CONFIG, _CPU)
    return {"peak_bytes": mem.peak_bytes}


def _walk(obj: object, path: str, out: dict[str, int], seen: set[int]) -> None:
    # As upstream's test_reload_moe_kernels walks a served model (CUDA tensors
    # there; every tensor here): containers, modules and vLLM objects.
    if isinstance(obj, torch.Tensor):
        out[path] = obj.data_ptr()
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        items = {**vars(obj), **obj._parameters, **obj._buffers, **obj._modules}
    elif isinstance(obj, dict):
        items = dict(obj)
    elif isinstance(obj, (list, tuple)):
        items = dict(enumerate(obj))
    elif type(obj).__module__.startswith("vllm."):
        items = dict(getattr(obj, "__dict__", {}))
        if hasattr(obj, "__dataclass_fields__"):
            items.update({f: getattr(obj, f) for f in obj.__dataclass_fields__})
    else:
        return
    for name, value in items.items():
        if name == "weight_prep_state":
            continue  # bookkeeping of the preparation, not read by a kernel
        _walk(value, f"{path}.{name}", out, seen)


def tensor_addresses(model: torch.nn.Module) -> dict[str, int]:
    """Path -> ``data_ptr`` of every tensor reachable from ``model`` through
    modules, containers and vLLM objects (quant method, modular kernel,
    experts, their bound views and derived tensors)."""
    out: dict[str, int] = {}
    _walk(model, "model", out, set())
    return out


def layer_bytes(model: torch.nn.Module, config: str) -> dict[str, str]:
    """sha256 of each parameter's bytes (but a retired one's: upstream keeps
    it loaded and no kernel reads it) and of each tensor the experts bind
    (their views and derived tensors), by name: what a kernel reads. W4A16
    (``config`` in W4A16_CONFIGS): the input scales' parameters left out."""

    def digest(t: torch.Tensor) -> str:
        data = t.detach().contiguous().view(torch.uint8).numpy()
        return hashlib.sha256(data).hexdigest()

    layer = model.experts
    weight_only = config in W4A16_CONFIGS
    out = {
        n: digest(p)
        for n, p in layer.named_parameters()
        # A retired parameter stays loaded and no kernel reads it; a W4A16
        # checkpoint has no input scales: create_weights' parameters for them
        # are never loaded (their bytes are whatever they were created with).
        if not getattr(p, "retired", False) and not (weight_only and "input" in n)
    }
    prepared = getattr(layer.quant_method.moe_kernel.fused_experts, "prepared", None)
    for field in getattr(prepared, "__dataclass_fields__", {}):
        value = getattr(prepared, field)
        if isinstance(value, torch.Tensor):
            out[f"experts.{field}"] = digest(value)
    return out
