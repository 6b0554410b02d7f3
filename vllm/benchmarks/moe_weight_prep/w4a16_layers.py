# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One process's W4A16 layers in ``vllm bench moe-weight-prep --quant-mode w4a16``:
W4A16 (weight-only NVFP4) expert preparation for FlashInfer's b12x kernel,
FlashInfer's way beside this tree's, per layer and for the model.

For every MoE layer (synthetic of a preset's shapes, or a checkpoint's
W4A16 layers), each variant on its own copy of the layer::

    flashinfer-public    a full packed copy beside the source, kept
      (model)            (FlashInfer's public path, made with this package's
                         whole-tensor reference; always runs)
    flashinfer-public    FlashInfer's own prepare function, reuse_input_
                         storage=False   } where flashinfer is importable
    flashinfer-inplace   the same, reuse_input_storage=True (private mode) }
    bounded              this tree: FusedMoE(quant_mode="w4a16")'s
                         process_weights_after_loading, in place, under the cap
    -> check: every variant gives the bytes of the first

Each variant is timed on every layer and metered once per distinct shape
(:func:`vllm.utils.mem_utils.measure_peak_memory`; the CPU meter slows code
down): its *peak* above the layer's resident tensors and what it *keeps*
beside them afterwards. The model figures add the layers up: time and kept
bytes summed, and the model peak is what the earlier layers keep plus the
largest peak of one layer (a kept copy stays while its source lives). A
memcpy of the layer's bytes is timed beside them (the floor), and the
bounded result's precision is reported against the checkpoint.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from vllm.benchmarks.moe_weight_prep.baselines import (
    PACKED_FIELDS,
    flashinfer_w4a16_prepare,
    flashinfer_w4a16_unavailable_reason,
    public_copy_reference,
)
from vllm.benchmarks.moe_weight_prep.checks import check_num_layers, same_bytes
from vllm.benchmarks.moe_weight_prep.layer import make_layer
from vllm.benchmarks.moe_weight_prep.precision import w4a16_precision
from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.shard import RankShard
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors
from vllm.entrypoints.process_policy import preparing_weights
from vllm.model_executor.layers.fused_moe.weight_prep_state import wait_for_step
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)
from vllm.utils.mem_utils import measure_peak_memory

__all__ = [
    "UNTIMED_VARIANTS",
    "run_w4a16_benchmark",
]

#: Variants run for their memory and bytes only, never timed: the modelled
#: public path runs the package's reference, written to be read, not to be
#: fast (FlashInfer's own functions give the public path's time).
UNTIMED_VARIANTS = frozenset({"flashinfer-public-model"})


def _flashinfer_inputs(tensors: dict) -> dict[str, torch.Tensor]:
    """The layer's tensors as FlashInfer's W4A16 API takes them (copies):
    swizzled block scales, one global scale per expert and weight (w1's for
    w13; gate and up share it in ModelOpt exports)."""
    e = tensors["w13_weight"].shape[0]
    return {
        "w13": tensors["w13_weight"].clone(),
        "w13_scale_swizzled": swizzle_blockscale(tensors["w13_weight_scale"]),
        "w13_global": tensors["w13_weight_scale_2"].reshape(e, -1)[:, 0].clone(),
        "w2": tensors["w2_weight"].clone(),
        "w2_scale_swizzled": swizzle_blockscale(tensors["w2_weight_scale"]),
        "w2_global": tensors["w2_weight_scale_2"].reshape(e).clone(),
    }


def _variants(preset, device, cap, flashinfer: bool) -> dict[str, Callable]:
    """Variant -> ``run(tensors) -> (prepare, result)``: ``prepare()`` is
    what is timed and metered; ``result()`` its packed tensors by
    :data:`PACKED_FIELDS` name, read after it."""
    gated = preset.is_gated

    def public_model(tensors):
        args, out = _flashinfer_inputs(tensors), {}
        return (
            lambda: out.update(public_copy_reference(**args, gated=gated)),
            lambda: out,
        )

    def flashinfer_fn(reuse: bool):
        def run(tensors):
            args, out = _flashinfer_inputs(tensors), {}

            def prepare():
                out.update(
                    flashinfer_w4a16_prepare(
                        **args, gated=gated, reuse_input_storage=reuse
                    )
                )

            return prepare, lambda: out

        return run

    def bounded(tensors):
        layer = make_layer(
            preset, RankShard(), device, tensors, cap, quant_mode="w4a16"
        )

        def prepare():
            with preparing_weights(device):
                layer.quant_method.process_weights_after_loading(layer)

        def result():
            pw = layer.quant_method.experts.prepared
            return {name: getattr(pw, name) for name in PACKED_FIELDS} | {
                "_layer": layer
            }

        return prepare, result

    out = {"flashinfer-public-model": public_model}
    if flashinfer:
        out["flashinfer-public"] = flashinfer_fn(False)
        out["flashinfer-inplace"] = flashinfer_fn(True)
    out["bounded"] = bounded
    return out


def _memcpy_time(tensors: dict, device: torch.device) -> float:
    """Seconds to copy the layer's weights and block scales once (the floor
    of any preparation that moves every byte)."""
    names = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")
    srcs = [tensors[n].view(torch.uint8) for n in names]
    dsts = [torch.empty_like(s) for s in srcs]
    for d, s in zip(dsts, srcs, strict=True):  # touch the pages first
        d.copy_(s)
    wait_for_step(device)
    start = time.perf_counter()
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s)
    wait_for_step(device)
    return time.perf_counter() - start


