# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ModelOpt NVFP4 quantization for fused MoE layers (vLLM's class names and
constructor arguments; the MoE method runs the oracle as vLLM's does)."""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    nvfp4_moe_quant_config,
    nvfp4_w4a16_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEKernel
from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
    convert_to_nvfp4_moe_kernel_format,
    is_global_sf_supported_for_nvfp4_backend,
    make_nvfp4_moe_kernel,
    make_nvfp4_moe_quant_config,
    select_nvfp4_moe_backend,
)
from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    check_unchanged,
    get_prep_state,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
)
from vllm.model_executor.layers.fused_moe.weight_prep_steps import PrepStep
from vllm.model_executor.layers.quantization.utils.nvfp4_format import (
    NVFP4_BLOCK_SIZE,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    load_layout_data,
    load_layout_ok,
    nvfp4_moe_param_specs,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    kNvfp4Dynamic,
    kNvfp4Static,
)
from vllm.model_executor.utils import replace_parameter

__all__ = ["NVFP4_QUANT_MODES", "ModelOptNvFp4Config", "ModelOptNvFp4FusedMoE"]

#: Activation modes of an NVFP4 MoE layer, named as FlashInfer's ``quant_mode``
#: (this tree's short names for ModelOpt's ``quant_algo``): ``"w4a4"`` is
#: ``NVFP4`` (activations quantized to NVFP4 too), ``"w4a16"`` is
#: ``W4A16_NVFP4`` (weight-only: BF16 activations).
NVFP4_QUANT_MODES = {"w4a4": "NVFP4", "w4a16": "W4A16_NVFP4"}


class ModelOptNvFp4Config:
    """NVFP4 checkpoints produced by NVIDIA ModelOpt (``quant_algo`` NVFP4 or
    W4A16_NVFP4).

    Weights are packed E2M1 with FP8 block scales over 16 elements and a
    float32 ``weight_scale_2`` (dequantization direction) per tensor; for
    MoE layers, per expert and per projection. This tree loads serialized
    checkpoints only (``is_checkpoint_nvfp4_serialized=True``).
    """

    def __init__(
        self,
        quant_method: str = "NVFP4",
        is_checkpoint_nvfp4_serialized: bool = False,
        kv_cache_quant_algo: str | None = None,
        exclude_modules: list[str] | None = None,
        group_size: int = 16,
        *,
        quantization_args: Any = None,
    ) -> None:
        if quant_method not in NVFP4_QUANT_MODES.values():
            raise ValueError(
                f"Unsupported ModelOpt NVFP4 quant_algo: {quant_method}. "
                f"Supported: {' / '.join(NVFP4_QUANT_MODES.values())}."
            )
        if group_size != NVFP4_BLOCK_SIZE:
            raise ValueError(f"NVFP4 group_size must be 16, got {group_size}")
        self.quant_method = quant_method
        self.is_checkpoint_nvfp4_serialized = is_checkpoint_nvfp4_serialized
        self.kv_cache_quant_algo = kv_cache_quant_algo
        self.exclude_modules = list(exclude_modules or [])
        self.group_size = group_size

    @classmethod
    def for_mode(cls, quant_mode: str = "w4a4") -> ModelOptNvFp4Config:
        """A serialized checkpoint's config for this tree's ``quant_mode``
        ("w4a4" or "w4a16")."""
        if quant_mode not in NVFP4_QUANT_MODES:
            raise ValueError(
                f"NVFP4 quant_mode must be one of {list(NVFP4_QUANT_MODES)}, "
                f"got {quant_mode!r}"
            )
        return cls(NVFP4_QUANT_MODES[quant_mode], is_checkpoint_nvfp4_serialized=True)

    @property
    def quant_mode(self) -> str:
        """ "w4a4" or "w4a16" (see :data:`NVFP4_QUANT_MODES`)."""
        return "w4a16" if self.quant_method == "W4A16_NVFP4" else "w4a4"

    @property
    def is_weight_only(self) -> bool:
        """True for W4A16: BF16 activations, NVFP4 weights."""
        return self.quant_mode == "w4a16"

    def get_name(self) -> str:
        return "modelopt_fp4"

    def get_quant_method(self, layer: torch.nn.Module, prefix: str = ""):
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE

        if isinstance(layer, FusedMoE):
            return ModelOptNvFp4FusedMoE(self, layer.moe_config)
        return None


