# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What every b12x weight layout's preparation shares: the parameters the
experts read, the checks before the first write, and the runner that records
each step in the layer's :class:`~vllm.model_executor.layers.fused_moe.
weight_prep_state.MoEWeightPrepState`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.weight_prep_state import (
    MoEWeightPrepState,
    PrepStatus,
)

__all__ = [
    "PrepStep",
    "check_global_scales",
    "check_load_layout",
    "expert_param_specs",
    "load_layout_ok",
    "replace_parameter",
    "run_recorded_steps",
    "w13_rows",
]

#: A named preparation step.
PrepStep = tuple[str, Callable[[], None]]


def w13_rows(moe: FusedMoEConfig) -> int:
    """Rows of one expert's fused FC1 weight: 2I gated, I otherwise."""
    return moe.w13_num_shards * moe.intermediate_size_per_partition


def expert_param_specs(
    moe: FusedMoEConfig,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the parameters the b12x experts read and
    rewrite, in the load layout (this rank's experts; rows = 2I gated, I
    otherwise). ``w13_weight_scale_2`` holds one global scale per shard
    ([E, 2] gated: w1's and w3's in load order); input scales are not
    listed: the kernel quantizes its input itself."""
    e, h = moe.num_local_experts, moe.hidden_dim
    i, rows = moe.intermediate_size_per_partition, w13_rows(moe)
    return {
        "w13_weight": ((e, rows, h // 2), torch.uint8),
        "w13_weight_scale": ((e, rows, h // 16), torch.float8_e4m3fn),
        "w13_weight_scale_2": ((e, moe.w13_num_shards), torch.float32),
        "w2_weight": ((e, h, i // 2), torch.uint8),
        "w2_weight_scale": ((e, h, i // 16), torch.float8_e4m3fn),
        "w2_weight_scale_2": ((e,), torch.float32),
    }


def _layout_problems(layer: torch.nn.Module, moe: FusedMoEConfig) -> list[str]:
    problems = []
    for name, (shape, dtype) in expert_param_specs(moe).items():
        t = getattr(layer, name, None)
        if t is None:
            problems.append(f"{name} is missing")
        elif t.dtype != dtype or tuple(t.shape) != shape:
            problems.append(
                f"{name} is {t.dtype} {tuple(t.shape)}, expected {dtype} {shape}"
            )
    return problems


def load_layout_ok(layer: torch.nn.Module, moe: FusedMoEConfig) -> bool:
    """Whether every parameter the experts read has its load-layout shape
    and dtype."""
    return not _layout_problems(layer, moe)


def check_load_layout(layer: torch.nn.Module, moe: FusedMoEConfig) -> None:
    """ValueError naming each parameter whose shape or dtype is not the load
    layout's (e.g. replaced, or converted by ``layer.to(dtype)``)."""
    problems = _layout_problems(layer, moe)
    if problems:
        raise ValueError(
            f"cannot prepare the MoE layer: {'; '.join(problems)}. Load the "
            "weights again through the layer's weight_loader, which restores "
            "the load layout"
        )


def replace_parameter(layer: torch.nn.Module, name: str, value: torch.Tensor):
    """Make ``value`` (e.g. a padded view of the same storage) the data of the
    parameter ``name``. The Parameter object stays the same, so references
    taken before (a loader's ``dict(named_parameters())``, a quant config's
    scale) stay valid."""
    param = getattr(layer, name)
    if value is not param:
        param.data = value


def check_global_scales(
    layer: torch.nn.Module,
    first_expert: int,
    suffixes: tuple[str, ...] = ("weight_scale_2",),
) -> None:
    """ValueError naming the parameter, expert and shard of a global scale
    (``{w13,w2}_{suffix}`` for each of ``suffixes``) that is not finite and
    positive (scales set in memory, not loaded)."""
    first = "w3" if getattr(layer, "w13_loaded_as_w3w1", False) else "w1"
    shards = {"w13": (first, "w1" if first == "w3" else "w3"), "w2": ("w2",)}
    for prefix in ("w13", "w2"):
        for suffix in suffixes:
            name = f"{prefix}_{suffix}"
            t = getattr(layer, name, None)
            if t is None:
                continue
            values = t.detach().float().reshape(t.shape[0], -1)  # [E, G], tiny
            bad = ~(torch.isfinite(values) & (values > 0))
            if bool(bad.any()):
                e, g = (int(i) for i in bad.nonzero()[0])
                shard = shards[prefix][g] if values.shape[1] > 1 else prefix
                raise ValueError(
                    f"{name} of expert {first_expert + e} ({shard}) is "
                    f"{values[e, g].item()}: global and input scales must be "
                    "finite and positive"
                )


def run_recorded_steps(
    layer: torch.nn.Module,
    state: MoEWeightPrepState,
    moe: FusedMoEConfig,
    steps: list[PrepStep],
    restore: Callable[[], None],
    through: str | None = None,
) -> None:
    """Run ``steps`` on ``layer`` in order, each at most once per
    preparation: a step recorded done is skipped, so a call after an
    exception resumes where the last one stopped. ``through``: stop after
    that step (a benchmark times the steps one by one this way); None: run
    them all. The first step validates:
    it runs while the layer is still LOADING, so a ValueError leaves it
    loadable and untouched. Each step is recorded once the device finished
    it (``state.mark_done``); the last one marks the layer PREPARED. A
    PREPARED layer is only checked (``check_unchanged``); a RESTORING one is
    first brought back to the load layout (``restore``). Holds the layer's
    lock."""
    if through is not None and through not in [name for name, _ in steps]:
        raise ValueError(
            f"unknown preparation step {through!r}; the steps are "
            f"{[name for name, _ in steps]}"
        )
    # Read once: no torch call (a tensor attribute is one) between a step's
    # last write and its record, where an interrupt could land.
    device = layer.w13_weight.device
    with state.lock:
        if state.status is PrepStatus.PREPARED:
            state.check_unchanged(layer)
            return
        if state.loader_writes and state.status is PrepStatus.PREPARING:
            # Resuming would run the remaining steps on a mix of layouts.
            state.check_unchanged(layer)
        if state.status is PrepStatus.RESTORING:
            restore()
        if state.status is PrepStatus.LOADING:
            state.check_not_torn()
            check_load_layout(layer, moe)
            name, validate = steps[0]
            validate()
            state.load_w3w1 = bool(getattr(layer, "w13_loaded_as_w3w1", False))
            state.mark_done(name, device, begin=PrepStatus.PREPARING)
        names = [name for name, _ in steps]
        last = names.index(through) if through is not None else len(steps) - 1
        for name, fn in steps[: last + 1]:
            if name not in state.done:
                fn()
                state.mark_done(name, device)
        if last < len(steps) - 1:
            return
        state.status = PrepStatus.PREPARED
        state.plans = {}
        state.writes_since_prepared = False
        state.record_prepared(layer)
