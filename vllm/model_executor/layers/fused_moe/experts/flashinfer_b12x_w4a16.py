# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashInfer b12x W4A16 experts: NVFP4 weights, BF16 activations (SM120/121).

``process_weights_after_loading`` rewrites a loaded ModelOpt NVFP4 layer into
FlashInfer 0.7.4's W4A16 runtime layout (``W4A16PackedWeights``), in the
parameters' own storage, every step within ``max_transient_bytes``::

    checkpoint layout                          W4A16 layout (same storage)
    w13_weight       uint8 [E, N, H/2]    -> int32 [E, H/16, N/64*128]
                     ([w3; w1] rows are rotated by I into [w1; w3])
    w13_weight_scale fp8 [E, N, H/16]     -> fp8 [E, H/16, N], x 2^x13, flush
    w13_weight_scale_2 [E, 2] or [E, 1]   -> w13_global_scale [E] (new, tiny)
    w2_weight        uint8 [E, H, I/2]    -> int32 [E, I/16, H/64*128]
    w2_weight_scale  fp8 [E, H, I/16]     -> fp8 [E, I/16, H], x 2^x2, flush
    w2_weight_scale_2 [E]                 -> w2_global_scale [E] (new, tiny)
    w13_input_scale / w2_input_scale      ignored (activations stay BF16)

Steps: ``validate`` (before any write), ``halves`` (only when a [w3; w1]
w13 has I % 64 != 0: the half swap, since the rotation works on 64-row
strips), ``exponents`` (the power-of-two factors of both block scales,
recorded in the layer's prep state before the scales change), ``w13``,
``w2`` (codes and scales, resumable chunk by chunk) and ``finalize``
(global scales, ``packed_weights``, the expert map).

Gate and up share one FC1 alpha. An expert whose w1 and w3 global scales
differ keeps s_gate as alpha1 and carries s_up / s_gate in alpha2 (up enters
``silu(gate) * up`` linearly), so no block scale is rewritten.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
    FlashInferB12xExperts,
    check_global_scales,
    recorded_prep_step,
)
from vllm.model_executor.layers.fused_moe.modular_kernel import (
    FusedMoEExperts,
    Support,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
    get_prep_state,
)
from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_values,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    DEFAULT_MAX_TRANSIENT_BYTES,
    moe_prep_threads,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_moe import (
    pack_w4a16_blockscale_,
    repack_w4a16_weight_,
    unpack_w4a16_blockscale_,
    unrepack_w4a16_weight_,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
    W4A16_TILE_N,
    w4a16_global_scale,
    w4a16_scale_exponent,
)

__all__ = [
    "FlashInferB12xW4A16Experts",
    "W4A16PackedWeights",
    "flashinfer_w4a16_prepared_call",
]


