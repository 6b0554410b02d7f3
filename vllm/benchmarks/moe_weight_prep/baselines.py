# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Baselines only: the preparations the bounded one is measured against.
Nothing on the production path imports this module.

W4A4: faithful models of the earlier NVFP4 MoE weight preparation
(:func:`legacy_preparation_steps` and its parts, and the first in-place
fixes).

W4A16: FlashInfer 0.7.4's preparation (``prepare_w4a16_modelopt_nvfp4_weights``
/ ``prepare_w4a16_compressed_tensors_weights``), whose public path
(``reuse_input_storage=False``) keeps a full packed copy of the layer beside
the source. Two baselines, both on the tensors as FlashInfer's API takes them
(128x4-swizzled block scales, float32 [E] global scales, w13 as [w1; w3] =
[gate; up], ``w13_layout="gate_up"``):

* :func:`public_copy_reference`: that public path's memory behaviour, made
  with this package's whole-tensor reference
  (:mod:`~vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout`): the
  block scales unswizzled into new tensors, new packed tensors of the full
  size filled one expert at a time, the result kept. Always available.
* :func:`flashinfer_w4a16_prepare`: FlashInfer's own function (public, or its
  private ``reuse_input_storage=True`` mode), where flashinfer is importable.
  On CPU its one CUDA query (the SM count, for a workspace of SMs * 4 + 2
  int32) is answered by a stand-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import statistics
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from unittest import mock

import torch

from vllm.entrypoints.process_policy import PREP_CPU_THREADS, preparing_weights
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
    W4A16PackedWeights,
)
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    swizzle_blockscale_bounded,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_global_scale,
    w4a16_pack_blockscale,
    w4a16_pack_weight,
    w4a16_scale_exponent,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    swizzled_blockscale_shape,
    unswizzle_blockscale,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    swizzle_blockscale,
)

__all__ = [
    "CPU_STAND_IN_SM_COUNT",
    "PACKED_FIELDS",
    "clone_chunk_reorder",
    "flashinfer_w4a16_prepare",
    "flashinfer_w4a16_unavailable_reason",
    "float_chunk_fold_",
    "legacy_fold",
    "legacy_preparation_steps",
    "measure_alternatives",
    "legacy_swizzle",
    "public_copy_reference",
    "split_cat_halves",
    "split_cat_reorder",
]

# --- W4A4: the earlier preparation ---------------------------------------------


