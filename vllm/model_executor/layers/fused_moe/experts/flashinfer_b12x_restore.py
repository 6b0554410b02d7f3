# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Undoing the b12x preparation: the restore of a layer to its load layout
(exact, from any step), the reset of a layer whose bytes cannot be trusted
(torn), and the fold bookkeeping both rely on. Used by
:class:`~vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe.FlashInferB12xExperts`;
see :mod:`~vllm.model_executor.layers.fused_moe.weight_prep_state`."""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    PrepStatus,
    load_layout_data,
    nvfp4_moe_param_specs,
    reload_slots,
)
from vllm.model_executor.layers.fused_moe.weight_prep_steps import (
    replace_parameter,
)
from vllm.model_executor.layers.quantization.utils.blockscale_fold import (
    fold_global_scale_into_blockscale_,
)
from vllm.model_executor.layers.quantization.utils.blockscale_swizzle import (
    unswizzle_blockscale_bounded_,
)
from vllm.model_executor.layers.quantization.utils.bounded_chunks import (
    ALLOCATION_GRANULE,
    allocation_bytes,
    moe_prep_threads,
)
from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
    reorder_w1w3_to_w3w1,
)

__all__ = ["fold_to", "reset_load_layout", "restore_exactly"]


def fold_to(weights, layer, state, prefix: str, target, after) -> None:
    """Bring ``{prefix}_weight_scale`` to ``target`` [E, G] folded in (from
    what ``state.folds`` says is folded now), then set the global scale
    parameter to ``after`` (kept as loaded in ``state.global_scales``).
    Resumable: the plan is made once per preparation."""
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
        cap = max(4, weights.max_transient_bytes - reserve)
        fold_global_scale_into_blockscale_(
            getattr(layer, name), factor.reshape(scale_2.shape),
            max_transient_bytes=cap, progress=state.progress_of(key),
        )  # fmt: skip
    if bool((target != 1).any()):
        state.folds[name] = target
    else:
        state.folds.pop(name, None)
    if after is not None:
        state.global_scales.setdefault(name_2, loaded)
        after = torch.as_tensor(after, dtype=torch.float32, device=loaded.device)
        scale_2.copy_(after.expand_as(loaded).reshape(scale_2.shape))


def restore_exactly(weights, layer: torch.nn.Module, state) -> None:
    """The exact restore of a W4A4 layer (``weights``: its
    ``B12xW4A4Weights``; see ``FlashInferB12xExperts.restore_load_layout``)."""
    # Read once: nothing (not even a tensor attribute, a torch call that an
    # interrupt may hit) stands between a step's last write and its record.
    device = layer.w13_weight.device
    if state.status is PrepStatus.PREPARING:
        for name, step in weights.preparation_steps(layer):
            if name not in state.done:
                if state.started(name):
                    step()  # finish the step in flight (its cap was accepted)
                    state.mark_done(name, device)
                break
    if state.status in (PrepStatus.PREPARING, PrepStatus.PREPARED):
        undo = list(state.done)
        state.begin(PrepStatus.RESTORING)
        state.undo = undo
    cap = weights.max_transient_bytes
    with torch.no_grad(), moe_prep_threads(device):
        for prefix in ("w13", "w2"):
            name = f"{prefix}_weight_scale"
            step = f"unswizzle.{name}"
            if "swizzle" not in state.undo or step in state.done:
                continue
            n_e, r, c = weights.scale_geometry(prefix)
            linear = unswizzle_blockscale_bounded_(
                getattr(layer, name), r, c, max_transient_bytes=cap,
                progress=state.progress_of(step),
            )  # fmt: skip
            replace_parameter(layer, name, linear)
            state.mark_done(step, device)
        if (
            weights.moe_config.is_act_and_mul
            and "unreorder" not in state.done
            and getattr(layer, "w13_loaded_as_w3w1", False) != state.load_w3w1
        ):
            # Back to the [w1; w3] the layer was loaded with: a loader
            # copying checkpoint-layout tensors finds them where it wrote.
            reorder_w1w3_to_w3w1(
                layer.w13_weight, layer.w13_weight_scale, dim=-2,
                max_transient_bytes=cap, progress=state.progress_of("unreorder"),
            )  # fmt: skip
            layer.w13_loaded_as_w3w1 = bool(state.load_w3w1)
            state.mark_done("unreorder", device)
        for name_2, loaded in state.global_scales.items():
            param = getattr(layer, name_2)
            param.copy_(loaded.reshape(param.shape))
    state.global_scales = {}
    state.undo = []
    state.begin(PrepStatus.LOADING)


def reset_load_layout(weights, layer: torch.nn.Module, state, reason: str) -> None:
    """The load layout's shapes and dtypes, whatever the bytes; torn
    (``weights``: the layer's ``B12xW4A4Weights`` or ``B12xW4A16Weights``)."""
    for name, (shape, dtype) in nvfp4_moe_param_specs(weights.moe_config).items():
        param = getattr(layer, name, None)
        if not isinstance(param, torch.Tensor):
            continue  # a method that keeps its input scales elsewhere
        if param.dtype == dtype and tuple(param.shape) == shape:
            continue
        with torch.device(param.device):
            if (
                name.endswith("_weight_scale")
                and weights.swizzles_block_scales
                and param.dtype == dtype
                and state.has_storage_room(name, param)
            ):
                data = torch.empty(0, dtype=dtype).set_(
                    param.untyped_storage(), 0, shape)  # fmt: skip
            else:
                data = load_layout_data(
                    name, shape, dtype, weights.swizzles_block_scales, state
                )
        replace_parameter(layer, name, data)
    if state.load_w3w1 is not None:
        layer.w13_loaded_as_w3w1 = state.load_w3w1
    state.begin(PrepStatus.LOADING)
    state.undo, state.folds, state.global_scales = [], {}, {}
    state.fingerprints, state.checksums = {}, {}
    state.writes_since_prepared = False
    state.loader_writes = set()
    state.mark_torn(reload_slots(weights.moe_config), reason)
