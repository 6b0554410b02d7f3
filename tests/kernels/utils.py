# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers shared by the kernel tests: devices, random bit patterns, byte views,
and the torch reference MoE."""

import pytest
import torch

__all__ = [
    "DEVICES",
    "bytes_of",
    "random_bits",
    "torch_experts",
    "torch_moe",
    "torch_topk",
]

#: CPU always; CUDA as a parameter that is skipped, with a reason, without a GPU.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device"
        ),
    ),
]


def random_bits(shape, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` filled with random bytes.

    Any bit pattern is allowed (NaN payloads included): the tests that use it
    compare bytes, never values.
    """
    shape = tuple(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw_shape = (*shape[:-1], shape[-1] * itemsize) if shape else (itemsize,)
    raw = torch.randint(0, 256, raw_shape, dtype=torch.uint8, generator=gen)
    out = raw.view(dtype)
    return out.reshape(shape).to(device)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of contiguous ``t`` as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def torch_topk(
    logits: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing of [T, E] logits: (weights float32 [T, K], ids int32
    [T, K]), in descending weight order; renormalized to sum to 1 if asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _activation(name: str, h: torch.Tensor) -> torch.Tensor:
    """An MoE activation on FC1's fp32 output: [.., 2I] ([gate | up]) for the
    gated ones, [.., I] for relu2."""
    if name in ("relu2", "relu2_no_mul"):
        return torch.square(torch.relu(h))
    gate, up = h.chunk(2, dim=-1)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if name != "silu":
        raise ValueError(f"unknown activation {name!r}")
    return torch.nn.functional.silu(gate) * up


def _fake_quant_nvfp4(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 quantize-dequantize of ``x`` at the dequantization-direction
    global ``scale`` (float32 result)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
        dequantize_nvfp4,
        quantize_nvfp4,
    )

    g = 1.0 / scale.float()
    packed, block_scale = quantize_nvfp4(x, g)
    return dequantize_nvfp4(packed, block_scale, g)


def torch_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference MoE experts: BF16 operands, fp32 accumulation, BF16 result.

    ``x`` [T, H]; ``w1`` [E, 2I, H] in [gate; up] order (gated) or [E, I, H];
    ``w2`` [E, H, I]; routes [T, K]. Per expert: ``x @ w1[e].T`` in fp32, the
    activation in fp32, rounded to ``x.dtype`` (real kernels store the
    intermediate in BF16), ``@ w2[e].T`` in fp32, the weighted top-k sum in
    fp32, cast to ``x.dtype``. ``activation`` by value ("silu",
    "gelu_tanh", "relu2"; an ``MoEActivation`` too). ValueError on shapes
    that do not fit together.

    ``a1_scale`` / ``a2_scale`` [E] (DEQUANTIZATION direction, ModelOpt's
    ``input_scale``): the producer's W4A4 function, each GEMM's input
    NVFP4-quantized at its static per-expert scale in front of it (block
    scale ``e4m3(amax / (6 * scale))``, codes ``e2m1(x / (block_scale *
    scale))``, what ModelOpt and compressed-tensors compute: the tree's
    ``quantize_nvfp4``), the rest as above."""
    name = getattr(activation, "value", activation)
    gated = name not in ("relu2", "relu2_no_mul")
    t, h = x.shape
    inter = w2.shape[2]
    if (
        w1.shape[0] != w2.shape[0]
        or w1.shape[2] != h
        or w2.shape[1] != h
        or w1.shape[1] != (2 * inter if gated else inter)
    ):
        raise ValueError(
            f"inconsistent shapes for {name}: x {tuple(x.shape)}, w1 "
            f"{tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        )
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    k = topk_ids.shape[1]
    tokens = torch.arange(t, device=x.device).repeat_interleave(k)
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    for e in ids.unique().tolist():
        sel = ids == e
        tok = tokens[sel]
        xe = x[tok]
        if a1_scale is not None:
            xe = _fake_quant_nvfp4(xe, a1_scale[e])
        mid = _activation(name, xe.float() @ w1[e].float().t())
        mid = mid.to(x.dtype)
        if a2_scale is not None:
            mid = _fake_quant_nvfp4(mid, a2_scale[e])
        mid = mid.float()
        out.index_add_(0, tok, (mid @ w2[e].float().t()) * weights[sel].unsqueeze(1))
    return out.to(x.dtype)


def torch_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    logits: torch.Tensor,
    topk: int,
    renormalize: bool,
    activation: str = "silu",
    a1_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Route with :func:`torch_topk`, then run :func:`torch_experts`."""
    weights, ids = torch_topk(logits, topk, renormalize)
    return torch_experts(x, w1, w2, weights, ids, activation, a1_scale, a2_scale)