def split_cat_halves(t: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """A NEW tensor with the two halves of ``t`` along ``dim`` swapped,
    built with split + cat: ``[a; b] -> [b; a]``. Also the tests' independent
    reference for the in-place reorder."""
    first, second = t.chunk(2, dim=dim)
    return torch.cat([second, first], dim=dim).contiguous()


def split_cat_reorder(
    weight: torch.Tensor, scale: torch.Tensor, dim: int = -2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-change reorder: NEW tensors ``cat([w3, w1], dim)`` (a full copy
    of each beside the originals)."""
    return split_cat_halves(weight, dim), split_cat_halves(scale, dim)


def clone_chunk_reorder(
    weight: torch.Tensor,
    scale: torch.Tensor,
    dim: int = -2,
    chunk_bytes: int = 64 << 20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first in-place fix: per chunk of about ``chunk_bytes`` of the
    first half (whole rows before ``dim``, at least one),
    ``tmp = a.clone(); a.copy_(b); b.copy_(tmp)``: a new temporary each."""
    for t in (weight, scale):
        d = dim % t.dim()
        outer = 1
        for s in t.shape[:d]:
            outer *= s
        halves = t.view(outer, 2, -1)
        row_bytes = halves.shape[2] * t.element_size()
        step = max(1, chunk_bytes // max(row_bytes, 1))
        for start in range(0, outer, step):
            a = halves[start : start + step, 0]
            b = halves[start : start + step, 1]
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)
            del tmp  # at most one chunk alive: the 64 MiB bound it promised
    return weight, scale


def legacy_swizzle(scale: torch.Tensor) -> torch.Tensor:
    """Pre-change swizzle of [E, R, C] scales: an explicit zero-padded copy of
    the whole tensor, then a permuted contiguous copy (2x the scale's size
    alive beside the original)."""
    e, r, c = scale.shape
    rp, cp = swizzled_blockscale_shape(r, c)
    padded = torch.zeros((e, rp, cp), dtype=torch.uint8, device=scale.device)
    padded[:, :r, :c] = scale.view(torch.uint8)
    return swizzle_blockscale(padded).view(torch.float8_e4m3fn)


def legacy_fold(scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Pre-change fold on the whole (swizzled) tensor:
    ``(scale.float() * scale_2) -> fp8`` with one global scale per expert
    (for w13, w1's: a different w3 scale was dropped with a warning).
    Float32 temporaries of 4x the scale's size, twice."""
    e = scale.shape[0]
    per_expert = scale_2.reshape(e, -1)[:, 0].view(e, 1, 1)
    folded = scale.float() * per_expert
    return folded.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def float_chunk_fold_(
    scale: torch.Tensor, scale_2: torch.Tensor, chunk_bytes: int = 2 << 20
) -> torch.Tensor:
    """The first bounded fold (before the lookup tables), in place: whole
    experts at a time through a float32 buffer of ``chunk_bytes``:
    ``fp8(clamp(float(scale) * scale_2))``, ``scale_2`` [E] or [E, G] (G row
    groups). Assumes one expert's float32 copy fits the buffer."""
    e, r, c = scale.shape
    groups = scale_2.reshape(e, -1).shape[1]
    segs = scale.view(e, groups, (r // groups) * c)
    factors = scale_2.reshape(e, groups, 1).float()
    per = max(1, chunk_bytes // (4 * r * c))
    buf = torch.empty(per * r * c, dtype=torch.float32, device=scale.device)
    for first in range(0, e, per):
        src = segs[first : first + per]
        tmp = buf[: src.numel()].view(src.shape)
        tmp.copy_(src)  # FP8 -> float32: most of this fold's time
        tmp.mul_(factors[first : first + per])
        tmp.clamp_(-448.0, 448.0)
        src.copy_(tmp)
    return scale


def legacy_preparation_steps(
    tensors: dict[str, torch.Tensor], gated: bool
) -> list[tuple[str, Callable[[], None]]]:
    """The pre-change b12x preparation as named steps over ``tensors`` (the
    layer's parameters by name), each replacing the entries it rewrites, so
    old tensors are freed as in a layer whose parameters are replaced:
    ``reorder`` (split + cat), ``swizzle`` (padded + permuted copies),
    ``fold`` (float32 whole-tensor products)."""

    def reorder() -> None:
        if gated:
            w, s = split_cat_reorder(tensors["w13_weight"], tensors["w13_weight_scale"])
            tensors["w13_weight"], tensors["w13_weight_scale"] = w, s
            del w, s

    def swizzle() -> None:
        for name in ("w13_weight_scale", "w2_weight_scale"):
            tensors[name] = legacy_swizzle(tensors[name])

    def fold() -> None:
        for name in ("w13", "w2"):
            tensors[f"{name}_weight_scale"] = legacy_fold(
                tensors[f"{name}_weight_scale"], tensors[f"{name}_weight_scale_2"]
            )
            tensors[f"{name}_weight_scale_2"] = torch.ones_like(
                tensors[f"{name}_weight_scale_2"]
            )

    return [("reorder", reorder), ("swizzle", swizzle), ("fold", fold)]


# --- W4A16: FlashInfer's preparation --------------------------------------------

#: The six tensors of FlashInfer's ``W4A16PackedWeights`` compared here:
#: those of the experts' record of the same name.
PACKED_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(W4A16PackedWeights)
    if f.type in ("torch.Tensor", torch.Tensor)
)
#: SMs reported to FlashInfer on CPU (an RTX 5090's 170); it only sizes the
#: workspace, 170 * 4 + 2 int32.
CPU_STAND_IN_SM_COUNT = 170


def _check_inputs(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of uint8 w13 [E, rows, H/2] and w2 [E, H, I/2]."""
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != torch.uint8 or t.dim() != 3:
            raise ValueError(
                f"{name}: expected packed FP4 uint8 [E, N, K/2], got {t.dtype} "
                f"{tuple(t.shape)}"
            )
    e, h, half_i = w2.shape
    return e, h, 2 * half_i


def public_copy_reference(
    w13: torch.Tensor,
    w13_scale_swizzled: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_swizzled: torch.Tensor,
    w2_global: torch.Tensor,
    *,
    gated: bool,
) -> dict[str, torch.Tensor]:
    """FlashInfer's public W4A16 preparation, as memory: a full packed copy.

    Args:
        w13: uint8 [E, 2I or I, H/2], [w1; w3] = [gate; up] (checkpoint
            order, the kernel's).
        w13_scale_swizzled, w2_scale_swizzled: float8_e4m3fn, 128x4-swizzled
            ([E, rows padded to 128, K/16 padded to 4]).
        w13_global, w2_global: float32 [E], ModelOpt direction (scale_2).
        gated: silu (w13 holds gate and up) or relu2.

    Returns NEW tensors (the inputs are untouched), FlashInfer's W4A16 layout:
    ``w13`` int32 [E, H/16, (rows/64)*128], ``w13_scale`` [E, H/16, rows],
    ``w13_global_scale`` float32 [E], and the same for w2. Allocations in
    FlashInfer's order: both block scales unswizzled into new linear tensors,
    the packed weights allocated whole and filled per expert, the packed
    scales likewise; the linear copies are dropped at the end, the result
    (as large as the source) stays.
    """
    e, h, i = _check_inputs(w13, w2)
    rows = w13.shape[1]
    if rows != (2 * i if gated else i):
        raise ValueError(f"w13: {rows} rows for I = {i}, gated={gated}")
    rotate = 0  # [gate; up] is the kernel's order
    s13 = unswizzle_blockscale(w13_scale_swizzled, rows, h // 16)
    s2 = unswizzle_blockscale(w2_scale_swizzled, h, i // 16)
    out = {}
    for name, w, rot in (("w13", w13, rotate), ("w2", w2, 0)):
        n, k = w.shape[1], 2 * w.shape[2]
        packed = torch.empty(
            (e, k // 16, (n // 64) * 128), dtype=torch.int32, device=w.device
        )
        for ex in range(e):
            packed[ex] = w4a16_pack_weight(w[ex : ex + 1], rot)[0]
        out[name] = packed
    for name, s, g, rot in (("w13", s13, w13_global, rotate), ("w2", s2, w2_global, 0)):
        x = w4a16_scale_exponent(s)
        packed = torch.empty(
            (e, s.shape[2], s.shape[1]), dtype=torch.float8_e4m3fn, device=s.device
        )
        for ex in range(e):
            packed[ex] = w4a16_pack_blockscale(s[ex : ex + 1], x, rot)[0]
        out[f"{name}_scale"] = packed
        out[f"{name}_global_scale"] = w4a16_global_scale(g, x)
    del s13, s2
    return out


def _flashinfer_prepare_fn() -> tuple[Callable | None, str | None]:
    try:
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import (
            moe_w4a16_prepare as prep,
        )
    except Exception as e:  # ImportError, or a CUDA-only import failing
        return None, f"flashinfer is not importable ({type(e).__name__}: {e})"
    fn = getattr(prep, "prepare_w4a16_modelopt_nvfp4_weights", None)
    if fn is None or "reuse_input_storage" not in inspect.signature(fn).parameters:
        return None, (
            "this flashinfer has no prepare_w4a16_modelopt_nvfp4_weights("
            "..., reuse_input_storage=) (FlashInfer >= 0.7.4)"
        )
    return fn, None


def flashinfer_w4a16_unavailable_reason() -> str | None:
    """None when FlashInfer's W4A16 prepare function can run here, else why."""
    return _flashinfer_prepare_fn()[1]


@contextlib.contextmanager
def _device_properties_stand_in(device: torch.device) -> Iterator[None]:
    if device.type != "cpu":
        yield
        return
    props = SimpleNamespace(multi_processor_count=CPU_STAND_IN_SM_COUNT)
    with mock.patch.object(
        torch.cuda, "get_device_properties", lambda *args, **kwargs: props
    ):
        yield


def flashinfer_w4a16_prepare(
    w13: torch.Tensor,
    w13_scale_swizzled: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_swizzled: torch.Tensor,
    w2_global: torch.Tensor,
    *,
    gated: bool,
    reuse_input_storage: bool = False,
    w13_layout: str = "gate_up",
) -> dict[str, torch.Tensor]:
    """FlashInfer's ``prepare_w4a16_modelopt_nvfp4_weights`` on the same
    arguments as :func:`public_copy_reference` (BF16 activations); its
    result's :data:`PACKED_FIELDS`. ``w13_layout``: FlashInfer's name for
    the order of w13's halves ("gate_up": [w1; w3], the default; "up_gate":
    [w3; w1], which FlashInfer rotates by I). With
    ``reuse_input_storage`` FlashInfer repacks ``w13`` / ``w2`` in their own
    storage (they are modified). RuntimeError with the reason where FlashInfer
    cannot run."""
    fn, why = _flashinfer_prepare_fn()
    if fn is None:
        raise RuntimeError(why)
    _check_inputs(w13, w2)
    with _device_properties_stand_in(w13.device):
        packed = fn(
            w13,
            w13_scale_swizzled,
            w13_global,
            w2,
            w2_scale_swizzled,
            w2_global,
            activation="silu" if gated else "relu2",
            params_dtype=torch.bfloat16,
            w13_layout=w13_layout,
            reuse_input_storage=reuse_input_storage,
        )
    return {name: getattr(packed, name) for name in PACKED_FIELDS}


def _swizzle_at(src: torch.Tensor, offset: int):
    """A fresh copy of ``src`` [E, R, C] at byte ``offset`` of a storage with
    room for its swizzled result, and the in-place swizzle of it."""
    e, r, c = src.shape
    rp, cp = swizzled_blockscale_shape(r, c)
    storage = torch.zeros(offset + e * rp * cp, dtype=torch.uint8)
    scale = storage[offset : offset + e * r * c].view(e, r, c)
    scale.copy_(src.view(torch.uint8))
    scale = scale.view(torch.float8_e4m3fn)
    return lambda: swizzle_blockscale_bounded(scale, storage_has_room=True)


def measure_alternatives(
    tensors: dict, repeats: int, threads: int = PREP_CPU_THREADS
) -> dict[str, float]:
    """Median seconds of each step's chosen method and the one it replaced,
    on the layer's w13 + w2 scales, on ``threads`` intra-op threads; results
    compared first."""
    scales = [tensors["w13_weight_scale"], tensors["w2_weight_scale"]]
    factors = [tensors["w13_weight_scale_2"], tensors["w2_weight_scale_2"]]

    def run(make) -> tuple[float, list[torch.Tensor]]:
        times, out = [], None
        for _ in range(repeats):
            calls = make()  # fresh inputs, not timed
            with preparing_weights("cpu", threads):
                start = time.perf_counter()
                out = [call() for call in calls]
                times.append(time.perf_counter() - start)
        return statistics.median(times), [o.view(torch.uint8).clone() for o in out]

    words_t, words = run(lambda: [_swizzle_at(s, 0) for s in scales])
    bytes_t, by_bytes = run(lambda: [_swizzle_at(s, 1) for s in scales])

    def folds(fn):
        def make():
            pairs = zip([s.clone() for s in scales], factors, strict=True)
            return [lambda s=s, f=f: fn(s, f) for s, f in pairs]

        return make

    table_t, table = run(folds(fold_global_scale_into_blockscale_))
    float_t, by_float = run(folds(float_chunk_fold_))
    for name, a, b in (("swizzle", words, by_bytes), ("fold", table, by_float)):
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            raise RuntimeError(f"the two {name} methods give different bytes")
    return {
        "swizzle_words_s": words_t,
        "swizzle_bytes_s": bytes_t,
        "fold_table_s": table_t,
        "fold_float_s": float_t,
    }
