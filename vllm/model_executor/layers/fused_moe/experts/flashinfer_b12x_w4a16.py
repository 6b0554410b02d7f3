# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The b12x W4A16 weight layout (NVFP4 weights, BF16 activations): its
preparation steps, its inverse, and the call of FlashInfer 0.7.4's kernel on
it. The preparation rewrites a loaded NVFP4 layer into FlashInfer's W4A16
runtime layout (``W4A16PackedWeights``) in the parameters' own storage, every
step within ``max_transient_bytes``::

    load layout                                W4A16 layout (same storage)
    w13_weight       uint8 [E, N, H/2]    -> int32 [E, H/16, N/64*128]
                     ([w3; w1] rows are rotated by I into [w1; w3])
    w13_weight_scale fp8 [E, N, H/16]     -> fp8 [E, H/16, N], x 2^x13, flush
    w13_weight_scale_2 [E, 2] or [E, 1]   -> w13_global_scale [E] (new, tiny)
    w2_weight        uint8 [E, H, I/2]    -> int32 [E, I/16, H/64*128]
    w2_weight_scale  fp8 [E, H, I/16]     -> fp8 [E, I/16, H], x 2^x2, flush
    w2_weight_scale_2 [E]                 -> w2_global_scale [E] (new, tiny)
    input scales                          ignored (activations stay BF16)

