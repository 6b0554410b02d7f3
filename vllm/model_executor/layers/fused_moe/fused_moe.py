# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Routing (``fused_topk``) and a torch reference MoE in BF16, fp32 accumulation.

Axes: T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation

__all__ = ["expand_routes", "fused_experts", "fused_moe", "fused_topk"]


def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: the ``topk`` experts of each token and their weights.

    Args:
        hidden_states: [T, H] (only its token count is used).
        gating_output: [T, E] router logits, any float dtype.
        topk: experts per token, 1 <= topk <= E.
        renormalize: rescale each token's top-k weights to sum to 1.

    Returns:
        ``(topk_weights, topk_ids)``: float32 [T, K] and int32 [T, K], in
        descending weight order.
    """
    if gating_output.dim() != 2 or gating_output.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"gating_output must be [T, E] with T = {hidden_states.shape[0]}, got "
            f"{tuple(gating_output.shape)}"
        )
    if not 1 <= topk <= gating_output.shape[1]:
        raise ValueError(
            f"topk must be in [1, {gating_output.shape[1]}] (number of experts), "
            f"got {topk}"
        )
    probs = torch.softmax(gating_output.float(), dim=-1)  # [T, E]
    topk_weights, topk_ids = torch.topk(probs, topk, dim=-1)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def expand_routes(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten [T, K] routes into (expert id, token, weight), each [T*K]:
    int64, int64, float32. Bookkeeping only: which token goes where."""
    t, k = topk_ids.shape
    tokens = torch.arange(t, device=topk_ids.device).repeat_interleave(k)
    return topk_ids.reshape(-1).long(), tokens, topk_weights.reshape(-1).float()


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: MoEActivation | str = MoEActivation.SILU,
) -> torch.Tensor:
    """Reference MoE experts: BF16 operands, fp32 accumulation, BF16 result.

    Args:
        hidden_states: [T, H].
        w1: [E, 2I, H] in vLLM's [gate; up] order (gated) or [E, I, H].
        w2: [E, H, I].
        topk_weights: [T, K] float; topk_ids: [T, K] integer expert ids.
        activation: :class:`MoEActivation`.

    Per expert: ``h = x @ w1[e].T`` (fp32), activation in fp32, rounded to
    the input dtype (the intermediate is stored in BF16 by real kernels),
    ``y = a @ w2[e].T`` (fp32), weighted sum over the top-k in fp32, then cast
    to ``hidden_states.dtype``. Returns a new [T, H] tensor.
    """
    act = MoEActivation.from_str(activation)
    t, h = hidden_states.shape
    if w1.shape[0] != w2.shape[0] or w1.shape[2] != h or w2.shape[1] != h:
        raise ValueError(
            f"inconsistent shapes: hidden_states {tuple(hidden_states.shape)}, "
            f"w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        )
    if act.fc1_rows(w2.shape[2]) != w1.shape[1]:
        raise ValueError(
            f"w1 has {w1.shape[1]} rows; {act.value} with I={w2.shape[2]} needs "
            f"{act.fc1_rows(w2.shape[2])}"
        )
    out = torch.zeros((t, h), dtype=torch.float32, device=hidden_states.device)
    flat_ids, flat_tokens, flat_weights = expand_routes(topk_ids, topk_weights)
    for e in flat_ids.unique().tolist():
        sel = flat_ids == e
        tokens = flat_tokens[sel]  # [n]
        x = hidden_states[tokens].float()  # [n, H]
        inter = act.apply(x @ w1[e].float().t())  # [n, I]
        inter = inter.to(hidden_states.dtype).float()
        y = inter @ w2[e].float().t()  # [n, H]
        out.index_add_(0, tokens, y * flat_weights[sel].unsqueeze(1))
    return out.to(hidden_states.dtype)


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    activation: MoEActivation | str = MoEActivation.SILU,
) -> torch.Tensor:
    """Route with :func:`fused_topk`, then run :func:`fused_experts`."""
    topk_weights, topk_ids = fused_topk(hidden_states, gating_output, topk, renormalize)
    return fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation)
