# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU-runnable emulation of the FlashInfer b12x NVFP4 MoE contract.

The weight preparation is :class:`FlashInferB12xExperts`'s, line for line;
only ``apply`` differs: it computes in torch from the prepared tensors
exactly as the kernel reads them, decoding the layout itself.

W4A4 (``quant_config.quant_dtype == "nvfp4"``):

* FC1 weight rows are [w3; w1] = [up; gate] (it never calls the reorder to
  undo that); block scales are read through the MMA-layout views;
* ``e2m1 * block_scale`` per weight, times the per-expert alphas on the
  GEMM outputs;
* ``bf16_activations=False`` (the kernel's arithmetic): each expert's FC1 input
  (BF16) is quantized to NVFP4 as the kernel does it
  (``flashinfer_b12x_w4a4_format.quantize_nvfp4_b12x_activation``, fast math) with
  ``fc1_input_scale[e]`` (``w1_alpha[e]`` when there is none), the GEMM runs
  on ``codes * block_scale`` of both operands in float32 and its output is
  multiplied by ``w1_alpha[e] * fc1_input_scale[e]`` (``w1_alpha[e]``
  alone without one); the activation's output is rounded to BF16 and
  quantized the same way with ``fc2_input_scale[e]``; FC2's output is
  multiplied by ``w2_alpha[e]``. Not modelled: the kernel's accumulation
  order and tiling, its reciprocal approximations (within one ulp: a value
  on an E4M3 or E2M1 rounding boundary may round the other way), its fast
  activation functions and its BF16 rounding of each route's output.
* ``bf16_activations=True``: activations stay BF16; every GEMM multiplies BF16
  activations by the decoded weights in fp32 (the FC2 output by
  ``w2_alpha / fc2_input_scale``, the weights' own factor) and the
  intermediate is rounded to BF16, so the result can be compared tightly
  with the BF16 reference on the dequantized weights.

W4A16 (``quant_config.use_nvfp4_w4a16``), from ``W4A16PackedWeights`` alone
with the package's own decode (``flashinfer_w4a16_layout.w4a16_dequantize``): BF16
activations; weights e2m1 * block scale as the kernel reads it; FC1 in FP32
times ``alpha1``, rounded to BF16, the activation on the [gate; up] rows,
rounded to BF16; FC2 in FP32 times ``router_weight * alpha2``; the top-k
sum in FP32, one final BF16 rounding.

Expert ids are global; ``expert_map`` (expert parallelism) maps them to
local experts, and experts of other ranks contribute nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
    b12x_layout_problems,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a4 import (
    B12xW4A4Tensors,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
    W4A16PackedWeights,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEActivationFormat,
    FusedMoEExperts,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_b12x_w4a4_format import (
    mma_layout_to_linear,
    quantize_nvfp4_b12x_activation,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    w4a16_alpha,
    w4a16_dequantize,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    dequantize_nvfp4,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    w13_rows,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey

__all__ = ["FlashInferB12xEmulatedExperts"]


def _mma_operand(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """What the kernel's MMA reads for activations ``x`` [n, K] quantized with
    ``input_scale`` (dequantization direction): ``codes * block_scale``,
    about ``x / input_scale`` (float32)."""
    packed, scale = quantize_nvfp4_b12x_activation(x.to(torch.bfloat16), input_scale)
    return dequantize_nvfp4(packed, scale, 1.0)


def _activation(act: MoEActivation, fc1: torch.Tensor, first_is_gate: bool):
    """The activation on FC1's output [n, 2I] (gated; halves in the layout's
    order) or [n, I]."""
    if not act.is_gated:
        return torch.square(F.relu(fc1))
    a, b = fc1.chunk(2, dim=-1)
    gate, up = (a, b) if first_is_gate else (b, a)
    if act is MoEActivation.GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def _local_routes(topk_ids, topk_weights, expert_map):
    """Flatten [T, K] routes into (local expert, token, weight), each [T*K];
    -1 for a slot whose expert is another rank's."""
    t, k = topk_ids.shape
    tokens = torch.arange(t, device=topk_ids.device).repeat_interleave(k)
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:
        ids = torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], ids)
    return ids, tokens, topk_weights.reshape(-1).float()


class FlashInferB12xEmulatedExperts(FlashInferB12xExperts):
    """The b12x contract in torch, on any device: the same preparation, an
    emulated ``apply`` (see module doc). The emulation runs any shape the
    preparation takes and keeps expert parallelism for W4A4 too."""

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        max_transient_bytes: int | None = None,
        global_scale_mode: str | None = None,
        bf16_activations: bool = False,
    ):
        super().__init__(
            moe_config,
            quant_config,
            max_transient_bytes=max_transient_bytes,
            global_scale_mode=global_scale_mode,
        )
        self.bf16_activations = bf16_activations

    @classmethod
    def check_kernel_config(cls, moe: FusedMoEConfig, weight_only: bool) -> None:
        # The torch emulation runs any shape and dtype the preparation takes
        # (tests use small and awkward ones); only the layout has limits.
        problems = b12x_layout_problems(moe, weight_only)
        if problems:
            raise ValueError(
                "the b12x weight layout cannot hold this MoE layer: "
                + "; ".join(problems)
            )

    @staticmethod
    def is_supported_config(
        cls: type[FusedMoEExperts],
        moe_config: FusedMoEConfig,
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
        activation_format: FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        return FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format
        )

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @classmethod
    def supports_unfolded_alpha(cls) -> bool:
        # The emulation reads w1_alpha as an output multiplier only, as the
        # kernel does when it is given input_global_scale.
        return True

    def supports_expert_map(self) -> bool:
        return True

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ) -> None:
        state = self._state_for_apply()
        with state.lock:
            if not state.ready or self.prepared is None:
                self._check_prepared()
            routes = _local_routes(topk_ids, topk_weights, expert_map)
            if self.weight_only:
                out = self._emulate_w4a16(hidden_states, routes)
            else:
                out = self._emulate_w4a4(hidden_states, w1, w2, routes)
            output.copy_(out)

    def _decoded_weight(
        self, packed: torch.Tensor, mma: torch.Tensor, expert: int, m: int, k: int
    ) -> torch.Tensor:
        """Expert ``expert``'s weight [m, k] in float32, as the kernel reads it:
        codes from ``packed`` [E, m, k/2], scales from the MMA view."""
        scales = mma_layout_to_linear(mma[..., expert : expert + 1], m, k)[0]
        return dequantize_nvfp4(packed[expert], scales, 1.0)

    def _emulate_w4a4(self, hidden_states, w1, w2, routes):
        t = self.prepared
        assert isinstance(t, B12xW4A4Tensors)  # apply checked it is bound
        moe = self.moe_config
        n_tok, h = hidden_states.shape
        inter, rows = moe.intermediate_size_per_partition, w13_rows(moe)
        out = torch.zeros((n_tok, h), dtype=torch.float32, device=hidden_states.device)
        ids, tokens, weights = routes
        for e in ids.unique().tolist():
            if e < 0:
                continue  # unrouted slot, or another rank's expert
            sel = ids == e
            tok = tokens[sel]
            x = hidden_states[tok]  # [n, H]
            w13 = self._decoded_weight(w1, t.w1_sf_mma, e, rows, h)  # [rows, H]
            if self.bf16_activations:
                fc1 = (x.float() @ w13.t()) * t.w1_alpha[e]  # [n, rows]
            elif t.fc1_input_scale is None:
                # Fold mode: w1_alpha is both the input's scale and the
                # output's multiplier.
                fc1 = (_mma_operand(x, t.w1_alpha[e]) @ w13.t()) * t.w1_alpha[e]
            else:
                d1 = t.fc1_input_scale[e]
                fc1 = (_mma_operand(x, d1) @ w13.t()) * (t.w1_alpha[e] * d1)
            # b12x layout: rows [0, I) are w3 (up), rows [I, 2I) w1 (gate).
            act = _activation(moe.activation, fc1, first_is_gate=False)  # [n, I]
            act = act.to(hidden_states.dtype)
            w2e = self._decoded_weight(w2, t.w2_sf_mma, e, h, inter)  # [H, I]
            if self.bf16_activations:
                alpha2 = t.w2_alpha[e] / t.fc2_input_scale[e]
                y = (act.float() @ w2e.t()) * alpha2  # [n, H]
            else:
                y = (_mma_operand(act, t.fc2_input_scale[e]) @ w2e.t()) * t.w2_alpha[e]
            out.index_add_(0, tok, y * weights[sel].unsqueeze(1))
        return out.to(hidden_states.dtype)

    def _emulate_w4a16(self, hidden_states, routes):
        pw = self.prepared
        assert isinstance(pw, W4A16PackedWeights)  # apply checked it is bound
        moe = self.moe_config
        n_tok, h = hidden_states.shape
        out = torch.zeros((n_tok, h), dtype=torch.float32, device=hidden_states.device)
        ids, tokens, weights = routes
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
            # The W4A16 layout's native order: [gate; up].
            act = _activation(moe.activation, fc1, first_is_gate=True)
            act = act.to(torch.bfloat16).float()
            w2e = w4a16_dequantize(pw.w2[e : e + 1], pw.w2_scale[e : e + 1])[0]
            y = (act @ w2e.t()) * (weights[sel] * alpha2[e]).unsqueeze(1)  # [n, H]
            out.index_add_(0, tok, y)
        return out.to(torch.bfloat16)
