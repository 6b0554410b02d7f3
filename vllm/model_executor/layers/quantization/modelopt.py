# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ModelOpt NVFP4 quantization for fused MoE layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts import get_nvfp4_experts_class
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEKernel,
    MoEPrepareAndFinalizeNoEP,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
    get_prep_state,
    load_layout_data,
    nvfp4_moe_param_specs,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    NVFP4_BLOCK_SIZE,
)

__all__ = ["NVFP4_QUANT_MODES", "ModelOptNvFp4Config", "ModelOptNvFp4FusedMoE"]

#: Activation modes of an NVFP4 MoE layer, named as FlashInfer's ``quant_mode``:
#: ``"w4a4"`` quantizes activations to NVFP4 too (ModelOpt ``NVFP4``);
#: ``"w4a16"`` keeps them BF16, weights only (ModelOpt ``W4A16_NVFP4``,
#: compressed-tensors NVFP4 with ``input_activations: null``).
NVFP4_QUANT_MODES = ("w4a4", "w4a16")


class ModelOptNvFp4Config:
    """NVFP4 checkpoints produced by NVIDIA ModelOpt (``quant_algo: NVFP4``).

    Weights are packed E2M1 with FP8 block scales over 16 elements and a
    float32 ``weight_scale_2`` (dequantization direction) per tensor; for
    MoE layers, per expert and per projection. ``quant_mode`` is one of
    :data:`NVFP4_QUANT_MODES`: ``"w4a16"`` for weight-only checkpoints.
    """

    def __init__(
        self,
        group_size: int = NVFP4_BLOCK_SIZE,
        exclude_modules: list[str] | None = None,
        quant_mode: str = "w4a4",
    ):
        if group_size != NVFP4_BLOCK_SIZE:
            raise ValueError(f"NVFP4 group_size must be 16, got {group_size}")
        if quant_mode not in NVFP4_QUANT_MODES:
            raise ValueError(
                f"NVFP4 quant_mode must be one of {NVFP4_QUANT_MODES}, "
                f"got {quant_mode!r}"
            )
        self.group_size = group_size
        self.exclude_modules = list(exclude_modules or [])
        self.quant_mode = quant_mode

    @property
    def is_weight_only(self) -> bool:
        """True for W4A16: BF16 activations, NVFP4 weights."""
        return self.quant_mode == "w4a16"

    def get_quant_method(self, layer: torch.nn.Module, prefix: str = ""):
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE

        if isinstance(layer, FusedMoE):
            return ModelOptNvFp4FusedMoE(self, layer.moe_config, layer.moe_backend,
                                         **layer.experts_kwargs)  # fmt: skip
        return None