@dataclass
class W4A16PackedWeights:
    """What the W4A16 kernel reads (FlashInfer's ``W4A16PackedWeights``
    fields; ``w13``/``w2`` and the scales are views of the layer's
    parameters, the global scales new [E] float32 tensors).

    Attributes:
        w13: int32 [E, H/16, (N/64) * 128], N = 2I ([w1; w3]) or I.
        w13_scale: float8_e4m3fn-typed bytes [E, H/16, N].
        w13_global_scale: float32 [E].
        w2: int32 [E, I/16, (H/64) * 128].
        w2_scale: float8_e4m3fn-typed bytes [E, I/16, H].
        w2_global_scale: float32 [E].
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global_scale: torch.Tensor
    hidden_size: int
    intermediate_size: int
    num_experts: int
    is_gated: bool


def _replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor):
    param = getattr(layer, name)
    if value is not param:
        param.data = value


class FlashInferB12xW4A16Experts(FusedMoEExperts):
    """NVFP4 W4A16 experts on FlashInfer's b12x kernel (SM120/SM121,
    FlashInfer >= 0.7.4): BF16 activations, weights in FlashInfer's packed
    W4A16 layout, ``silu`` and ``relu2``, expert parallelism through the
    kernel's ``expert_map`` (``apply`` takes GLOBAL expert ids)."""

    name = "flashinfer_b12x"
    quant_mode = "w4a16"
    wants_w3w1 = True
    swizzles_block_scales = False
    #: ``apply`` takes global expert ids; the experts map them (EP).
    takes_global_expert_ids = True

    def __init__(
        self,
        moe_config: FusedMoEConfig,
        quant_config: FusedMoEQuantConfig,
        *,
        max_transient_bytes: int = DEFAULT_MAX_TRANSIENT_BYTES,
        global_scale_mode: str = "alpha",
    ):
        super().__init__(moe_config, quant_config)
        if global_scale_mode != "alpha":
            # The W4A16 kernel multiplies each GEMM by its own per-expert
            # global scale; nothing to fold (the W4A4 option is refused).
            raise ValueError(
                "W4A16 experts take the global scales as the kernel's alphas: "
                f"global_scale_mode must be 'alpha', got {global_scale_mode!r}"
            )
        h, inter = moe_config.hidden_dim, moe_config.intermediate_size_per_partition
        for what, rows in (("hidden size", h), ("w13 rows", moe_config.w13_rows)):
            if rows % W4A16_TILE_N != 0:
                raise ValueError(
                    f"W4A16 b12x needs the {what} to be a multiple of "
                    f"{W4A16_TILE_N}, got {rows}"
                )
        if inter % 16 != 0:
            raise ValueError(f"W4A16 needs I to be a multiple of 16, got {inter}")
        self.max_transient_bytes = max_transient_bytes
        #: The prepared weights, views of the layer's parameters; None until
        #: process_weights_after_loading.
        self.packed_weights: W4A16PackedWeights | None = None
        #: int32 [global experts]: local index or -1 (expert parallelism);
        #: None when this rank holds every expert.
        self.expert_map: torch.Tensor | None = None
        self.global_num_experts = moe_config.num_experts

    # -- capability predicates ------------------------------------------------
    @classmethod
    def is_supported_device(cls, device: torch.device) -> Support:
        # The W4A4 experts' gate (SM120/121, CUDA), then the prepared call.
        support = FlashInferB12xExperts.is_supported_device(device)
        return flashinfer_w4a16_prepared_call() if support else support

    @classmethod
    def supports_quant_scheme(cls, quant_dtype: str) -> Support:
        return FlashInferB12xExperts.supports_quant_scheme(quant_dtype)

    @classmethod
    def supports_activation(cls, activation: MoEActivation) -> Support:
        return Support.yes()  # silu and relu2

    @classmethod
    def supports_expert_parallel(cls) -> bool:
        return True

    # -- weight preparation ---------------------------------------------------
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Prepare ``layer`` for the W4A16 kernel (see module doc): a no-op
        on a prepared layer, resumes an interrupted preparation."""
        with moe_prep_threads(layer.w13_weight.device):
            for _, step in self.preparation_steps(layer):
                step()

    def _rotate(self, layer: torch.nn.Module) -> int:
        """Rows the w13 rotation moves: I for a [w3; w1] gated weight."""
        moe = self.moe_config
        if moe.is_act_and_mul and getattr(layer, "w13_loaded_as_w3w1", False):
            return moe.intermediate_size_per_partition
        return 0

    def preparation_steps(
        self, layer: torch.nn.Module
    ) -> list[tuple[str, Callable[[], None]]]:
        """The preparation as named, recorded steps (see module doc)."""
        cap = self.max_transient_bytes
        state = get_prep_state(layer)
        first_expert = getattr(layer, "_first_expert", 0)

        @torch.no_grad()
        def validate() -> None:
            check_global_scales(layer, first_expert, ("weight_scale_2",))
            for name in ("w13_weight_scale", "w2_weight_scale"):
                check_blockscale_values(name, getattr(layer, name),
                                        first_expert=first_expert,
                                        max_transient_bytes=cap)  # fmt: skip

        @torch.no_grad()
        def halves() -> None:
            rotate = self._rotate(layer)
            if rotate % W4A16_TILE_N == 0:
                return
            # [w3; w1] -> [w1; w3] by the half swap; the loader then writes
            # w1 first, and the [E, 2] global scales follow their rows.
            reorder_w1w3_to_w3w1(
                layer.w13_weight, layer.w13_weight_scale, dim=-2,
                max_transient_bytes=cap, progress=state.progress_of("halves"),
            )  # fmt: skip
            s2 = layer.w13_weight_scale_2
            if s2.shape[1] == 2:
                s2.copy_(s2.flip(1))
            layer.w13_loaded_as_w3w1 = False

        @torch.no_grad()
        def exponents() -> None:
            state.values["w4a16"] = {
                "rotate": self._rotate(layer),
                "w13": w4a16_scale_exponent(layer.w13_weight_scale),
                "w2": w4a16_scale_exponent(layer.w2_weight_scale),
            }

        def repack(prefix: str) -> Callable[[], None]:
            @torch.no_grad()
            def step() -> None:
                v = state.values["w4a16"]
                rotate = v["rotate"] if prefix == "w13" else 0
                repack_w4a16_weight_(
                    getattr(layer, f"{prefix}_weight"), rotate=rotate,
                    max_transient_bytes=cap,
                    progress=state.progress_of(f"repack.{prefix}"),
                )  # fmt: skip
                pack_w4a16_blockscale_(
                    getattr(layer, f"{prefix}_weight_scale"), v[prefix],
                    rotate=rotate, max_transient_bytes=cap,
                    progress=state.progress_of(f"scales.{prefix}"),
                )  # fmt: skip

            return step

        @torch.no_grad()
        def finalize() -> None:
            self._finalize(layer, state.values["w4a16"])

        steps = [("validate", validate), ("halves", halves),
                 ("exponents", exponents), ("w13", repack("w13")),
                 ("w2", repack("w2")), ("finalize", finalize)]  # fmt: skip
        return [
            (name, self._recorded(layer, state, steps[: i + 1]))
            for i, (name, _) in enumerate(steps)
        ]

    def _finalize(self, layer: torch.nn.Module, v: dict) -> None:
        moe = self.moe_config
        e, h = moe.num_experts, moe.hidden_dim
        inter, rows = moe.intermediate_size_per_partition, moe.w13_rows
        s13 = layer.w13_weight_scale_2.detach().float().reshape(e, -1)  # [E, G]
        s2 = layer.w2_weight_scale_2.detach().float().reshape(e)
        if moe.is_act_and_mul and s13.shape[1] == 2:
            gate_col = 1 if v["rotate"] else 0  # [w3; w1]: w1 is the 2nd half
            gate, up = s13[:, gate_col], s13[:, 1 - gate_col]
            # up enters silu(gate) * up linearly: its ratio to the gate's
            # scale goes to FC2's alpha (exactly 1 when they are equal).
            s2 = s2 * (up / gate)
        else:
            gate = s13[:, 0]
        w13 = layer.w13_weight.view(torch.int32).view(e, h // 16, rows // 64 * 128)
        w2 = layer.w2_weight.view(torch.int32).view(e, inter // 16, h // 64 * 128)
        self.packed_weights = W4A16PackedWeights(
            w13=w13,
            w13_scale=layer.w13_weight_scale.view(e, h // 16, rows),
            w13_global_scale=w4a16_global_scale(gate, v["w13"]).contiguous(),
            w2=w2,
            w2_scale=layer.w2_weight_scale.view(e, inter // 16, h),
            w2_global_scale=w4a16_global_scale(s2, v["w2"]).contiguous(),
            hidden_size=h,
            intermediate_size=inter,
            num_experts=e,
            is_gated=moe.is_act_and_mul,
        )
        total = getattr(layer, "global_num_experts", e)
        self.global_num_experts = total
        if total != e:
            first = getattr(layer, "_first_expert", 0)
            emap = torch.full((total,), -1, dtype=torch.int32,
                              device=layer.w13_weight.device)  # fmt: skip
            emap[first : first + e] = torch.arange(e, dtype=torch.int32,
                                                   device=emap.device)  # fmt: skip
            self.expert_map = emap
        else:
            self.expert_map = None

    def _recorded(self, layer, state, steps):
        return recorded_prep_step(self, layer, state, steps)

    def restore_load_layout(self, layer: torch.nn.Module) -> None:
        """Return a prepared (or partly prepared) layer to the layout the
        loader writes, in place and within the cap (a reload): codes and
        scales un-packed (rotation undone: a [w3; w1] layer is [w3; w1]
        again), exactly the loaded bytes except block scales the packing
        flushed, which come back 0 (the kernel read them as 0). Resumable."""
        state = get_prep_state(layer)
        with state.lock:
            self._restore(layer, state)

    def _restore(self, layer: torch.nn.Module, state) -> None:
        if state.status is PrepStatus.LOADING:
            return
        if state.status is PrepStatus.PREPARING:
            self.process_weights_after_loading(layer)
        if state.status is PrepStatus.PREPARED:
            state.begin(PrepStatus.RESTORING)
        cap = self.max_transient_bytes
        v = state.values["w4a16"]
        device = layer.w13_weight.device  # no torch call before a record
        with torch.no_grad(), moe_prep_threads(device):
            for prefix in ("w13", "w2"):
                step = f"unpack.{prefix}"
                if step in state.done:
                    continue
                rotate = v["rotate"] if prefix == "w13" else 0
                unrepack_w4a16_weight_(
                    getattr(layer, f"{prefix}_weight"), rotate=rotate,
                    max_transient_bytes=cap,
                    progress=state.progress_of(f"unrepack.{prefix}"),
                )  # fmt: skip
                unpack_w4a16_blockscale_(
                    getattr(layer, f"{prefix}_weight_scale"), v[prefix],
                    rotate=rotate, max_transient_bytes=cap,
                    progress=state.progress_of(f"unscales.{prefix}"),
                )  # fmt: skip
                state.mark_done(step, device)
        self.packed_weights = None
        state.begin(PrepStatus.LOADING)

    def _check_prepared(self) -> W4A16PackedWeights:
        if self.packed_weights is None:
            raise RuntimeError(
                f"{type(self).__name__}.apply called before "
                "process_weights_after_loading: packed_weights is unset"
            )
        return self.packed_weights

    # -- compute --------------------------------------------------------------
    def apply(self, hidden_states, w1, w2, topk_weights, topk_ids):
        """The kernel on the prepared weights, no copy: ``topk_ids`` are
        GLOBAL expert ids; with expert parallelism the result is this
        rank's partial (experts it does not hold contribute nothing)."""
        pw = self._check_prepared()
        call = flashinfer_w4a16_prepared_call()
        if not call:
            raise RuntimeError(f"W4A16 b12x kernel: {call.reason}")
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch

        prepared = _flashinfer_packed(pw, hidden_states.device)
        out = torch.empty_like(hidden_states, dtype=torch.bfloat16)
        return moe_dispatch.launch_sm120_moe(
            **_launch_kwargs(
                self, pw, prepared, hidden_states, w1, w2, topk_weights, topk_ids, out
            )  # fmt: skip
        )


