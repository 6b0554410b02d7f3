# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU-runnable emulation of the FlashInfer b12x NVFP4 MoE contract.

The weight preparation is inherited, line for line, from
:class:`FlashInferB12xExperts`; only ``apply`` differs: it computes in torch
from the prepared tensors exactly as the kernel reads them, decoding the
layout itself:

* FC1 weight rows are [w3; w1] = [up; gate] (it never calls the reorder to
  undo that);
* block scales are read through the MMA-layout views (the swizzled bytes);
* ``e2m1 * block_scale`` per weight, times the per-expert ``g1_alphas`` /
  ``g2_alphas`` on the GEMM outputs;
* the FC2 input is quantized with ``_fc2_input_scale`` (full mode).

Modes:

* ``weights_only=False`` (W4A4, the kernel's arithmetic): the FC1 input and
  the FC2 input are quantized to NVFP4 (16-element blocks along the
  reduction dimension, FP8 block scales, global scale ``a1_gscale`` or 1 and
  ``_fc2_input_scale``). Not modelled: the kernel's accumulation order and
  tiling, its rounding of the block-scale computation (a 1-ulp FP8 scale
  difference is possible), and its BF16 output rounding points beyond the
  final cast.
* ``weights_only=True`` (W4A16): activations stay BF16 (no activation
  quantization); every GEMM multiplies BF16 activations by the decoded
  weights in fp32 and the intermediate is rounded to BF16, as
  :func:`fused_experts` does, so the result can be compared tightly with the
  BF16 reference on the dequantized weights.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
)
from vllm.model_executor.layers.fused_moe.fused_moe import expand_routes
from vllm.model_executor.layers.fused_moe.modular_kernel import Support
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    dequantize_nvfp4,
    mma_layout_to_linear,
    quantize_nvfp4,
)

__all__ = ["FlashInferB12xEmulatedExperts"]


def _fake_quant(x: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 quantize-dequantize of activations [n, K] (float32 out)."""
    packed, scale = quantize_nvfp4(x, global_scale)
    return dequantize_nvfp4(packed, scale, global_scale)


class FlashInferB12xEmulatedExperts(FlashInferB12xExperts):
    """The b12x contract in torch: same preparation, emulated ``apply``."""

    name = "flashinfer_b12x_emulated"

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
        global_scale_mode: str = "alpha",
        weights_only: bool = False,
    ):
        super().__init__(moe_config, quant_config,
                         max_transient_bytes=max_transient_bytes,
                         global_scale_mode=global_scale_mode)  # fmt: skip
        self.weights_only = weights_only

    @classmethod
    def is_supported_device(cls, device: torch.device) -> Support:
        return Support.yes()

    @classmethod
    def check_kernel_config(cls, moe: FusedMoEConfig) -> None:
        # The torch emulation runs any shape and dtype the preparation takes
        # (tests use small and awkward ones); only the kernel has limits.
        return None

    @classmethod
    def supports_unfolded_alpha(cls) -> Support:
        # The emulation reads w1_alpha as an output multiplier only, as the
        # kernel does when it is given input_global_scale.
        return Support.yes()

    @classmethod
    def supports_expert_parallel(cls) -> bool:
        # The torch loop skips the -1 ids of other ranks' experts; the kernel
        # itself does not support expert parallelism with NVFP4 activations.
        return True

    def _decoded_weight(
        self, packed: torch.Tensor, mma: torch.Tensor, expert: int, m: int, k: int
    ) -> torch.Tensor:
        """Expert ``expert``'s weight [m, k] in float32, as the kernel reads it:
        codes from ``packed`` [E, m, k/2], scales from the MMA view."""
        scales = mma_layout_to_linear(mma[..., expert : expert + 1], m, k)[0]
        return dequantize_nvfp4(packed[expert], scales, 1.0)

    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids):
        self._check_prepared()
        qc = self.quant_config
        moe = self.moe_config
        t, h = hidden_states.shape
        inter = moe.intermediate_size_per_partition
        rows = moe.w13_rows
        out = torch.zeros((t, h), dtype=torch.float32, device=hidden_states.device)
        flat_ids, flat_tokens, flat_weights = expand_routes(topk_ids, topk_weights)
        a1_gscale = 1.0 if qc.a1_gscale is None else qc.a1_gscale
        for e in flat_ids.unique().tolist():
            if e < 0:
                continue  # unrouted slot
            sel = flat_ids == e
            tokens = flat_tokens[sel]
            x = hidden_states[tokens].float()  # [n, H]
            if not self.weights_only:
                gs = a1_gscale if isinstance(a1_gscale, float) else a1_gscale[e]
                x = _fake_quant(x, gs)
            w13 = self._decoded_weight(w1, self.w1_sf_mma, e, rows, h)  # [rows, H]
            fc1 = (x @ w13.t()) * qc.g1_alphas[e]  # [n, rows]
            if moe.activation.is_gated:
                # b12x layout: rows [0, I) are w3 (up), rows [I, 2I) are w1 (gate).
                up, gate = fc1[:, :inter], fc1[:, inter:]
                act = torch.nn.functional.silu(gate) * up  # [n, I]
            else:
                act = torch.square(torch.relu(fc1))  # [n, I]
            if self.weights_only:
                act = act.to(hidden_states.dtype).float()
            else:
                act = _fake_quant(act, self._fc2_input_scale[e])
            w2e = self._decoded_weight(w2, self.w2_sf_mma, e, h, inter)  # [H, I]
            y = (act @ w2e.t()) * qc.g2_alphas[e]  # [n, H]
            out.index_add_(0, tokens, y * flat_weights[sel].unsqueeze(1))
        return out.to(hidden_states.dtype)