class ModelOptNvFp4FusedMoE:
    """Creates a MoE layer's NVFP4 parameters; after loading, converts them
    with the oracle and builds the modular kernel, whose experts prepare the
    layout (vLLM's ``process_weights_after_loading`` sequence).

    Parameters (load layout; rows = 2I gated, I otherwise):

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

    Unlike vLLM's, the input-scale parameters keep their loaded [E, G]
    values (this tree's weight loader writes them again on a reload); the
    oracle's reduction of them goes to the quant config.
    """

    def __init__(
        self, quant_config: ModelOptNvFp4Config, moe_config: FusedMoEConfig
    ) -> None:
        if not quant_config.is_checkpoint_nvfp4_serialized:
            raise ValueError(
                "this tree loads serialized NVFP4 checkpoints only: "
                "ModelOptNvFp4Config(is_checkpoint_nvfp4_serialized=True)"
            )
        self.moe = moe_config
        self.quant_config = quant_config
        self.use_a16 = quant_config.quant_method == "W4A16_NVFP4"
        self.nvfp4_backend, self.experts_cls = select_nvfp4_moe_backend(
            config=moe_config,
            weight_key=kNvfp4Static,
            activation_key=None if self.use_a16 else kNvfp4Dynamic,
        )
        self.use_global_sf = is_global_sf_supported_for_nvfp4_backend(
            self.nvfp4_backend
        )
        #: This tree's options of the experts (the emulation's, the cap).
        self.experts_kwargs: dict[str, Any] = {}
        self._configured = None
        self.moe_quant_config: FusedMoEQuantConfig | None = None
        self.moe_kernel: FusedMoEKernel | None = None
        self._input_scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_experts_kwargs(self, experts_kwargs: dict[str, Any]) -> None:
        """This tree's options of the experts class (the emulation's, the
        preparation's cap), checked now: ValueError naming a bad one."""
        stub = (
            nvfp4_w4a16_moe_quant_config(None, None, None, None)
            if self.use_a16
            else nvfp4_moe_quant_config(None, None, None, None, None, None)
        )
        self._configured = self.experts_cls(self.moe, stub, **experts_kwargs)
        self.experts_kwargs = experts_kwargs

    @property
    def global_scale_mode(self) -> str:
        """The experts' effective global-scale mode ("alpha" or "fold")."""
        return self._configured.effective_global_scale_mode

    @property
    def experts(self):
        """The kernel's experts (None before the first preparation)."""
        return None if self.moe_kernel is None else self.moe_kernel.fused_experts

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
        expected = (moe.num_local_experts, moe.hidden_dim, inter)
        if given != expected:
            raise ValueError(
                "create_weights got (num_experts, hidden_size, "
                f"intermediate_size_per_partition) = {given}, but the layer's "
                f"FusedMoEConfig has {expected}"
            )
        for dim, what in (
            (hidden_size, "hidden_size"),
            (intermediate_size_per_partition, "intermediate_size per partition"),
        ):
            if dim % NVFP4_BLOCK_SIZE != 0:
                raise ValueError(
                    f"NVFP4 MoE needs {what} to be a multiple of "
                    f"{NVFP4_BLOCK_SIZE}, got {dim}"
                )
        state = get_prep_state(layer)
        swizzles = not self.use_a16  # the b12x W4A4 layout swizzles in place
        for name, (shape, dtype) in nvfp4_moe_param_specs(moe).items():
            data = load_layout_data(name, shape, dtype, swizzles, state)
            param = torch.nn.Parameter(data, requires_grad=False)
            for key, value in extra_weight_attrs.items():
                setattr(param, key, value)
            layer.register_parameter(name, param)

    # -- after loading ---------------------------------------------------------
    def _convert(self, layer: torch.nn.Module) -> None:
        """The oracle's conversion, as vLLM runs it (for FLASHINFER_B12X the
        same tensors back: the experts rewrite them in place)."""
        w13_weight_scale_2 = layer.w13_weight_scale_2[:, 0].contiguous()  # w1's
        (
            w13,
            w13_scale,
            w13_scale_2,
            a13_scale,
            w2,
            w2_scale,
            w2_scale_2,
            a2_scale,
        ) = convert_to_nvfp4_moe_kernel_format(
            nvfp4_backend=self.nvfp4_backend,
            layer=layer,
            w13=layer.w13_weight,
            w13_scale=layer.w13_weight_scale,
            w13_scale_2=w13_weight_scale_2,
            a13_scale=layer.w13_input_scale,
            w2=layer.w2_weight,
            w2_scale=layer.w2_weight_scale,
            w2_scale_2=layer.w2_weight_scale_2,
            a2_scale=layer.w2_input_scale,
            is_act_and_mul=self.moe.is_act_and_mul,
            use_a16=self.use_a16,
        )
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w13_weight_scale", w13_scale)
        replace_parameter(layer, "w13_weight_scale_2", w13_scale_2)
        replace_parameter(layer, "w2_weight", w2)
        replace_parameter(layer, "w2_weight_scale", w2_scale)
        replace_parameter(layer, "w2_weight_scale_2", w2_scale_2)
        # The W4A16 kernel takes no activation scales: none kept.
        self._input_scales = None if self.use_a16 else (a13_scale, a2_scale)

    def _build_moe_kernel(self, layer: torch.nn.Module) -> None:
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = make_nvfp4_moe_kernel(
            moe_quant_config=self.moe_quant_config,
            moe_config=self.moe,
            experts_cls=self.experts_cls,
            backend=self.nvfp4_backend,
            experts_kwargs=self.experts_kwargs,
        )

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
        a13_scale, a2_scale = self._input_scales or (None, None)
        return make_nvfp4_moe_quant_config(
            backend=self.nvfp4_backend,
            w13_scale=layer.w13_weight_scale,
            w2_scale=layer.w2_weight_scale,
            w13_scale_2=layer.w13_weight_scale_2,
            w2_scale_2=layer.w2_weight_scale_2,
            a13_scale=a13_scale,
            a2_scale=a2_scale,
            layer=layer,
            use_a16=self.use_a16,
        )

    def experts_for(self, layer: torch.nn.Module):
        """Convert ``layer``'s tensors with the oracle and build the kernel
        (as ``process_weights_after_loading`` does first); its experts."""
        with get_prep_state(layer).lock:
            # The previous kernel's tensors go first (they are replaced).
            self.moe_kernel = self.moe_quant_config = self._input_scales = None
            self._convert(layer)
            self._build_moe_kernel(layer)
            return self.moe_kernel.fused_experts

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Convert the loaded parameters with the oracle, build the kernel,
        and let its experts prepare the layout (a no-op on a prepared layer;
        resumes an interrupted preparation, see
        :mod:`~vllm.model_executor.layers.fused_moe.weight_prep_state`).
        Holds the layer's lock: a concurrent preparation, restore, load or
        forward of the same layer waits."""
        with get_prep_state(layer).lock:
            self.experts_for(layer).process_weights_after_loading(layer)

    def preparation_steps(self, layer: torch.nn.Module) -> list[PrepStep]:
        """``process_weights_after_loading`` as named steps, in order (for
        benchmarks): the conversion and the kernel are built now (neither
        moves a weight byte for b12x); each step runs that one step of the
        experts' preparation, recorded (``experts.run_preparation_step``:
        RuntimeError when the step before it is not done)."""
        experts = self.experts_for(layer)
        return [
            (name, lambda name=name: experts.run_preparation_step(layer, name))
            for name, _ in experts.preparation_steps(layer)
        ]

    def restore_load_layout(self, layer: torch.nn.Module) -> None:
        """Return the layer to the layout ``weight_loader`` writes (a reload)."""
        state = get_prep_state(layer)
        with state.lock:
            experts = self.experts
            if experts is None:
                if state.status is PrepStatus.LOADING and load_layout_ok(
                    layer, self.moe
                ):
                    return  # nothing prepared, nothing replaced
                experts = self.experts_for(layer)
            experts.restore_load_layout(layer)

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        state = get_prep_state(layer)
        with state.lock:  # a reload or preparation of this layer waits
            if self.moe_kernel is None or not state.ready:
                self._check_ready(layer, state)
            return self.moe_kernel.apply(
                x,
                layer.w13_weight,
                layer.w2_weight,
                topk_weights,
                topk_ids,
                activation=layer.activation,
                global_num_experts=layer.global_num_experts,
                expert_map=layer.expert_map,
                apply_router_weight_on_input=False,
            )

    def _check_ready(self, layer: torch.nn.Module, state) -> None:
        # Only once an event cleared the ready flag (weight_prep_guard).
        if self.moe_kernel is not None and state.status is PrepStatus.PREPARED:
            check_unchanged(state, layer)
            state.ready = True
            return
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