def _launch_kwargs(experts, pw, prepared, x, w1, w2, topk_weights, topk_ids, out):
    """Keyword arguments of FlashInfer 0.7.4's ``launch_sm120_moe`` that run
    ``prepared`` (no preparation, no copy). ``w1`` / ``w2`` are the layer's
    parameters (their shapes give the sizes)."""
    return dict(
        a=x,
        topk_ids=topk_ids.to(torch.int32),
        topk_weights=topk_weights.float(),
        w1_weight=w1,
        w1_weight_sf=pw.w13_scale,
        w1_alpha=pw.w13_global_scale,
        w2_weight=w2,
        w2_weight_sf=pw.w2_scale,
        w2_alpha=pw.w2_global_scale,
        num_experts=experts.global_num_experts,
        top_k=experts.moe_config.experts_per_token,
        num_local_experts=pw.num_experts,
        scatter_output=out,
        expert_map=experts.expert_map,
        activation=experts.moe_config.activation.flashinfer_name,
        quant_mode="w4a16",
        source_format="modelopt",
        _prepared_weights=prepared,
    )


def _flashinfer_packed(pw: W4A16PackedWeights, device: torch.device):
    """FlashInfer's ``W4A16PackedWeights`` over our views (no copy) plus the
    kernel's small zeroed workspace (int32 [SMs * 4 + 2])."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_w4a16_prepare import (
        W4A16PackedWeights as FlashInferPacked,
    )

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return FlashInferPacked(
        w13=pw.w13, w13_scale=pw.w13_scale, w13_global_scale=pw.w13_global_scale,
        w2=pw.w2, w2_scale=pw.w2_scale, w2_global_scale=pw.w2_global_scale,
        workspace=torch.zeros(sms * 4 + 2, dtype=torch.int32, device=device),
        hidden_size=pw.hidden_size, intermediate_size=pw.intermediate_size,
        num_experts=pw.num_experts, is_gated=pw.is_gated,
        params_dtype=torch.bfloat16, source_format="modelopt",
    )  # fmt: skip


@functools.cache
def flashinfer_w4a16_prepared_call() -> Support:
    """Whether this FlashInfer runs prepared W4A16 weights without a copy:
    0.7.4's ``launch_sm120_moe(..., _prepared_weights=...)`` with its
    ``W4A16PackedWeights``. (FlashInfer #4560's ``B12xMoEWrapper.
    run_prepared`` is not bound: its API is not released.) Falsy, with the
    reason, otherwise: there is no fallback to the copying public path."""
    if importlib.util.find_spec("flashinfer") is None:
        return Support.no("flashinfer-python is not installed")
    try:
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_dispatch
        from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import (
            moe_w4a16_prepare as prep,
        )
    except ImportError as e:
        return Support.no(f"flashinfer has no SM12x W4A16 path ({e})")
    launch = getattr(moe_dispatch, "launch_sm120_moe", None)
    if launch is None or not hasattr(prep, "W4A16PackedWeights"):
        return Support.no("flashinfer has no launch_sm120_moe / W4A16PackedWeights")
    if "_prepared_weights" not in inspect.signature(launch).parameters:
        return Support.no(
            "this flashinfer's launch_sm120_moe takes no _prepared_weights "
            "(needs FlashInfer >= 0.7.4); refusing to run W4A16 through the "
            "copying public path"
        )
    return Support.yes()
