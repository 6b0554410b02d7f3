# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How this tree calls FlashInfer's b12x W4A4 MoE: probe, requirements, wrapper.

FlashInfer 0.7.4 (``requirements/cuda.txt``) is what this was written and
tested against: its host-side code runs in ``tests/kernels/moe/
test_flashinfer_b12x_host.py`` on CPU (see the design page, "What runs
where"). The call goes through ``flashinfer.B12xMoEWrapper``, one per layer,
built on first use::

    B12xMoEWrapper(E, top_k, H, I, quant_mode="nvfp4", activation=...)
    wrapper.run(x, w13, w1_sf_mma, w2, w2_sf_mma, ids, weights,
                w1_alpha=g1_alphas, w2_alpha=g2_alphas,
                fc2_input_scale=ones[E], input_global_scale=ones[E])

Why the wrapper and not the functional ``b12x_fused_moe``: given
``input_global_scale`` without prepared weight views, the functional call
makes a new ``w1_alpha * input_global_scale`` tensor on every call, and its
address is part of the key of FlashInfer's module-level weight cache, whose
entry holds it: one new cache entry per forward, forever. The wrapper folds
once (keyed on the tensors' addresses and versions) and keeps its weight
views: repeated forwards with the same tensors find everything cached.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging

import torch

from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.modular_kernel import Support

__all__ = [
    "B12X_W4A4_HIDDEN_MULTIPLE",
    "FLASHINFER_B12X_MIN_VERSION",
    "b12x_w4a4_config_problems",
    "flashinfer_takes_input_global_scale",
    "make_b12x_wrapper",
    "warn_fold_fallback",
]

logger = logging.getLogger(__name__)

#: The FlashInfer release this call was written against and its host code
#: tested with (``requirements/cuda.txt`` pins it).
FLASHINFER_B12X_MIN_VERSION = "0.7.4"
#: FlashInfer 0.7.4's W4A4 b12x stages whole 128-wide hidden tiles
#: (``_validate_w4a4_dimensions``: no hidden-dimension tails).
B12X_W4A4_HIDDEN_MULTIPLE = 128
#: The intermediate size must be a positive multiple of the NVFP4 block.
B12X_W4A4_INTERMEDIATE_MULTIPLE = 16
#: Activations this tree maps onto the kernel's ``activation`` names.
B12X_ACTIVATIONS = (MoEActivation.SILU, MoEActivation.RELU2_NO_MUL)


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
def warn_fold_fallback(reason: str) -> None:
    """Log, once per process and reason, that ``global_scale_mode="alpha"``
    falls back to ``"fold"`` and why."""
    logger.warning(
        'FlashInfer b12x: global_scale_mode="alpha" falls back to "fold" (global '
        "scales folded into the FP8 block scales, which loses precision at real "
        "weight magnitudes): %s",
        reason,
    )


def b12x_w4a4_config_problems(moe: FusedMoEConfig) -> list[str]:
    """What FlashInfer 0.7.4's W4A4 b12x kernel cannot run in ``moe`` (each
    problem names the requirement); empty when it can."""
    problems = []
    if moe.in_dtype != torch.bfloat16:
        problems.append(
            f"activations must be bfloat16 (the kernel quantizes BF16 input and "
            f"writes BF16 output), got in_dtype={moe.in_dtype}"
        )
    h, i = moe.hidden_dim, moe.intermediate_size_per_partition
    if h <= 0 or h % B12X_W4A4_HIDDEN_MULTIPLE:
        problems.append(
            f"hidden size must be a positive multiple of "
            f"{B12X_W4A4_HIDDEN_MULTIPLE} (no hidden-dimension tails in W4A4), "
            f"got {h}"
        )
    if i <= 0 or i % B12X_W4A4_INTERMEDIATE_MULTIPLE:
        problems.append(
            f"intermediate size per partition must be a positive multiple of "
            f"{B12X_W4A4_INTERMEDIATE_MULTIPLE} (the NVFP4 block), got {i}"
        )
    if moe.activation not in B12X_ACTIVATIONS:
        problems.append(
            f"activation must be one of {[a.value for a in B12X_ACTIVATIONS]}, "
            f"got {moe.activation.value!r}"
        )
    if moe.ep_size > 1:
        problems.append(
            f"no expert parallelism with W4A4 (ep_size={moe.ep_size}): FlashInfer's "
            "b12x takes num_local_experts / expert_map only with quant_mode='w4a16'"
        )
    return problems


def make_b12x_wrapper(
    moe: FusedMoEConfig, device: torch.device, max_num_tokens: int | None
):
    """A ``flashinfer.B12xMoEWrapper`` for one W4A4 layer on ``device``.

    ``max_num_tokens`` None: eager (FlashInfer allocates each call's output
    and refuses CUDA-graph capture). An int: ``use_cuda_graph=True`` with
    workspaces and an output buffer for that many tokens allocated now; the
    returned output is then a view of that buffer, overwritten by the next
    call (capture after one eager warm-up call, as FlashInfer requires).
    """
    from flashinfer import B12xMoEWrapper

    extra = {}
    if max_num_tokens is not None:
        extra = {"use_cuda_graph": True, "max_num_tokens": max_num_tokens}
    return B12xMoEWrapper(
        moe.num_experts,
        moe.experts_per_token,
        moe.hidden_dim,
        moe.intermediate_size_per_partition,
        device=str(device),
        activation=moe.activation.flashinfer_name,
        quant_mode="nvfp4",
        **extra,
    )
