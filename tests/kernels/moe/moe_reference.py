# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The torch reference MoE the MoE tests compare against (routing, the
experts, both together) and the error measure they use.

Pure torch, importing nothing from vllm or the other test helpers: the
FlashInfer b12x test takes it into upstream's test tree as a new file (its
``tests/kernels/utils.py`` has a ``torch_moe`` of its own, with another
signature), and tests/upstream loads it by path beside an installed vLLM."""

from collections.abc import Callable

import torch

__all__ = [
    "rel_rms_error",
    "torch_experts",
    "torch_moe",
    "torch_topk",
]


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


def torch_experts(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    quant_inputs: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Reference MoE experts: BF16 operands, fp32 accumulation, BF16 result.

    ``x`` [T, H]; ``w1`` [E, 2I, H] in [gate; up] order (gated) or [E, I, H];
    ``w2`` [E, H, I]; routes [T, K]. Per expert: ``x @ w1[e].T`` in fp32, the
    activation in fp32, rounded to ``x.dtype`` (real kernels store the
    intermediate in BF16), ``@ w2[e].T`` in fp32, the weighted top-k sum in
    fp32, cast to ``x.dtype``. ``activation`` by value ("silu",
    "gelu_tanh", "relu2"; an ``MoEActivation`` too). ValueError on shapes
    that do not fit together.

    ``quant_inputs(a, expert, gemm)``: what each GEMM (1 or 2) of
    ``expert`` multiplies instead of its BF16 input ``a`` (a producer's
    activation quantization, e.g. NVFP4 at static per-expert scales: its
    W4A4 function); the rest as above."""
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
        if quant_inputs is not None:
            xe = quant_inputs(xe, e, 1)
        mid = _activation(name, xe.float() @ w1[e].float().t())
        mid = mid.to(x.dtype)
        if quant_inputs is not None:
            mid = quant_inputs(mid, e, 2)
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
    quant_inputs: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Route with :func:`torch_topk`, then run :func:`torch_experts`."""
    weights, ids = torch_topk(logits, topk, renormalize)
    return torch_experts(x, w1, w2, weights, ids, activation, quant_inputs)


def rel_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in float32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()
