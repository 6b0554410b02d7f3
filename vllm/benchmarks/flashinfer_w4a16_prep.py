# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Baselines only: FlashInfer's W4A16 (b12x, weight-only NVFP4) preparation.

FlashInfer 0.7.4 prepares W4A16 experts with ``prepare_w4a16_modelopt_nvfp4_
weights`` / ``prepare_w4a16_compressed_tensors_weights``. Its public path
(``b12x_fused_moe`` -> ``reuse_input_storage=False``) builds a full packed copy
of the layer and keeps it, cached while the source tensors live: per layer
the packed weights and scales are as large as the source, beside it.

Two baselines, both taking the layer's tensors in the layout FlashInfer's
API takes (128x4-swizzled block scales, one float32 global scale per expert
and weight), w13 in checkpoint order [w1; w3] = [gate; up], which is the
kernel's own (FlashInfer's ``w13_layout="gate_up"``, no row rotation):

* :func:`public_copy_reference`: that public path's memory behaviour, made
  with this package's whole-tensor reference
  (:mod:`~vllm.model_executor.layers.quantization.utils.nvfp4_utils`): the
  block scales unswizzled into new tensors, new packed tensors of the full
  size filled one expert at a time, the result kept. Always available.
* :func:`flashinfer_w4a16_prepare`: FlashInfer's own function (public, or its
  private ``reuse_input_storage=True`` mode), where flashinfer is importable.
  On CPU its one CUDA query (the SM count, for a workspace of SMs * 4 + 2
  int32) is answered by a stand-in.

Nothing on the production path imports this module.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from unittest import mock

import torch

from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    unswizzle_blockscale,
    w4a16_global_scale,
    w4a16_pack_blockscale,
    w4a16_pack_weight,
    w4a16_scale_exponent,
)

__all__ = [
    "CPU_STAND_IN_SM_COUNT",
    "PACKED_FIELDS",
    "flashinfer_w4a16_prepare",
    "flashinfer_w4a16_unavailable_reason",
    "public_copy_reference",
]

#: The six tensors of FlashInfer's ``W4A16PackedWeights`` compared here.
PACKED_FIELDS = (
    "w13", "w13_scale", "w13_global_scale", "w2", "w2_scale", "w2_global_scale",
)  # fmt: skip
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
        packed = torch.empty((e, k // 16, (n // 64) * 128), dtype=torch.int32,
                             device=w.device)  # fmt: skip
        for ex in range(e):
            packed[ex] = w4a16_pack_weight(w[ex : ex + 1], rot)[0]
        out[name] = packed
    for name, s, g, rot in (("w13", s13, w13_global, rotate), ("w2", s2, w2_global, 0)):
        x = w4a16_scale_exponent(s)
        packed = torch.empty((e, s.shape[2], s.shape[1]), dtype=torch.float8_e4m3fn,
                             device=s.device)  # fmt: skip
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
    with mock.patch.object(torch.cuda, "get_device_properties",
                           lambda *args, **kwargs: props):  # fmt: skip
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
            w13, w13_scale_swizzled, w13_global, w2, w2_scale_swizzled, w2_global,
            activation="silu" if gated else "relu2", params_dtype=torch.bfloat16,
            w13_layout=w13_layout, reuse_input_storage=reuse_input_storage,
        )  # fmt: skip
    return {name: getattr(packed, name) for name in PACKED_FIELDS}
