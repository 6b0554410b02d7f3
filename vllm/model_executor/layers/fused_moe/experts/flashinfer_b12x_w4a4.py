# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The b12x W4A4 weight layout: its preparation steps, its inverse and the
tensors the kernel reads, in bounded memory::

    load layout                               b12x W4A4 layout
    w13_weight        [E, 2I, H/2] [w1; w3]   -> [w3; w1]          (in place)
    w13_weight_scale  [E, 2I, H/16] linear    -> reorder, 128x4 swizzle
    w13_weight_scale_2 [E, 2] (w1, w3)        -> s_w1: w1_alpha
    w2_weight_scale   [E, H, I/16] linear     -> 128x4 swizzle
    w2_weight_scale_2 [E]                     -> x s_w3 / s_w1: w2_alpha
    (new) w1_sf_mma / w2_sf_mma               MMA-layout views (no copy)
    (new) fc1 / fc2 input scales [E]          the checkpoint's calibrated ones

0. ``validate``: scales finite and positive (block scales finite), before
   any write;
1. ``fold``: ``"fold"`` mode only: each global scale multiplied into its FP8
   block scales, then set to 1. ``"alpha"`` (default): nothing; the global
   scales are the kernel's alphas (:meth:`B12xW4A4Weights.alphas`);
2. ``reorder`` (gated only): ``reorder_w1w3_to_w3w1`` on the weight and the
   linear scales, before any swizzle (a half swap is only valid on the
   swizzled layout when I is a multiple of 128);
3. ``swizzle``: in place, 128 rows at a time, padding included when the
   scale's storage has room for it (else one new padded tensor);
4. ``finalize``: nothing to write; the layer is PREPARED.

