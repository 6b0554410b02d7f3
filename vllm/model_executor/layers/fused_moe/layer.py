# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``FusedMoE``: a Mixture-of-Experts layer with NVFP4 experts."""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts import get_nvfp4_experts_class
from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk

__all__ = ["FusedMoE"]


class FusedMoE(torch.nn.Module):
    """A MoE layer: routing plus E experts (FC1, activation, FC2).

    Build, load, prepare, run::

        layer = FusedMoE(num_experts=E, top_k=K, hidden_size=H,
                         intermediate_size=I, activation="silu",
                         quant_config=ModelOptNvFp4Config(),
                         moe_backend="flashinfer_b12x_emulated")
        ...  # load w13_weight, w13_weight_scale, ... (see the quant method)
        layer.quant_method.process_weights_after_loading(layer)
        out = layer(hidden_states, router_logits)  # [T, H] BF16

    Args:
        intermediate_size: I of the whole model; the layer holds
            I / tp_size of it.
        moe_backend: ``"flashinfer_b12x"`` (SM120/121 GPUs) or
            ``"flashinfer_b12x_emulated"`` (torch, any device). Asking for a
            backend that cannot run here raises ValueError with the reason.
        experts_kwargs: extra options of the experts class (e.g.
            ``max_transient_bytes``, or ``weights_only`` for the emulation).
        renormalize: renormalize the top-k routing weights to sum to 1.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        activation: MoEActivation | str = MoEActivation.SILU,
        quant_config: Any = None,
        moe_backend: str = "flashinfer_b12x",
        params_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        renormalize: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        experts_kwargs: dict[str, Any] | None = None,
        prefix: str = "",
    ):
        super().__init__()
        if quant_config is None:
            raise ValueError(
                "FusedMoE in this tree supports NVFP4 experts only: pass "
                "quant_config=ModelOptNvFp4Config()"
            )
        if intermediate_size % tp_size != 0:
            raise ValueError(
                f"intermediate_size {intermediate_size} is not divisible by "
                f"tp_size {tp_size}"
            )
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        device = torch.device(
            device if device is not None else torch.get_default_device()
        )
        self.moe_config = FusedMoEConfig(
            num_experts=num_experts,
            experts_per_token=top_k,
            hidden_dim=hidden_size,
            intermediate_size_per_partition=intermediate_size // tp_size,
            activation=MoEActivation.from_str(activation),
            in_dtype=params_dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.top_k = top_k
        self.renormalize = renormalize
        self.params_dtype = params_dtype
        self.moe_backend = moe_backend
        self.experts_kwargs = dict(experts_kwargs or {})
        self.prefix = prefix
        get_nvfp4_experts_class(moe_backend).check_supported(
            self.moe_config, "nvfp4", device
        )
        self.quant_method = quant_config.get_quant_method(self, prefix)
        self.quant_method.create_weights(self, device)

    @property
    def activation(self) -> MoEActivation:
        return self.moe_config.activation

    def forward(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """[T, H] ``params_dtype`` activations, [T, E] router logits -> [T, H]."""
        topk_weights, topk_ids = fused_topk(
            hidden_states, router_logits, self.top_k, self.renormalize
        )
        return self.quant_method.apply(
            self, hidden_states.to(self.params_dtype), topk_weights, topk_ids
        )