Steps: ``validate`` (before any write), ``halves`` (only when a [w3; w1]
w13 has I % 64 != 0: the half swap, since the rotation works on 64-row
strips), ``exponents`` (the power-of-two factors of both block scales,
recorded in the layer's prep state before the scales change), ``w13``,
``w2`` (codes and scales, resumable chunk by chunk) and ``finalize``.

Gate and up share one FC1 alpha. An expert whose w1 and w3 global scales
differ keeps s_gate as alpha1 and carries s_up / s_gate in alpha2 (up enters
the activation linearly), so no block scale is rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_call import (
    B12X_ACTIVATIONS,
)
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)
from vllm.model_executor.layers.fused_moe.weight_prep_steps import (
    PrepStep,
    refill_binding,
)
from vllm.model_executor.layers.quantization.utils.blockscale_checks import (
    check_blockscale_values,
    check_global_scales,
)
from vllm.model_executor.layers.quantization.utils.bounded_halves_swap import (
    swap_halves_,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_layout import (
    W4A16_TILE_N,
    w4a16_global_scale,
    w4a16_scale_exponent,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_w4a16_moe import (
    pack_w4a16_blockscale_,
    repack_w4a16_weight_,
    unpack_w4a16_blockscale_,
    unrepack_w4a16_weight_,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    w13_rows,
)
from vllm.utils.platform_utils import num_compute_units

__all__ = ["B12xW4A16Weights", "W4A16PackedWeights", "w4a16_launch_kwargs"]


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


class B12xW4A16Weights:
    """The W4A16 layout of one layer's parameters (see module doc)."""

    #: The block scales are rewritten in their own storage, never padded.
    swizzles_block_scales = False
    #: The inverse unpacks whole parameters: an interrupted preparation is
    #: completed first.
    restore_completes_preparation = True

    def __init__(self, moe: FusedMoEConfig, max_transient_bytes: int):
        self.moe_config = moe
        self.max_transient_bytes = max_transient_bytes

    def _rotate(self, layer: torch.nn.Module) -> int:
        """Rows the w13 rotation moves: I for a [w3; w1] gated weight."""
        moe = self.moe_config
        if moe.is_act_and_mul and getattr(layer, "w13_loaded_as_w3w1", False):
            return moe.intermediate_size_per_partition
        return 0

    def preparation_steps(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> list[PrepStep]:
        """``validate``, ``halves``, ``exponents``, ``w13``, ``w2``,
        ``finalize`` (see module doc; ``state``: the layer's
        ``weight_prep_state``)."""
        cap = self.max_transient_bytes
        first_expert = getattr(layer, "_first_expert", 0)

        @torch.no_grad()
        def validate() -> None:
            check_global_scales(layer, first_expert)
            for name in ("w13_weight_scale", "w2_weight_scale"):
                check_blockscale_values(
                    name,
                    getattr(layer, name),
                    first_expert=first_expert,
                    max_transient_bytes=cap,
                )

        @torch.no_grad()
        def halves() -> None:
            rotate = self._rotate(layer)
            if rotate % W4A16_TILE_N == 0:
                return
            # [w3; w1] -> [w1; w3] by the half swap; the loader then writes
            # w1 first, and the [E, 2] global scales follow their rows.
            swap_halves_(
                layer.w13_weight,
                layer.w13_weight_scale,
                dim=-2,
                max_transient_bytes=cap,
                progress=state.progress_of("halves"),
            )
            s2 = layer.w13_weight_scale_2
            if s2.dim() == 2 and s2.shape[1] == 2:
                s2.copy_(s2.flip(1))
            layer.w13_loaded_as_w3w1 = False

        @torch.no_grad()
        def exponents() -> None:
            state.values["w4a16"] = {
                "rotate": self._rotate(layer),
                "w13": w4a16_scale_exponent(layer.w13_weight_scale),
                "w2": w4a16_scale_exponent(layer.w2_weight_scale),
            }

        def repack(prefix: str) -> PrepStep:
            @torch.no_grad()
            def step() -> None:
                v = state.values["w4a16"]
                rotate = v["rotate"] if prefix == "w13" else 0
                repack_w4a16_weight_(
                    getattr(layer, f"{prefix}_weight"),
                    rotate=rotate,
                    max_transient_bytes=cap,
                    progress=state.progress_of(f"repack.{prefix}"),
                )
                pack_w4a16_blockscale_(
                    getattr(layer, f"{prefix}_weight_scale"),
                    v[prefix],
                    rotate=rotate,
                    max_transient_bytes=cap,
                    progress=state.progress_of(f"scales.{prefix}"),
                )

            return prefix, step

        def finalize() -> None:
            pass

        return [
            ("validate", validate),
            ("halves", halves),
            ("exponents", exponents),
            repack("w13"),
            repack("w2"),
            ("finalize", finalize),
        ]

    def bind(
        self,
        layer: torch.nn.Module,
        state: MoEWeightPrepState,
        previous: object = None,
    ) -> W4A16PackedWeights:
        """The kernel's views of a prepared layer (no copy of a weight) and
        its per-expert global scales ([E] float32, copied into
        ``previous``'s where shapes match: ``refill_binding``); ``state``:
        the layer's ``weight_prep_state``."""
        moe = self.moe_config
        v = state.values["w4a16"]
        e, h = moe.num_local_experts, moe.hidden_dim
        inter, rows = moe.intermediate_size_per_partition, w13_rows(moe)
        s13 = layer.w13_weight_scale_2.detach().float().reshape(e, -1)  # [E, G]
        s2 = layer.w2_weight_scale_2.detach().float().reshape(e)
        if moe.is_act_and_mul and s13.shape[1] == 2:
            gate_col = 1 if v["rotate"] else 0  # [w3; w1]: w1 is the 2nd half
            gate, up = s13[:, gate_col], s13[:, 1 - gate_col]
            # up enters the activation linearly: its ratio to the gate's
            # scale goes to FC2's alpha (exactly 1 when they are equal).
            s2 = s2 * (up / gate)
        else:
            gate = s13[:, 0]
        w13 = layer.w13_weight.view(torch.int32).view(e, h // 16, rows // 64 * 128)
        w2 = layer.w2_weight.view(torch.int32).view(e, inter // 16, h // 64 * 128)
        packed = W4A16PackedWeights(
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
        return refill_binding(previous, packed, layer)

    def restore_load_layout(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> None:
        """Return a prepared layer to the layout the loader writes, in place
        and within the cap (a reload): codes and scales un-packed (rotation
        undone: a [w3; w1] layer is [w3; w1] again), exactly the loaded bytes
        except block scales the packing flushed, which come back 0 (the
        kernel read them as 0). The runner has completed an interrupted
        preparation (:attr:`restore_completes_preparation`). Resumable."""
        with state.lock:
            if state.status is PrepStatus.LOADING:
                return
            if state.status is PrepStatus.PREPARED:
                state.begin(PrepStatus.RESTORING)
            cap = self.max_transient_bytes
            v = state.values["w4a16"]
            device = layer.w13_weight.device  # no torch call before a record
            with torch.no_grad():
                for prefix in ("w13", "w2"):
                    step = f"unpack.{prefix}"
                    if step in state.done:
                        continue
                    rotate = v["rotate"] if prefix == "w13" else 0
                    unrepack_w4a16_weight_(
                        getattr(layer, f"{prefix}_weight"),
                        rotate=rotate,
                        max_transient_bytes=cap,
                        progress=state.progress_of(f"unrepack.{prefix}"),
                    )
                    unpack_w4a16_blockscale_(
                        getattr(layer, f"{prefix}_weight_scale"),
                        v[prefix],
                        rotate=rotate,
                        max_transient_bytes=cap,
                        progress=state.progress_of(f"unscales.{prefix}"),
                    )
                    state.mark_done(step, device)
            state.begin(PrepStatus.LOADING)


def w4a16_launch_kwargs(
    moe: FusedMoEConfig,
    pw: W4A16PackedWeights,
    prepared,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    out: torch.Tensor,
) -> dict:
    """Keyword arguments of FlashInfer 0.7.4's ``launch_sm120_moe`` that run
    ``prepared`` (FlashInfer's ``W4A16PackedWeights`` over ``pw``: no
    preparation, no copy). ``w1`` / ``w2`` are the layer's parameters (their
    shapes give the sizes); ``topk_ids`` are global expert ids, mapped to
    local ones by ``expert_map`` (-1: another rank's expert)."""
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
        num_experts=moe.num_experts,
        top_k=moe.experts_per_token,
        num_local_experts=pw.num_experts,
        scatter_output=out,
        expert_map=None if expert_map is None else expert_map.to(torch.int32),
        activation=B12X_ACTIVATIONS[moe.activation],
        quant_mode="w4a16",
        source_format="modelopt",
        _prepared_weights=prepared,
    )


def flashinfer_packed_weights(pw: W4A16PackedWeights, device: torch.device):
    """FlashInfer's ``W4A16PackedWeights`` over ``pw``'s views (no copy) plus
    the kernel's small zeroed workspace (int32 [SMs * 4 + 2])."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x.moe_w4a16_prepare import (
        W4A16PackedWeights as FlashInferPacked,
    )

    sms = num_compute_units(device.index)
    return FlashInferPacked(
        w13=pw.w13,
        w13_scale=pw.w13_scale,
        w13_global_scale=pw.w13_global_scale,
        w2=pw.w2,
        w2_scale=pw.w2_scale,
        w2_global_scale=pw.w2_global_scale,
        workspace=torch.zeros(sms * 4 + 2, dtype=torch.int32, device=device),
        hidden_size=pw.hidden_size,
        intermediate_size=pw.intermediate_size,
        num_experts=pw.num_experts,
        is_gated=pw.is_gated,
        params_dtype=torch.bfloat16,
        source_format="modelopt",
    )
