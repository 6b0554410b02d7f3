# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU-runnable emulation of FlashInfer's b12x W4A16 MoE on the packed layout.

The preparation is :class:`FlashInferB12xW4A16Experts`'s, line for line;
``apply`` computes in torch from ``packed_weights`` alone, decoding the
layout with the package's own reference (``nvfp4_utils.w4a16_dequantize``,
independent of FlashInfer), with the kernel's arithmetic:

* BF16 activations, never quantized; weights e2m1 * block scale value, the
  block scale as the kernel reads it (v * 2^x * 2^7 FP16, flushed to 0 when
  v * 2^x < 2^-6);
* FC1: FP32 accumulation, times ``alpha1`` (``w13_global_scale * 2^-126``),
  rounded to BF16, then the activation on the [gate; up] rows (gate first:
  the kernel's native order), rounded to BF16;
* FC2: FP32 accumulation times ``router_weight * alpha2``; the top-k sum in
  FP32, one final BF16 rounding.

Not modelled: the kernel's accumulation order and tiling.
Expert ids are global; with expert parallelism (``expert_map``) experts of
other ranks contribute nothing, as in the kernel.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
    FlashInferB12xW4A16Experts,
)
from vllm.model_executor.layers.fused_moe.fused_moe import expand_routes
from vllm.model_executor.layers.fused_moe.modular_kernel import Support
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    w4a16_alpha,
    w4a16_dequantize,
)

__all__ = ["FlashInferB12xW4A16EmulatedExperts"]


class FlashInferB12xW4A16EmulatedExperts(FlashInferB12xW4A16Experts):
    """The b12x W4A16 contract in torch: same preparation, emulated ``apply``."""

    name = "flashinfer_b12x_emulated"

    @classmethod
    def is_supported_device(cls, device: torch.device) -> Support:
        return Support.yes()

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids):
        pw = self._check_prepared()
        moe = self.moe_config
        t, h = hidden_states.shape
        inter = moe.intermediate_size_per_partition
        out = torch.zeros((t, h), dtype=torch.float32, device=hidden_states.device)
        ids, tokens, weights = expand_routes(topk_ids, topk_weights)
        if self.expert_map is not None:
            owned = self.expert_map.long()[ids.clamp(min=0)]
            ids = torch.where(ids >= 0, owned, ids)
        alpha1 = w4a16_alpha(pw.w13_global_scale)  # [E]
        alpha2 = w4a16_alpha(pw.w2_global_scale)
        for e in ids.unique().tolist():
            if e < 0:
                continue  # unrouted, or another rank's expert
            sel = ids == e
            tok = tokens[sel]
            x = hidden_states[tok].to(torch.bfloat16).float()  # [n, H]
            w13 = w4a16_dequantize(pw.w13[e : e + 1], pw.w13_scale[e : e + 1])[0]
            fc1 = ((x @ w13.t()) * alpha1[e]).to(torch.bfloat16).float()  # [n, N]
            if moe.activation.is_gated:
                gate, up = fc1[:, :inter], fc1[:, inter:]
                act = torch.nn.functional.silu(gate) * up  # [n, I]
            else:
                act = torch.square(torch.relu(fc1))
            act = act.to(torch.bfloat16).float()
            w2e = w4a16_dequantize(pw.w2[e : e + 1], pw.w2_scale[e : e + 1])[0]
            y = (act @ w2e.t()) * (weights[sel] * alpha2[e]).unsqueeze(1)  # [n, H]
            out.index_add_(0, tok, y)
        return out.to(torch.bfloat16)
