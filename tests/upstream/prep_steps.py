# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Each step of the W4A4 b12x weight preparation alone, as the imported vLLM
runs it: the peak transient CPU memory and a digest of the bytes it leaves.

Against the installed fork: the branch's ``reorder_w1w3_to_w3w1``,
``swizzle_blockscale_bounded`` and ``fold_global_scale_into_blockscale_``.
Against unmodified 0.33.0 (``upstream_env.run_unmodified_json``): its
``reorder_w1w3_to_w3w1`` and ``swizzle_blockscale`` (``.cuda()`` the CPU
stand-in), and its fold, which 0.33.0 has no function for: the expression
of its ``FlashInferB12xExperts.process_weights_after_loading`` (a float32
product assigned to the parameter's ``data``). Metered with the slice's
``measure_peak_memory`` (torch's CPU allocation accounting, loaded by
path). Synthetic tensors: random codes, positive normal E4M3 block scales,
global scales 1e-4..2.1e-3, the same bytes in both processes.
"""

from __future__ import annotations

import gc
import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch

from cpu_stand_ins import tensor_cuda_returns_self
from upstream_env import load_slice_module
from upstream_layers import MoEShape

__all__ = ["prep_step_reports"]

_MEM_UTILS = "vllm/utils/mem_utils.py"
#: Positive normal E4M3 codes (0x08..0x7D): no zero, subnormal or NaN.
_FP8_CODES = (0x08, 0x7E)


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(*_FP8_CODES, shape, dtype=torch.uint8, generator=gen)
    return codes.view(torch.float8_e4m3fn)


def _metered(fn: Callable[[], Any]) -> tuple[int, float]:
    """(peak transient bytes, seconds) of ``fn()``."""
    mem_utils = load_slice_module(_MEM_UTILS)
    gc.collect()
    with mem_utils.measure_peak_memory("cpu") as mem:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return mem.peak_bytes, seconds


def _report(peak: int, seconds: float, *tensors: torch.Tensor) -> dict[str, Any]:
    return {"peak_bytes": peak, "seconds": seconds, "digest": _digest(*tensors)}


def _fold_as_0_33_0(scale: torch.nn.Parameter, scale_2: torch.Tensor) -> None:
    scale.data = (scale.float() * scale_2.view(-1, 1, 1)).to(scale.dtype)


def _reorder_report(e: int, h: int, i: int, gen: torch.Generator) -> dict[str, Any]:
    from vllm.model_executor.layers.quantization.utils import flashinfer_fp4_moe

    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=gen)
    w13_scale = _fp8((e, 2 * i, h // 16), gen)
    peak, seconds = _metered(
        lambda: flashinfer_fp4_moe.reorder_w1w3_to_w3w1(w13, w13_scale)
    )
    return _report(peak, seconds, w13, w13_scale)


def _swizzle_report(scale: torch.Tensor, swizzle: Callable) -> dict[str, Any]:
    out: list[torch.Tensor] = []
    with tensor_cuda_returns_self():
        peak, seconds = _metered(lambda: out.append(swizzle(scale)))
    return _report(peak, seconds, out[0])


def _fold_report(
    e: int, h: int, i: int, gen: torch.Generator, fold: Callable
) -> dict[str, Any]:
    scale = torch.nn.Parameter(_fp8((e, 2 * i, h // 16), gen), requires_grad=False)
    scale_2 = torch.rand(e, generator=gen) * 2e-3 + 1e-4
    peak, seconds = _metered(lambda: fold(scale, scale_2))
    return _report(peak, seconds, scale)


def prep_step_reports(shape: MoEShape, seed: int = 0) -> dict[str, dict[str, Any]]:
    """``{step: {"peak_bytes", "seconds", "digest"}}`` for the reorder of w13
    (weight and block scale, [E, 2I, H/2] and [E, 2I, H/16]), the swizzle of
    the w13 and w2 block scales, and the fold of a per-expert global scale
    into the w13 block scales, each on fresh tensors of ``shape`` (freed
    before the next step is metered)."""
    try:  # the fork
        from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
            fold_global_scale_into_blockscale_ as fold,
        )
        from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
            swizzle_blockscale_bounded as swizzle,
        )
    except ImportError:  # unmodified 0.33.0
        from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
            swizzle_blockscale as swizzle,
        )

        fold = _fold_as_0_33_0
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator().manual_seed(seed)
    return {
        "reorder w13": _reorder_report(e, h, i, gen),
        "swizzle w13 block scales": _swizzle_report(
            _fp8((e, 2 * i, h // 16), gen), swizzle
        ),
        "swizzle w2 block scales": _swizzle_report(_fp8((e, h, i // 16), gen), swizzle),
        "fold w13 block scales": _fold_report(e, h, i, gen, fold),
    }