class ModelOptNvFp4FusedMoE:
    """Creates a MoE layer's NVFP4 parameters and runs them through the
    selected experts implementation.

    Parameters (checkpoint layout; rows = 2I gated, I otherwise):

    ==================== ================= ================
    name                 shape             dtype
    ==================== ================= ================
    w13_weight           [E, rows, H/2]    uint8 (2 x E2M1)
    w13_weight_scale     [E, rows, H/16]   float8_e4m3fn
    w13_weight_scale_2   [E, 2] or [E, 1]  float32
    w13_input_scale      [E, 2] or [E, 1]  float32
    w2_weight            [E, H, I/2]       uint8
    w2_weight_scale      [E, H, I/16]      float8_e4m3fn
    w2_weight_scale_2    [E]               float32
    w2_input_scale       [E]               float32
    ==================== ================= ================
    """

    def __init__(
        self,
        quant_config: ModelOptNvFp4Config,
        moe: FusedMoEConfig,
        backend: str,
        **experts_kwargs: Any,
    ):
        self.quant_config = quant_config
        self.moe = moe
        self.experts_cls = get_nvfp4_experts_class(backend, quant_config.quant_mode)
        self.experts_kwargs = experts_kwargs
        # One experts object for the layer's lifetime: it holds the kernel's
        # views of the prepared weights, which a re-preparation updates.
        self.experts = self.experts_cls(
            moe_config=moe,
            quant_config=FusedMoEQuantConfig(quant_dtype="nvfp4"),
            **experts_kwargs,
        )
        self.kernel: FusedMoEKernel | None = None

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """Register the NVFP4 parameters (table above) on ``layer``, on the
        current default device (``with torch.device(...)``, as vLLM's model
        loader sets it). The sizes are this rank's: ``num_experts`` local
        experts, I already divided by the tensor-parallel size; they must be
        the ones the layer's ``FusedMoEConfig`` was built with.
        ``params_dtype`` is the activation dtype: NVFP4 weights are uint8 and
        their scales FP8 / float32 whatever it is. Each of
        ``extra_weight_attrs`` (e.g. ``weight_loader``) is set on every
        parameter."""
        moe = self.moe
        given = (num_experts, hidden_size, intermediate_size_per_partition)
        inter = moe.intermediate_size_per_partition
        expected = (moe.num_experts, moe.hidden_dim, inter)
        if given != expected:
            raise ValueError(
                "create_weights got (num_experts, hidden_size, "
                f"intermediate_size_per_partition) = {given}, but the layer's "
                f"FusedMoEConfig has {expected}"
            )
        for dim, what in ((hidden_size, "hidden_size"),
                          (intermediate_size_per_partition,
                           "intermediate_size per partition")):  # fmt: skip
            if dim % NVFP4_BLOCK_SIZE != 0:
                raise ValueError(
                    f"NVFP4 MoE needs {what} to be a multiple of "
                    f"{NVFP4_BLOCK_SIZE}, got {dim}"
                )
        specs = nvfp4_moe_param_specs(moe)
        state = get_prep_state(layer)
        for name, (shape, dtype) in specs.items():
            swizzles = self.experts_cls.swizzles_block_scales
            data = load_layout_data(name, shape, dtype, swizzles, state)
            param = torch.nn.Parameter(data, requires_grad=False)
            for key, value in extra_weight_attrs.items():
                setattr(param, key, value)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Prepare the loaded parameters for the selected experts.

        A no-op on a prepared layer; resumes an interrupted preparation (see
        :mod:`~vllm.model_executor.layers.fused_moe.weight_prep_state`).
        Holds the layer's lock: a concurrent preparation, restore, load or
        forward of the same layer waits."""
        with get_prep_state(layer).lock:
            for _, step in self.preparation_steps(layer):
                step()

    def preparation_steps(
        self, layer: torch.nn.Module
    ) -> list[tuple[str, Callable[[], None]]]:
        """``process_weights_after_loading`` as named steps (for benchmarks):
        the experts' own steps, then building the kernel."""

        def build_kernel() -> None:
            with get_prep_state(layer).lock:
                if self.kernel is None:
                    self.kernel = FusedMoEKernel(
                        MoEPrepareAndFinalizeNoEP(), self.experts
                    )

        return [*self.experts.preparation_steps(layer), ("kernel", build_kernel)]

    def restore_load_layout(self, layer: torch.nn.Module) -> None:
        """Return the layer to the layout ``weight_loader`` writes (a reload)."""
        self.experts.restore_load_layout(layer)

    def apply(
        self,
        layer: torch.nn.Module,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        state = get_prep_state(layer)
        with state.lock:  # a reload or preparation of this layer waits
            self._check_ready(layer, state)
            return self.kernel(
                hidden_states, layer.w13_weight, layer.w2_weight, topk_weights,
                topk_ids,
            )  # fmt: skip

    def _check_ready(self, layer: torch.nn.Module, state) -> None:
        if self.kernel is None or state.status is not PrepStatus.PREPARED:
            if state.status is PrepStatus.PREPARING:
                why = (
                    f"its preparation was interrupted after {state.done}: call "
                    "quant_method.process_weights_after_loading(layer) again to "
                    "complete it"
                )
            elif state.status is PrepStatus.RESTORING:
                why = "it was being returned to the load layout for a reload"
            elif state.torn:
                why = f"it is torn ({state.torn_reason}): reload it completely"
            else:
                why = "its weights are in the load layout"
            raise RuntimeError(
                "FusedMoE layer used before quant_method."
                f"process_weights_after_loading(layer) prepared its weights: {why}"
            )
        state.check_unchanged(layer)
