# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How the b12x experts call FlashInfer: gates, probes, requirements, wrapper.

FlashInfer 0.7.4 (``requirements/cuda.txt``) is what this was written and
tested against, its host-side code on CPU included. W4A4 goes through
``flashinfer.B12xMoEWrapper``, one per layer, built on first use::

    wrapper = B12xMoEWrapper(E, top_k, H, I, quant_mode="nvfp4", **options)
    # options: activation=..., use_cuda_graph=True, max_num_tokens=...
    wrapper.run(x, w13, w1_sf_mma, w2, w2_sf_mma, ids, weights, **scales)
    # scales: w1_alpha=..., w2_alpha=..., fc2_input_scale=ones[E],
    #         input_global_scale=ones[E]

Why the wrapper and not the functional ``b12x_fused_moe``: given
``input_global_scale`` without prepared weight views, the functional call
makes a new ``w1_alpha * input_global_scale`` tensor on every call, and its
address is part of the key of FlashInfer's module-level weight cache, whose
entry holds it: one new cache entry per forward, forever. The wrapper folds
once and keeps its weight views. W4A16 runs 0.7.4's
``launch_sm120_moe(..., _prepared_weights=...)`` on the weights prepared in
place (``flashinfer_b12x_w4a16``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.platforms import current_platform
from vllm.utils.flashinfer import has_flashinfer_b12x_moe

__all__ = [
    "B12X_ACTIVATIONS",
    "B12X_W4A4_HIDDEN_MULTIPLE",
    "FLASHINFER_B12X_MIN_VERSION",
    "Support",
    "b12x_config_problems",
    "b12x_layout_problems",
    "flashinfer_takes_input_global_scale",
    "flashinfer_w4a16_prepared_call",
    "is_flashinfer_b12x_moe_available",
    "make_b12x_wrapper",
    "warn_fold_fallback",
]

logger = init_logger(__name__)

#: The FlashInfer release this call was written against and its host code
#: tested with (``requirements/cuda.txt`` pins it).
FLASHINFER_B12X_MIN_VERSION = "0.7.4"
#: FlashInfer 0.7.4's W4A4 b12x stages whole 128-wide hidden tiles
#: (``_validate_w4a4_dimensions``: no hidden-dimension tails).
B12X_W4A4_HIDDEN_MULTIPLE = 128
#: The intermediate size must be a positive multiple of the NVFP4 block.
B12X_INTERMEDIATE_MULTIPLE = 16
#: The W4A16 layout packs rows in 64-row strips (``W4A16PackedWeights``).
B12X_W4A16_ROW_MULTIPLE = 64
#: The activations the kernel runs, by FlashInfer's ``activation`` name.
B12X_ACTIVATIONS: dict[MoEActivation, str] = {
    MoEActivation.SILU: "silu",
    MoEActivation.GELU_TANH: "gelu_tanh",
    MoEActivation.RELU2_NO_MUL: "relu2",
}


@dataclass(frozen=True)
class Support:
    """Answer of a capability predicate: truthy when supported, else a reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls) -> Support:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


@functools.cache
def is_flashinfer_b12x_moe_available() -> Support:
    """The one gate of the b12x kernel: an SM12x GPU, CUDA 13 or newer, and a
    FlashInfer with ``B12xMoEWrapper``. Truthy, or falsy with the reason."""
    if not current_platform.is_cuda():
        return Support.no("needs a CUDA device (none is available)")
    if not current_platform.is_device_capability_family(120):
        return Support.no(
            "needs an SM120/SM121 GPU (compute capability 12.x), found "
            f"{current_platform.get_device_capability()} "
            f"({current_platform.device_name})"
        )
    cuda = torch.version.cuda or "0"
    if int(cuda.split(".")[0]) < 13:
        return Support.no(f"needs CUDA 13 or newer, torch was built with {cuda}")
    if not has_flashinfer_b12x_moe():
        return Support.no(
            "needs flashinfer-python with the b12x MoE "
            f"(>= {FLASHINFER_B12X_MIN_VERSION}: pip install -r requirements/cuda.txt)"
        )
    try:
        from flashinfer import B12xMoEWrapper  # noqa: F401
    except ImportError as e:
        return Support.no(f"flashinfer has no B12xMoEWrapper ({e})")
    return Support.yes()


@functools.cache
def flashinfer_takes_input_global_scale() -> Support:
    """Whether the installed FlashInfer's ``B12xMoEWrapper.run`` takes
    ``input_global_scale`` (0.6.17 on; the 0.6.16.post releases made later
    do not, so the signature is probed, not the version number). Without it
    ``w1_alpha`` is also the FC1 input-quantization scale and the global
    scales must be folded."""
    if importlib.util.find_spec("flashinfer") is None:
        return Support.no("flashinfer-python is not installed")
    try:
        from flashinfer import B12xMoEWrapper
    except ImportError as e:
        return Support.no(f"flashinfer has no B12xMoEWrapper ({e})")
    if "input_global_scale" not in inspect.signature(B12xMoEWrapper.run).parameters:
        return Support.no(
            "this flashinfer's B12xMoEWrapper.run has no input_global_scale "
            f"(flashinfer-python >= {FLASHINFER_B12X_MIN_VERSION} has it)"
        )
    return Support.yes()


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
            f"(needs FlashInfer >= {FLASHINFER_B12X_MIN_VERSION}); refusing to "
            "run W4A16 through the copying public path"
        )
    return Support.yes()


@functools.cache
def warn_fold_fallback(reason: str) -> None:
    """Log, once per process and reason, that ``global_scale_mode="alpha"``
    falls back to ``"fold"`` and why."""
    logger.warning(
        'FlashInfer b12x: global_scale_mode="alpha" falls back to "fold" (global '
        "scales folded into the FP8 block scales, which loses precision at real "
        "weight magnitudes): %s",
        reason,
    )


def b12x_layout_problems(moe: FusedMoEConfig, weight_only: bool) -> list[str]:
    """What the b12x weight layout (W4A4, or W4A16 when ``weight_only``)
    cannot hold in ``moe``, each naming the requirement: the preparation
    needs it, kernel or emulation."""
    problems = []
    h, i = moe.hidden_dim, moe.intermediate_size_per_partition
    if i <= 0 or i % B12X_INTERMEDIATE_MULTIPLE:
        problems.append(
            f"intermediate size per partition must be a positive multiple of "
            f"{B12X_INTERMEDIATE_MULTIPLE} (the NVFP4 block), got {i}"
        )
    if weight_only:
        for what, n in (("hidden size", h), ("w13 rows", moe.w13_num_shards * i)):
            if n <= 0 or n % B12X_W4A16_ROW_MULTIPLE:
                problems.append(
                    f"W4A16: the {what} must be a positive multiple of "
                    f"{B12X_W4A16_ROW_MULTIPLE} (64-row strips), got {n}"
                )
    return problems


def b12x_config_problems(moe: FusedMoEConfig, weight_only: bool) -> list[str]:
    """What FlashInfer 0.7.4's b12x kernel (W4A4, or W4A16 when
    ``weight_only``) cannot run in ``moe``, each naming the requirement;
    empty when it can."""
    problems = []
    if moe.in_dtype != torch.bfloat16:
        problems.append(
            f"activations must be bfloat16 (the kernel takes BF16 input and "
            f"writes BF16 output), got in_dtype={moe.in_dtype}"
        )
    problems += b12x_layout_problems(moe, weight_only)
    if moe.activation not in B12X_ACTIVATIONS:
        problems.append(
            f"activation must be one of {[a.value for a in B12X_ACTIVATIONS]}, "
            f"got {moe.activation.value!r}"
        )
    if weight_only:
        return problems
    h = moe.hidden_dim
    if h <= 0 or h % B12X_W4A4_HIDDEN_MULTIPLE:
        problems.append(
            f"hidden size must be a positive multiple of "
            f"{B12X_W4A4_HIDDEN_MULTIPLE} (no hidden-dimension tails in W4A4), "
            f"got {h}"
        )
    if moe.use_ep or moe.num_local_experts != moe.num_experts:
        problems.append(
            f"no expert parallelism with W4A4 ({moe.num_local_experts} of "
            f"{moe.num_experts} experts on this rank): FlashInfer's b12x takes "
            "num_local_experts / expert_map only with quant_mode='w4a16'"
        )
    return problems


def make_b12x_wrapper(moe: FusedMoEConfig, device: torch.device):
    """A ``flashinfer.B12xMoEWrapper`` for one W4A4 layer on ``device``,
    CUDA-graph capturable: workspaces and an output buffer for
    ``moe.max_num_tokens`` tokens are allocated now; the output of ``run`` is
    a view of that buffer, overwritten by the next call (capture after one
    eager warm-up call, as FlashInfer requires)."""
    from flashinfer import B12xMoEWrapper

    return B12xMoEWrapper(
        num_experts=moe.num_experts,
        top_k=moe.experts_per_token,
        hidden_size=moe.hidden_dim,
        intermediate_size=moe.intermediate_size_per_partition,
        use_cuda_graph=True,
        max_num_tokens=moe.max_num_tokens,
        num_local_experts=moe.num_local_experts,
        activation=B12X_ACTIVATIONS[moe.activation],
        quant_mode="nvfp4",
        device=str(device),
    )
