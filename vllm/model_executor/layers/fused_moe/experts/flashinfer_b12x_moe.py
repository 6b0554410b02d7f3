# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The branch's definitions in vLLM's fused_moe/experts/flashinfer_b12x_moe.py."""

import dataclasses
from typing import Any

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kNvfp4Static,
)
from vllm.model_executor.utils import refill_derived
from vllm.utils.flashinfer import flashinfer_convert_sf_to_mma_layout


class FlashInferB12xExperts(mk.FusedMoEExpertsModular):
    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
    ):
        super().__init__(moe_config=moe_config, quant_config=quant_config)
        assert quant_config.quant_dtype == "nvfp4", (
            "FlashInferB12xExperts only supports nvfp4 quantization."
        )
        self.out_dtype = moe_config.in_dtype
        self.num_local_experts = moe_config.num_local_experts
        self.ep_rank = moe_config.moe_parallel_config.ep_rank
        # Per-expert input scales and FC2 alpha, bound in
        # process_weights_after_loading so that apply() allocates nothing.
        self._fc1_input_scale: torch.Tensor | None = None
        self._fc2_input_scale: torch.Tensor | None = None
        self._w2_alpha: torch.Tensor | None = None

        # Shape params for B12xMoEWrapper construction.
        self.global_num_experts = moe_config.num_experts
        self.topk = moe_config.experts_per_token
        self.hidden_dim = moe_config.hidden_dim
        self.intermediate_size_per_partition = (
            moe_config.intermediate_size_per_partition
        )
        self.max_num_tokens = moe_config.max_num_tokens
        self.local_expert_offset = self.ep_rank * self.num_local_experts

        activation = moe_config.activation
        if activation not in self._ACTIVATION_MAP:
            raise ValueError(
                f"FlashInferB12xExperts does not support "
                f"activation {activation!r}. "
                f"Supported: {list(self._ACTIVATION_MAP.keys())}"
            )
        self._activation_str = self._ACTIVATION_MAP[activation]

        # Lazily created on first apply() call.
        self._wrapper: Any | None = None
        self.w1_sf_mma: torch.Tensor | None = None
        self.w2_sf_mma: torch.Tensor | None = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The block scales stay as loaded: each expert's global weight scale is
        # its FP32 alpha, and the kernel quantizes each expert's input with the
        # calibrated scale (dequantization direction, 1 / gscale; 1 without
        # one). FC2 multiplies its output by w2_alpha alone.
        assert self.g2_alphas is not None
        ones = torch.ones_like(self.g2_alphas, dtype=torch.float32)
        a1 = ones if self.a1_gscale is None else ones / self.a1_gscale
        a2 = ones if self.a2_gscale is None else ones / self.a2_gscale
        self._fc1_input_scale = refill_derived(layer, "_experts_fc1_input_scale", a1)
        self._fc2_input_scale = refill_derived(layer, "_experts_fc2_input_scale", a2)
        self._w2_alpha = refill_derived(layer, "_experts_w2_alpha", self.g2_alphas * a2)

        # Precompute MMA-layout views of the weight scale factors once here
        # rather than recomputing on every forward pass.
        assert self.w1_scale is not None
        num_experts_w1, m1, k1_sf = self.w1_scale.shape
        k1 = k1_sf * 16
        self.w1_sf_mma = flashinfer_convert_sf_to_mma_layout(
            self.w1_scale.reshape(num_experts_w1 * m1, k1_sf),
            m=m1,
            k=k1,
            num_groups=num_experts_w1,
        )

        assert self.w2_scale is not None
        num_experts_w2, m2, k2_sf = self.w2_scale.shape
        k2 = k2_sf * 16
        self.w2_sf_mma = flashinfer_convert_sf_to_mma_layout(
            self.w2_scale.reshape(num_experts_w2 * m2, k2_sf),
            m=m2,
            k=k2,
            num_groups=num_experts_w2,
        )

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor | None,
        workspace2: torch.Tensor | None,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool | None,
    ):
        assert self.w1_scale is not None and self.w2_scale is not None, (
            "w1_scale and w2_scale must not be None for FlashInferB12xExperts"
        )
        assert self.g1_alphas is not None and self.g2_alphas is not None, (
            "g1_alphas and g2_alphas must not be None for FlashInferB12xExperts"
        )
        assert self._fc2_input_scale is not None, (
            "_fc2_input_scale must be set by process_weights_after_loading"
        )
        assert self.w1_sf_mma is not None and self.w2_sf_mma is not None, (
            "process_weights_after_loading must run before FlashInferB12xExperts.apply"
        )

        self._ensure_wrapper()
        wrapper = self._wrapper
        assert wrapper is not None

        wrapper_output = wrapper.run(
            x=hidden_states,
            w1_weight=w1,
            w1_weight_sf=self.w1_sf_mma,
            w1_alpha=self.g1_alphas,
            input_global_scale=self._fc1_input_scale,
            fc2_input_scale=self._fc2_input_scale,
            w2_weight=w2,
            w2_weight_sf=self.w2_sf_mma,
            w2_alpha=self._w2_alpha,
            token_selected_experts=topk_ids.to(torch.int32),
            token_final_scales=topk_weights,
        )
        output.copy_(wrapper_output)


