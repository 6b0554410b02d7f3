# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer b12x NVFP4 MoE experts (SM120/SM121)."""

from __future__ import annotations

from typing import Any

import torch

import vllm.envs as envs
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
    B12X_ACTIVATIONS,
    b12x_config_problems,
    flashinfer_takes_input_global_scale,
    flashinfer_w4a16_prepared_call,
    is_flashinfer_b12x_moe_available,
    make_b12x_wrapper,
    warn_fold_fallback,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a4 import (
    B12xW4A4Tensors,
    B12xW4A4Weights,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_w4a16 import (
    B12xW4A16Weights,
    W4A16PackedWeights,
    flashinfer_packed_weights,
    w4a16_launch_kwargs,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.fused_moe.weight_prep_guard import (
    check_unchanged,
    get_prep_state,
    guarded_preparation,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import PrepStatus
from vllm.model_executor.layers.fused_moe.weight_prep_steps import (
    PrepStep,
    restore_load_layout,
    run_preparation_steps,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    check_cap,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kNvfp4Dynamic,
    kNvfp4Static,
)

#: How the weights' per-expert global scales reach the kernel (W4A4):
#: "alpha" (default) keeps them as the kernel's alphas and every FP8 block
#: scale as loaded; "fold" multiplies them into the block scales and passes
#: alphas of 1 (loses precision at real weight magnitudes).
GLOBAL_SCALE_MODES = ("alpha", "fold")


class FlashInferB12xExperts(mk.FusedMoEExpertsModular):
    """NVFP4 MoE experts on FlashInfer's b12x kernel (SM120/SM121): W4A4
    (``quant_config.quant_dtype == "nvfp4"``: BF16 activations quantized
    inside the kernel) or W4A16 (``quant_config.use_nvfp4_w4a16``: BF16
    activations, FlashInfer's W4A16 layout, expert parallelism through
    ``expert_map``). ``silu``, ``gelu_tanh`` and ``relu2_no_mul``.

    ``process_weights_after_loading`` rewrites the layer's parameters into
    the kernel's layout in their own storage, every step within
    ``max_transient_bytes`` (an argument, 64 MiB by default), and
    records each step in ``layer.weight_prep_state``: called again it
    changes nothing, after an exception it resumes, and
    :meth:`restore_load_layout` takes the layer back to the layout its
    weight loader writes (a reload). The layouts and steps:
    ``flashinfer_b12x_w4a4`` and ``flashinfer_b12x_w4a16``.

    ``global_scale_mode`` (W4A4; ``VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE``):
    "alpha" (default) or "fold", see :data:`GLOBAL_SCALE_MODES`.
    """

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        max_transient_bytes: int | None = None,
        global_scale_mode: str | None = None,
    ):
        super().__init__(moe_config=moe_config, quant_config=quant_config)
        self.max_num_tokens = moe_config.max_num_tokens
        # The layer's shape, as the modular kernel reads it.
        self.out_dtype = moe_config.in_dtype
        self.num_local_experts = moe_config.num_local_experts
        self.ep_rank = moe_config.moe_parallel_config.ep_rank
        self.global_num_experts = moe_config.num_experts
        self.topk = moe_config.experts_per_token
        self.hidden_dim = moe_config.hidden_dim
        self.intermediate_size_per_partition = (
            moe_config.intermediate_size_per_partition
        )
        self.local_expert_offset = self.ep_rank * self.num_local_experts
        if quant_config.use_nvfp4_w4a16:
            self.weight_only = True
        elif quant_config.quant_dtype == "nvfp4":
            self.weight_only = False
        else:
            raise ValueError(
                "FlashInferB12xExperts runs NVFP4 weights with NVFP4 or 16-bit "
                f"activations, got activations {quant_config.quant_dtype!r} and "
                f"weights {quant_config.weight_quant_dtype!r}"
            )
        if max_transient_bytes is None:
            max_transient_bytes = DEFAULT_MAX_TRANSIENT_BYTES
        self.max_transient_bytes = check_cap(max_transient_bytes)
        if global_scale_mode is None:
            global_scale_mode = envs.VLLM_FLASHINFER_B12X_GLOBAL_SCALE_MODE
        if global_scale_mode not in GLOBAL_SCALE_MODES:
            raise ValueError(
                f"global_scale_mode must be one of {GLOBAL_SCALE_MODES}, got "
                f"{global_scale_mode!r}"
            )
        if self.weight_only and global_scale_mode != "alpha":
            # The W4A16 kernel multiplies each GEMM by its own per-expert
            # global scale: nothing to fold.
            raise ValueError(
                "W4A16 experts take the global scales as the kernel's alphas: "
                f"global_scale_mode must be 'alpha', got {global_scale_mode!r}"
            )
        self.global_scale_mode = global_scale_mode
        self.check_kernel_config(moe_config, self.weight_only)
        self.weights: B12xW4A4Weights | B12xW4A16Weights
        if self.weight_only:
            self.weights = B12xW4A16Weights(moe_config, self.max_transient_bytes)
        else:
            self.weights = B12xW4A4Weights(
                moe_config, self.max_transient_bytes, self._scale_mode, quant_config
            )
        #: What the kernel reads of the prepared layer, set by
        #: process_weights_after_loading (W4A4: B12xW4A4Tensors; W4A16:
        #: W4A16PackedWeights); None while the layer is not prepared.
        #: (``w1_sf_mma``, ``w2_sf_mma``, ``_fc2_input_scale``: its W4A4 fields.)
        self.prepared: B12xW4A4Tensors | W4A16PackedWeights | None = None
        # The layer's preparation state and the layer: apply tests the
        # state's ready flag, set and cleared at the weights' events.
        self._guard: tuple[Any, torch.nn.Module] | None = None
        # FlashInfer's objects, built on the first apply (they need the
        # device): the W4A4 wrapper, or the W4A16 prepared-weights record
        # with the binding it was made of.
        self._wrapper: Any | None = None
        self._flashinfer_packed: tuple[W4A16PackedWeights, Any] | None = None

    def _w4a4_field(self, name: str) -> torch.Tensor | None:
        t = self.prepared
        return getattr(t, name) if isinstance(t, B12xW4A4Tensors) else None

    @property
    def w1_sf_mma(self) -> torch.Tensor | None:
        """FC1's block scales as the kernel's MMA view (W4A4, prepared)."""
        return self._w4a4_field("w1_sf_mma")

    @property
    def w2_sf_mma(self) -> torch.Tensor | None:
        """FC2's block scales as the kernel's MMA view (W4A4, prepared)."""
        return self._w4a4_field("w2_sf_mma")

    @property
    def _fc2_input_scale(self) -> torch.Tensor | None:
        return self._w4a4_field("fc2_input_scale")

    @classmethod
    def check_kernel_config(cls, moe: FusedMoEConfig, weight_only: bool) -> None:
        """ValueError listing what FlashInfer's b12x kernel (0.7.4) cannot run
        in ``moe`` (W4A4, or W4A16 when ``weight_only``)."""
        problems = b12x_config_problems(moe, weight_only)
        if problems:
            mode = "W4A16" if weight_only else "W4A4"
            raise ValueError(
                f"FlashInfer b12x ({mode}) cannot run this MoE layer: "
                + "; ".join(problems)
            )

    @staticmethod
    def is_supported_config(
        cls: type[mk.FusedMoEExperts],
        moe_config: FusedMoEConfig,
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
        activation_format: mk.FusedMoEActivationFormat,
    ) -> tuple[bool, str | None]:
        supported, reason = mk.FusedMoEExperts.is_supported_config(
            cls, moe_config, weight_key, activation_key, activation_format
        )
        if not supported:
            device = is_flashinfer_b12x_moe_available()
            if not cls._supports_current_device() and not device:
                reason = f"kernel does not support the current device: {device.reason}"
            return False, reason
        problems = b12x_config_problems(moe_config, activation_key is None)
        if problems:
            return False, "; ".join(problems)
        if activation_key is None:
            call = flashinfer_w4a16_prepared_call()
            if not call:
                return False, call.reason
        return True, None

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return bool(is_flashinfer_b12x_moe_available())

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return True

    @staticmethod
    def _supports_quant_scheme(
        weight_key: QuantKey | None,
        activation_key: QuantKey | None,
    ) -> bool:
        # W4A4 (activations quantized inside the kernel) and W4A16.
        return (weight_key, activation_key) in (
            (kNvfp4Static, kNvfp4Dynamic),
            (kNvfp4Static, None),
        )

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation in B12X_ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        # Expert parallelism with W4A16 only: is_supported_config checks it.
        return True

    def supports_expert_map(self) -> bool:
        return self.weight_only

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        # The kernel applies the top-k weights and reduces itself.
        return TopKWeightAndReduceNoOP()

    def workspace_shapes(
        self,
        M: int,
        N: int,
        K: int,
        topk: int,
        global_num_experts: int,
        local_num_experts: int,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        activation: MoEActivation,
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        # FlashInfer manages its own workspaces.
        return (1,), (0,), (M, K)

    @property
    def expects_unquantized_inputs(self) -> bool:
        # BF16 hidden states: the kernel quantizes them itself (W4A4).
        return True

    @classmethod
    def supports_unfolded_alpha(cls) -> bool:
        """Whether the kernel takes ``input_global_scale`` (FlashInfer >=
        0.6.17), so that ``w1_alpha`` can carry the weight's global scale
        without also scaling the FC1 input quantization."""
        return bool(flashinfer_takes_input_global_scale())

    def _scale_mode(self) -> str:
        return self.effective_global_scale_mode

    @property
    def effective_global_scale_mode(self) -> str:
        """``global_scale_mode``, or "fold" where the kernel cannot take an
        unfolded alpha (an older FlashInfer; logged once, with the reason)."""
        if (
            self.global_scale_mode == "alpha"
            and not self.weight_only
            and not self.supports_unfolded_alpha()
        ):
            warn_fold_fallback(flashinfer_takes_input_global_scale().reason)
            return "fold"
        return self.global_scale_mode

    # -- weight preparation ---------------------------------------------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Prepare ``layer``'s NVFP4 parameters for b12x in place (see the
        class doc). Parameters keep their identity; a swizzled scale whose
        storage had no room for its padding becomes a new padded tensor.
        Skips the reorder when the loader already placed w13 as [w3; w1]
        (``layer.w13_loaded_as_w3w1``)."""
        self._prepare(layer)

    def _prepare(self, layer: torch.nn.Module, step: str | None = None) -> None:
        """The preparation, in order (``step``: that step only):

        1. the layer's record locked, its parameters' ``weight_loader``
           guarded, a layer prepared before checked unchanged
           (``weight_prep_guard.guarded_preparation``);
        2. the layout's steps not yet done, each recorded
           (``weight_prep_steps``; a RESTORING layer is restored first);
        3. once PREPARED, the kernel's views bound (the layout's ``bind``)
           and the layer's fingerprints recorded (the guard, as the block
           ends); then ``apply`` may run, unchecked.
        """
        with guarded_preparation(layer) as state:
            run_preparation_steps(layer, state, self.weights, step)
            if state.status is PrepStatus.PREPARED:
                self.prepared = self.weights.bind(layer, state, self.prepared)
        if state.status is PrepStatus.PREPARED:
            # Recorded as the block ended: apply may run from here (before,
            # e.g. after an interrupt in the record, it refuses).
            self._guard = (state, layer)

    def preparation_steps(self, layer: torch.nn.Module) -> list[PrepStep]:
        """The preparation of ``layer`` as named steps, in the order they run
        (the layout's own functions, unrecorded: run them through
        :meth:`run_preparation_step`, or all through
        :meth:`run_preparation`)."""
        return self.weights.preparation_steps(layer, get_prep_state(layer))

    def run_preparation(self, layer: torch.nn.Module) -> None:
        """Run the preparation steps not yet done, in order (a resume after an
        exception); binds the kernel's views once the layer is prepared.
        Holds the layer's lock."""
        self._prepare(layer)

    def run_preparation_step(self, layer: torch.nn.Module, name: str) -> None:
        """Run the one step ``name`` of :meth:`preparation_steps`, recorded;
        RuntimeError when the step before it is not done (nothing runs then),
        ValueError for an unknown name; a step done is not run again. The
        last step binds the kernel's views. Holds the layer's lock."""
        self._prepare(layer, name)

    def bind_prepared(self, layer: torch.nn.Module, previous: Any = None) -> None:
        """Make the kernel's views of a prepared layer's parameters (no copy
        of a weight): after the preparation, and for a copy of a prepared
        layer (``copy.deepcopy``, ``load_state_dict``). The tensors derived
        from the weights (alphas, scales) are copied into those of
        ``previous`` (default: the binding these experts had), where shapes
        match, so that every address a captured CUDA graph holds stays
        valid (a reload builds new experts: it passes the old binding)."""
        state = get_prep_state(layer)
        if previous is None:
            previous = self.prepared
        self.prepared = self.weights.bind(layer, state, previous)
        self._guard = (state, layer)

    def drop_prepared(self) -> None:
        """Forget the kernel's views: ``apply`` refuses until the layer is
        prepared again."""
        self.prepared = None
        self._flashinfer_packed = None
        self._guard = None

    def restore_load_layout(self, layer: torch.nn.Module) -> None:
        """Return the layer, from any state, to the layout its weight loader
        writes, in place and within the cap, so that new weights can be
        loaded into it (RL weight updates, sleep-mode wake-up).

        A step of an interrupted preparation that had started is finished;
        then the steps done are undone (W4A4: unswizzle, reorder back when
        the layer was loaded as [w1; w3], global scales as loaded; a fold
        stays recorded in ``weight_prep_state.folds``; W4A16: unpacked). The
        kernel's views are dropped. Resumable after an exception.

        Where the bytes cannot be trusted (parameters modified, replaced or
        converted since the preparation, e.g. ``layer.to(torch.bfloat16)``)
        or the exact restore fails, the parameters get the load layout's
        shapes and dtypes (reusing their storage where it fits) and the
        layer is marked torn: preparing it is refused until a complete
        reload. Holds the layer's lock.
        """
        state = get_prep_state(layer)
        with state.lock:
            self.drop_prepared()
            restore_load_layout(self.weights, layer, state)

    # -- copies (copy.deepcopy, pickle, torch.save) --------------------------
    def __getstate__(self) -> dict[str, Any]:
        # The kernel's views are made again from the copy's own parameters
        # (W4A16's int32 views of uint8 parameters cannot even be saved), and
        # FlashInfer's objects are the device's.
        d = dict(self.__dict__)
        d.update(
            prepared=None,
            _wrapper=None,
            _flashinfer_packed=None,
        )
        return d

    def _check_prepared(self) -> None:
        """What ``apply`` runs when the layer's ``ready`` flag is clear (never
        in steady state): RuntimeError when the layer is not prepared or an
        event saw its weights change (``check_unchanged``'s message); binds
        the views of a copy of prepared experts; sets the flag again."""
        if self._guard is None:
            raise RuntimeError(
                f"{type(self).__name__}.apply called before "
                "process_weights_after_loading prepared the layer's weights"
            )
        bound, layer = self._guard
        state = get_prep_state(layer)
        if state is not bound:  # a new record (layerwise reload)
            self.prepared = None
        if self.prepared is None and state.status is PrepStatus.PREPARED:
            check_unchanged(state, layer)
            self.bind_prepared(layer)  # a copy of prepared experts
        if state.status is not PrepStatus.PREPARED:
            raise RuntimeError(
                "the MoE layer's weights are not prepared (status "
                f"{state.status.value}): call process_weights_after_loading"
            )
        check_unchanged(state, layer)
        state.ready = True

    def _state_for_apply(self):
        """The layer's preparation state (RuntimeError before any
        preparation). ``apply`` holds its lock and runs
        :meth:`_check_prepared` only when its ``ready`` flag is clear: one
        flag test per call, the check itself after an event (see
        ``weight_prep_guard``)."""
        if self._guard is None:
            self._check_prepared()
            assert self._guard is not None  # it binds the layer or raises
        return self._guard[0]

    # -- compute --------------------------------------------------------------
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
    ) -> None:
        """One call of FlashInfer's b12x MoE on the prepared layer, into
        ``output`` [M, K]. Creates nothing per call here, and nothing new in
        FlashInfer's caches once the first call has built its objects."""
        state = self._state_for_apply()
        with state.lock:  # a reload or preparation of this layer waits
            if not state.ready or self.prepared is None:
                self._check_prepared()
            if self.weight_only:
                self._run_w4a16(
                    output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map
                )
            else:
                result = self._run_w4a4(hidden_states, w1, w2, topk_weights, topk_ids)
                output.copy_(result)

    def _run_w4a4(self, hidden_states, w1, w2, topk_weights, topk_ids):
        t = self.prepared
        assert isinstance(t, B12xW4A4Tensors)  # apply checked it is bound
        if self._wrapper is None:
            self._wrapper = make_b12x_wrapper(self.moe_config, hidden_states.device)
        extra = {}
        if t.fc1_input_scale is not None:
            # The FC1 input's own scale (calibrated); w1_alpha is then the
            # weight's global scale alone (the wrapper multiplies the two).
            extra["input_global_scale"] = t.fc1_input_scale
        return self._wrapper.run(
            hidden_states,
            w1,
            t.w1_sf_mma,
            w2,
            t.w2_sf_mma,
            topk_ids.to(torch.int32),  # fused_topk's ids are int32: no copy
            topk_weights.float(),  # float32 already: no copy
            w1_alpha=t.w1_alpha,
            w2_alpha=t.w2_alpha,
            fc2_input_scale=t.fc2_input_scale,
            **extra,
        )

    def _run_w4a16(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map
    ):
        call = flashinfer_w4a16_prepared_call()
        if not call:
            raise RuntimeError(f"W4A16 b12x kernel: {call.reason}")
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch

        pw = self.prepared
        assert isinstance(pw, W4A16PackedWeights)  # apply checked it is bound
        if self._flashinfer_packed is None or self._flashinfer_packed[0] is not pw:
            packed = flashinfer_packed_weights(pw, hidden_states.device)
            self._flashinfer_packed = (pw, packed)
        moe_dispatch.launch_sm120_moe(
            **w4a16_launch_kwargs(
                self.moe_config,
                pw,
                self._flashinfer_packed[1],
                hidden_states,
                w1,
                w2,
                topk_weights,
                topk_ids,
                expert_map,
                output,
            )
        )