The inverse (:meth:`B12xW4A4Weights.restore_load_layout`), exact from any
step: unswizzle, reorder back to the [w1; w3] the layer was loaded with, the
global scales as loaded (a fold is undone by the next preparation's
``fold``: ``fold_to`` ones). Every step allocates at most
``max_transient_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.weight_prep_guard import get_prep_state
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
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    swizzle_blockscale_bounded,
    unswizzle_blockscale_bounded_,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ALLOCATION_GRANULE,
    allocation_bytes,
)
from vllm.model_executor.layers.quantization.utils.bounded_halves_swap import (
    swap_halves_,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_b12x_w4a4_format import (
    blockscale_mma_layout_view,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_moe_load_layout import (
    has_storage_room,
    record_storage_room,
    w13_rows,
)
from vllm.model_executor.utils import replace_parameter

__all__ = ["B12xW4A4Tensors", "B12xW4A4Weights", "fold_to"]


@dataclass
class B12xW4A4Tensors:
    """What the W4A4 kernel reads besides the weights, made once per
    preparation (views of the layer's scales, tiny [E] float32 tensors).

    Attributes:
        w1_sf_mma, w2_sf_mma: MMA-layout views [32, 4, M/128, 4, K/64, E] of
            the swizzled block scales (the parameters' own storage).
        w1_alpha, w2_alpha: per-expert FC1 / FC2 output multipliers, as the
            kernel takes them (it multiplies ``w1_alpha`` by
            ``fc1_input_scale`` itself; ``w2_alpha`` carries
            ``fc2_input_scale``).
        fc1_input_scale: "alpha" mode: the FC1 input's per-expert scale
            (DEQUANTIZATION direction: ``1 / a1_gscale``, the checkpoint's
            calibrated one; 1 where the quant config has none), the
            kernel's ``input_global_scale``. None in "fold" mode
            (``w1_alpha`` = 1 plays both roles).
        fc2_input_scale: the FC2 input's per-expert scale, the same direction
            (``1 / a2_gscale`` in "alpha" mode; all 1 in "fold" mode).

    """

    w1_sf_mma: torch.Tensor
    w2_sf_mma: torch.Tensor
    w1_alpha: torch.Tensor
    w2_alpha: torch.Tensor
    fc1_input_scale: torch.Tensor | None
    fc2_input_scale: torch.Tensor


class B12xW4A4Weights:
    """The W4A4 layout of one layer's parameters (see module doc).

    ``global_scale_mode`` is called when the steps run: "alpha" or "fold"
    (the experts' effective mode, which may fall back to "fold").
    """

    #: The preparation swizzles the block scales: parameters made with room
    #: for the padded result are swizzled in place.
    swizzles_block_scales = True
    #: The inverse runs from any step: of an interrupted preparation only the
    #: step in flight is finished first.
    restore_completes_preparation = False

    def __init__(
        self,
        moe: FusedMoEConfig,
        max_transient_bytes: int,
        global_scale_mode: Callable[[], str],
        quant_config: FusedMoEQuantConfig | None = None,
    ):
        self.moe_config = moe
        self.max_transient_bytes = max_transient_bytes
        self.global_scale_mode = global_scale_mode
        self.quant_config = quant_config

    def scale_geometry(self, prefix: str) -> tuple[int, int, int]:
        """(E, rows, cols) of the linear ``{prefix}_weight_scale``."""
        moe = self.moe_config
        if prefix == "w13":
            return moe.num_local_experts, w13_rows(moe), moe.hidden_dim // 16
        inter = moe.intermediate_size_per_partition
        return moe.num_local_experts, moe.hidden_dim, inter // 16

    def preparation_steps(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> list[PrepStep]:
        """``validate``, ``fold``, ``reorder``, ``swizzle``, ``finalize``
        (``state``: the layer's ``weight_prep_state``)."""
        cap = self.max_transient_bytes
        moe = self.moe_config
        e = moe.num_local_experts
        first_expert = getattr(layer, "_first_expert", 0)

        @torch.no_grad()
        def validate() -> None:
            # Before any write: bad scales leave the layer as loaded.
            check_global_scales(layer, first_expert, ("weight_scale_2", "input_scale"))
            for name in ("w13_weight_scale", "w2_weight_scale"):
                check_blockscale_values(
                    name,
                    getattr(layer, name),
                    first_expert=first_expert,
                    max_transient_bytes=cap,
                )

        @torch.no_grad()
        def fold() -> None:
            mode = self.global_scale_mode()
            for prefix in ("w13", "w2"):
                name = f"{prefix}_weight_scale"
                loaded = getattr(layer, f"{prefix}_weight_scale_2").reshape(e, -1)
                if mode == "fold":
                    # Each expert's global scale (w1's and w3's own for w13)
                    # into its FP8 block scales; then it is 1.
                    target, after = loaded, 1.0
                elif name in state.folds:
                    target, after = torch.ones_like(loaded), None  # undo a fold
                else:
                    continue  # "alpha": no block scale is rewritten
                fold_to(cap, layer, state, prefix, target, after)

        @torch.no_grad()
        def reorder() -> None:
            # [w1; w3] -> [w3; w1] on the weight and the linear scales.
            if moe.is_act_and_mul and not getattr(layer, "w13_loaded_as_w3w1", False):
                swap_halves_(
                    layer.w13_weight,
                    layer.w13_weight_scale,
                    dim=-2,
                    max_transient_bytes=cap,
                    progress=state.progress_of("reorder"),
                )
            layer.w13_loaded_as_w3w1 = moe.is_act_and_mul

        @torch.no_grad()
        def swizzle() -> None:
            for prefix in ("w13", "w2"):
                name = f"{prefix}_weight_scale"
                scale = getattr(layer, name)
                if tuple(scale.shape) != self.scale_geometry(prefix):
                    continue  # already replaced by its padded swizzled view
                swizzled = swizzle_blockscale_bounded(
                    scale,
                    max_transient_bytes=cap,
                    storage_has_room=has_storage_room(state, name, scale),
                    progress=state.progress_of(f"swizzle.{name}"),
                )
                if swizzled.untyped_storage().data_ptr() != (
                    scale.untyped_storage().data_ptr()
                ):
                    # A new padded result: made for the padded layout.
                    record_storage_room(state, name, swizzled)
                replace_parameter(layer, name, swizzled)

        def finalize() -> None:
            pass

        return [
            ("validate", validate),
            ("fold", fold),
            ("reorder", reorder),
            ("swizzle", swizzle),
            ("finalize", finalize),
        ]

    def restore_load_layout(
        self, layer: torch.nn.Module, state: MoEWeightPrepState
    ) -> None:
        """The exact inverse of the steps done (see module doc), in place and
        within the cap; resumable. The runner has finished the step of an
        interrupted preparation in flight (its cap was accepted)."""
        # Read once: nothing (not even a tensor attribute, a torch call that an
        # interrupt may hit) stands between a step's last write and its record.
        device = layer.w13_weight.device
        if state.status in (PrepStatus.PREPARING, PrepStatus.PREPARED):
            undo = list(state.done)
            state.begin(PrepStatus.RESTORING)
            state.undo = undo
        cap = self.max_transient_bytes
        with torch.no_grad():
            for prefix in ("w13", "w2"):
                name = f"{prefix}_weight_scale"
                step = f"unswizzle.{name}"
                if "swizzle" not in state.undo or step in state.done:
                    continue
                n_e, r, c = self.scale_geometry(prefix)
                linear = unswizzle_blockscale_bounded_(
                    getattr(layer, name),
                    r,
                    c,
                    max_transient_bytes=cap,
                    progress=state.progress_of(step),
                )
                replace_parameter(layer, name, linear)
                state.mark_done(step, device)
            if (
                self.moe_config.is_act_and_mul
                and "unreorder" not in state.done
                and getattr(layer, "w13_loaded_as_w3w1", False) != state.load_w3w1
            ):
                # Back to the [w1; w3] the layer was loaded with: a loader
                # copying checkpoint-layout tensors finds them where it wrote.
                swap_halves_(
                    layer.w13_weight,
                    layer.w13_weight_scale,
                    dim=-2,
                    max_transient_bytes=cap,
                    progress=state.progress_of("unreorder"),
                )
                layer.w13_loaded_as_w3w1 = bool(state.load_w3w1)
                state.mark_done("unreorder", device)
            for name_2, loaded in state.global_scales.items():
                param = getattr(layer, name_2)
                param.copy_(loaded.reshape(param.shape))
        state.global_scales = {}
        state.undo = []
        state.begin(PrepStatus.LOADING)

    def alphas(
        self, layer: torch.nn.Module, fc2_input_scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`alphas_of` with the layer's ``weight_prep_state``."""
        return self.alphas_of(layer, get_prep_state(layer), fc2_input_scale)

    def alphas_of(
        self,
        layer: torch.nn.Module,
        state: MoEWeightPrepState,
        fc2_input_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's per-expert ``(w1_alpha, w2_alpha)``, each [E] float32,
        new tensors (tiny) from the prepared layer's global scales.

        ``w1_alpha = s_gate`` (w1's; the only row group of a non-gated
        layer). FC1 then computes ``up * s_gate / s_up``, and the activation
        is linear in up, so ``w2_alpha = s_w2 * s_up / s_gate``, times
        ``fc2_input_scale`` [E] when given (the kernel multiplies FC2's output
        by ``w2_alpha`` alone). After a fold both weight factors are 1.
        """
        moe = self.moe_config
        e = moe.num_local_experts
        s13 = layer.w13_weight_scale_2.detach().float().reshape(e, -1)  # [E, G]
        s2 = layer.w2_weight_scale_2.detach().float().reshape(e)
        if not moe.is_act_and_mul or s13.shape[1] == 1:
            w1_alpha, w2_alpha = s13[:, 0].contiguous(), s2.contiguous()
        else:
            # The [E, 2] columns stay in the order the layer was loaded in
            # (column g = row group g at load): [w3, w1] when w3 was first.
            up_col = 0 if state.load_w3w1 else 1
            s_up, s_gate = s13[:, up_col], s13[:, 1 - up_col]
            w1_alpha = s_gate.contiguous()
            w2_alpha = s2 * (s_up / s_gate)  # x / x is exactly 1
        if fc2_input_scale is not None:
            w2_alpha = w2_alpha * fc2_input_scale
        return w1_alpha, w2_alpha

    def input_scales(
        self,
        layer: torch.nn.Module,
        quant_config: FusedMoEQuantConfig | None,
        alpha_mode: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(fc1_input_scale, fc2_input_scale)`` for the kernel, [E] float32
        each, DEQUANTIZATION direction (see :class:`B12xW4A4Tensors`): in
        "alpha" mode ``1 / a1_gscale`` and ``1 / a2_gscale`` of the quant
        config (one value or one per expert; all 1 where it has none), in
        "fold" mode ``(None, ones)``.

        Raises:
            ValueError: an activation global scale that is not finite and
                positive, or has neither one nor E entries.

        """
        e = self.moe_config.num_local_experts
        device = layer.w13_weight.device
        ones = torch.ones(e, dtype=torch.float32, device=device)
        if not alpha_mode:
            return None, ones
        scales = []
        for name in ("a1_gscale", "a2_gscale"):
            g = getattr(quant_config, name, None)
            if g is None:
                scales.append(ones.clone())
                continue
            g = g.detach().to(device=device, dtype=torch.float32).reshape(-1)
            if g.numel() not in (1, e) or not (
                torch.isfinite(g).all() and (g > 0).all()
            ):
                raise ValueError(
                    f"the quant config's {name} must hold 1 or {e} finite, "
                    f"positive values (one per local expert), got shape "
                    f"{tuple(g.shape)}"
                )
            scales.append((1.0 / g).expand(e).contiguous())
        return scales[0], scales[1]

    def bind(
        self,
        layer: torch.nn.Module,
        state: MoEWeightPrepState,
        previous: object = None,
    ) -> B12xW4A4Tensors:
        """The kernel's views of a prepared layer (no copy of a weight), with
        the activation scales of ``quant_config`` (see :meth:`input_scales`);
        ``state``: the layer's ``weight_prep_state``. The derived tensors
        (alphas, scales) are copied into ``previous``'s where shapes match
        (``refill_binding``)."""
        moe = self.moe_config
        e, h, rows = moe.num_local_experts, moe.hidden_dim, w13_rows(moe)
        inter = moe.intermediate_size_per_partition
        alpha_mode = self.global_scale_mode() == "alpha"
        fc1_scale, fc2_scale = self.input_scales(layer, self.quant_config, alpha_mode)
        fc2 = fc2_scale if alpha_mode else None
        w1_alpha, w2_alpha = self.alphas_of(layer, state, fc2)
        tensors = B12xW4A4Tensors(
            w1_sf_mma=blockscale_mma_layout_view(layer.w13_weight_scale, rows, h, e),
            w2_sf_mma=blockscale_mma_layout_view(layer.w2_weight_scale, h, inter, e),
            w1_alpha=w1_alpha,
            w2_alpha=w2_alpha,
            fc1_input_scale=fc1_scale,
            fc2_input_scale=fc2_scale,
        )
        return refill_binding(previous, tensors, layer)


def fold_to(
    max_transient_bytes: int,
    layer: torch.nn.Module,
    state: MoEWeightPrepState,
    prefix: str,
    target: torch.Tensor,
    after: float | None,
) -> None:
    """Bring ``{prefix}_weight_scale`` to ``target`` [E, G] folded in (from
    what ``state.folds`` says is folded now: ones undo a fold), then set the
    global scale parameter to ``after`` (kept as loaded in
    ``state.global_scales``; None: left as it is). Resumable: the plan is
    made once per preparation."""
    name, name_2 = f"{prefix}_weight_scale", f"{prefix}_weight_scale_2"
    key = f"fold.{prefix}"
    scale_2 = getattr(layer, name_2)
    plan = state.plans.get(key)
    if plan is None:
        loaded = scale_2.detach().reshape(scale_2.shape[0], -1).clone()
        now = state.folds.get(name)
        factor = target / now if now is not None else target.clone()
        plan = state.plans[key] = (loaded, factor, target.clone())
    loaded, factor, target = plan
    if bool((factor != 1).any()):
        # The plan's [E, G] float32 tensors (and one comparison's result)
        # count against the cap too, each as the CUDA allocator rounds it.
        reserve = 4 * allocation_bytes(factor.numel() * 4) + ALLOCATION_GRANULE
        cap = max(4, max_transient_bytes - reserve)
        fold_global_scale_into_blockscale_(
            getattr(layer, name),
            factor.reshape(scale_2.shape),
            max_transient_bytes=cap,
            progress=state.progress_of(key),
        )
    if bool((target != 1).any()):
        state.folds[name] = target
    else:
        state.folds.pop(name, None)
    if after is not None:
        state.global_scales.setdefault(name_2, loaded)
        value = torch.as_tensor(after, dtype=torch.float32, device=loaded.device)
        scale_2.copy_(value.expand_as(loaded).reshape(scale_2.shape))