def run_w4a16_benchmark(
    preset: MoEModelPreset,
    *,
    device: torch.device,
    num_layers: int | None = None,
    max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
    memory_limit: int | None = None,
    seed: int = 0,
    progress: bool = True,
    layer_tensors: Callable[[int], dict[str, torch.Tensor]] | None = None,
    flashinfer: bool | None = None,
) -> dict:
    """Prepare ``num_layers`` W4A16 layers of ``preset`` every way.

    ``layer_tensors(i)``, if given, returns the i-th layer's parameters
    (checkpoint layout, ModelOpt scale direction), e.g. from a checkpoint's
    W4A16 layers; otherwise the layers are synthetic. ``flashinfer``: run
    FlashInfer's own functions (default: where importable).

    Returns a JSON-serializable dict (configuration, per layer and variant
    time/peak/kept, the summary per variant and for the model, the memcpy
    floor, precision, ``flashinfer_skipped``: why FlashInfer's own functions
    did not run, or None; ``memory_limit_ok``: whether the bounded peak fits
    ``memory_limit``, checked against the meter, None without a limit).
    RuntimeError if two variants differ in bytes.
    """
    layers = check_num_layers(preset, num_layers)
    why_not = flashinfer_w4a16_unavailable_reason()
    if flashinfer is None:
        flashinfer = why_not is None
    elif flashinfer and why_not is not None:
        raise ValueError(f"FlashInfer's W4A16 preparation cannot run: {why_not}")
    variants = _variants(preset, device, max_transient_bytes, flashinfer)
    per_layer: list[dict] = []
    metered: dict[tuple, dict[str, tuple[int, int]]] = {}
    precision = None
    memcpy: list[float] = []
    gate_up_differ = 0  # experts of a layer whose gate and up scale_2 differ
    resident = 0
    synthetic = None
    with measure_peak_memory(device):  # the profiler's first start is slow
        pass
    for idx in tqdm(
        range(layers), desc=f"{preset.name} w4a16", unit="layer", disable=not progress
    ):
        if layer_tensors is None:
            if synthetic is None:
                synthetic = synthetic_layer_tensors(preset, 1, device, seed)
            tensors = synthetic
        else:
            tensors = layer_tensors(idx)
        resident = sum(t.numel() * t.element_size() for t in tensors.values())
        shape_key = tuple((k, tuple(v.shape)) for k, v in tensors.items())
        check = layer_tensors is not None or idx == 0
        s13 = tensors["w13_weight_scale_2"].reshape(preset.num_experts, -1)
        differ = int((s13 != s13[:, :1]).any(dim=1).sum())
        gate_up_differ = max(gate_up_differ, differ)
        new_shape = shape_key not in metered
        sizes = metered.setdefault(shape_key, {})
        row: dict[str, dict] = {}
        reference = None
        for name, make in variants.items():
            timed = name not in UNTIMED_VARIANTS
            row[name] = {"time_s": None}
            if not (timed or new_shape or check):
                continue
            prepare, result = make(tensors)
            if timed:
                start = time.perf_counter()
                prepare()
                wait_for_step(device)
                row[name]["time_s"] = time.perf_counter() - start
            elif new_shape:
                with measure_peak_memory(device) as mem:
                    prepare()
                sizes[name] = (mem.peak_bytes, mem.net_bytes)
            else:
                prepare()
            out = result()
            if check and reference is None:
                reference = (name, out)
            elif check:
                for field in PACKED_FIELDS:
                    if field == "w2_global_scale" and differ and name == "bounded":
                        continue  # carries up / gate: FlashInfer's cannot
                    if not same_bytes(out[field], reference[1][field]):
                        raise RuntimeError(
                            f"layer {idx}: {name} differs from {reference[0]} in "
                            f"{field}"
                        )
            if name == "bounded" and idx == 0:
                e = preset.num_experts
                precision = w4a16_precision(out, tensors, sorted({0, e // 2, e - 1}))
            del out, prepare, result
            if timed and new_shape:  # metered on a fresh copy
                prepare, result = make(tensors)
                with measure_peak_memory(device) as mem:
                    prepare()
                sizes[name] = (mem.peak_bytes, mem.net_bytes)
                del prepare, result
        del reference
        for name in variants:
            peak, kept = sizes[name]
            row[name].update(peak_bytes=peak, kept_bytes=max(0, kept))
        memcpy.append(_memcpy_time(tensors, device))
        per_layer.append(row)
        del tensors
    summary = {}
    for name in variants:
        rows = [r[name] for r in per_layer]
        times = [r["time_s"] for r in rows if r["time_s"] is not None]
        kept = [r["kept_bytes"] for r in rows]
        peaks = [r["peak_bytes"] for r in rows]
        summary[name] = {
            "median_time_per_layer_s": statistics.median(times) if times else None,
            "peak_per_layer_bytes": max(peaks),
            "kept_per_layer_bytes": max(kept),
            "model_time_s": sum(times) if times else None,
            "model_kept_bytes": sum(kept),
            "model_peak_bytes": max(sum(kept[:i]) + peaks[i] for i in range(len(rows))),
        }
    return {
        "quant_mode": "w4a16",
        "model": preset.name,
        "hf_id": preset.hf_id,
        "source": "synthetic" if layer_tensors is None else "checkpoint",
        "device": str(device),
        "torch": torch.__version__,
        "num_layers": layers,
        "activation": preset.activation,
        "max_transient_bytes": max_transient_bytes,
        "resident_bytes_per_layer": resident,
        "flashinfer_skipped": None if flashinfer else why_not or "not requested",
        "memcpy_median_time_per_layer_s": statistics.median(memcpy),
        "memcpy_model_time_s": sum(memcpy),
        "precision": precision,
        "gate_up_scales_differ": gate_up_differ,
        "summary": summary,
        "layers": per_layer,
        "memory_limit_bytes": memory_limit,
        "memory_limit_ok": None
        if memory_limit is None
        else summary["bounded"]["peak_per_layer_bytes"] <= memory_limit,
    }