class FlashInferB12xW4A16Experts(FlashInferB12xExperts):
    """W4A16 NVFP4 checkpoints (BF16 activations) on FlashInfer's SM12x W4A16
    kernel. Each expert's weights and block scales are rewritten in place, in
    FlashInfer's W4A16 layout (the same bytes)."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig):
        super().__init__(moe_config, quant_config)
        assert quant_config.use_nvfp4_w4a16
        self._layout: Any | None = None

    @staticmethod
    def _supports_quant_scheme(
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
    ) -> bool:
        return (weight_key, activation_key) == (kNvfp4Static, None)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_w4a16_prepare import (  # noqa: E501
            prepare_w4a16_modelopt_nvfp4_weights,
        )

        assert self.g1_alphas is not None and self.g2_alphas is not None
        w13, w13_scale = layer.w13_weight, layer.w13_weight_scale
        w2, w2_scale = layer.w2_weight, layer.w2_weight_scale
        g1, g2 = torch.empty_like(self.g1_alphas), torch.empty_like(self.g2_alphas)
        for e in range(self.num_local_experts):
            p = prepare_w4a16_modelopt_nvfp4_weights(
                *(w13[e : e + 1], w13_scale[e : e + 1], self.g1_alphas[e : e + 1]),
                *(w2[e : e + 1], w2_scale[e : e + 1], self.g2_alphas[e : e + 1]),
                activation=self._activation_str,
                w13_layout="w31",  # reordered to [w3, w1] already
                reuse_input_storage=True,
            )
            w13_scale[e].view(-1).copy_(p.w13_scale.view(-1))
            w2_scale[e].view(-1).copy_(p.w2_scale.view(-1))
            g1[e], g2[e] = p.w13_global_scale, p.w2_global_scale
        # The packed tensors' shapes only: apply views the parameters it is
        # given, so nothing here outlives the tensors a reload reprocesses.
        e = self.num_local_experts
        self._layout = dataclasses.replace(
            p,
            w13=p.w13.new_empty((e, *p.w13.shape[1:]), device="meta"),
            w13_scale=p.w13_scale.new_empty((e, *p.w13_scale.shape[1:]), device="meta"),
            w13_global_scale=refill_derived(layer, "_experts_w4a16_g1", g1),
            w2=p.w2.new_empty((e, *p.w2.shape[1:]), device="meta"),
            w2_scale=p.w2_scale.new_empty((e, *p.w2_scale.shape[1:]), device="meta"),
            w2_global_scale=refill_derived(layer, "_experts_w4a16_g2", g2),
            workspace=refill_derived(layer, "_experts_w4a16_workspace", p.workspace),
            num_experts=e,
        )

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor | None,
        workspace2: torch.Tensor | None,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool | None,
    ):
        # FlashInfer's public B12xMoEWrapper would keep a W4A16 copy of the
        # weights beside the checkpoint's; these are prepared in place.
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_dispatch import (
            launch_sm120_moe,
        )

        layout = self._layout
        assert layout is not None, "process_weights_after_loading must run first"
        assert self.w1_scale is not None and self.w2_scale is not None
        w = dataclasses.replace(
            layout,
            w13=w1.view(torch.int32).view(layout.w13.shape),
            w13_scale=self.w1_scale.view(layout.w13_scale.shape),
            w2=w2.view(torch.int32).view(layout.w2.shape),
            w2_scale=self.w2_scale.view(layout.w2_scale.shape),
        )
        launch_sm120_moe(
            a=hidden_states,
            topk_ids=topk_ids.to(torch.int32),
            topk_weights=topk_weights,
            w1_weight=w1,
            w1_weight_sf=w.w13_scale,
            w1_alpha=w.w13_global_scale,
            w2_weight=w2,
            w2_weight_sf=w.w2_scale,
            w2_alpha=w.w2_global_scale,
            num_experts=self.global_num_experts,
            top_k=self.topk,
            num_local_experts=self.num_local_experts,
            scatter_output=output,
            activation=self._activation_str,
            quant_mode="w4a16",
            _prepared_weights=w,
        )
