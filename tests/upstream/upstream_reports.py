# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a FLASHINFER_B12X preparation left in one of upstream's NVFP4 MoE
layers (built by upstream_layers.py), against the checkpoint it was loaded
from: bytes, effective scales, the kernel's alphas, the function the
prepared bytes encode (BF16 reference, the fork's emulated experts), and
the reports a snippet returns as JSON. Works against whichever vllm the
interpreter imports (the installed fork, or the unmodified release in a
subprocess)."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
from typing import Any

import torch

from cpu_stand_ins import b12x_preparation_on_cpu
from upstream_env import load_slice_module
from upstream_layers import (
    MOE_SHAPES,
    MoEShape,
    SyntheticNvfp4Experts,
    one_rank_vllm,
    prepare_layer,
)

__all__ = [
    "checkpoint_dequantized_experts",
    "checkpoint_global_scales",
    "emulated_apply",
    "experts_apply",
    "function_errors",
    "moe_inputs",
    "prep_reports_on_cpu",
    "prepare_and_report",
    "prepared_b12x_report",
    "prepared_dequantized_experts",
    "prepared_function_errors",
    "prepared_kernel_alphas",
    "reference_moe",
    "rel_rms",
]

_NVFP4_FORMAT = "vllm/model_executor/layers/quantization/utils/nvfp4_format.py"
_MOE_REFERENCE = "tests/kernels/moe/moe_reference.py"


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[1] // 2
    return torch.cat([t[:, half:], t[:, :half]], dim=1)


def _max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs() / expected).max().item()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


def _per_row_alphas(alpha: torch.Tensor, i: int) -> torch.Tensor:
    """The w13 global scale of every prepared row, [E, 2I, 1]: an [E] alpha
    for all rows, or [E, 2] per shard in load order (w1, w3) for rows in the
    prepared order [w3; w1]."""
    a = alpha.detach().float()
    if a.dim() == 1:
        return a.reshape(-1, 1, 1).expand(-1, 2 * i, 1)
    return a[:, [1, 0]].repeat_interleave(i, dim=1).unsqueeze(-1)


def checkpoint_global_scales(
    experts: SyntheticNvfp4Experts, checkpoint_format: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2], w2 [E]) global scales in the dequantization direction as
    vLLM reads them from that format's parameters (compressed-tensors: the
    inverse of the stored inverse, computed in float32 as the methods do)."""
    if checkpoint_format == "compressed-tensors":
        return 1.0 / (1.0 / experts.w13_scale_2), 1.0 / (1.0 / experts.w2_scale_2)
    return experts.w13_scale_2, experts.w2_scale_2


def prepared_kernel_alphas(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_alpha, w2_alpha), each [E] float32: the weights' factors in what
    the b12x kernel multiplies FC1's and FC2's outputs by. The fork's experts
    bind the kernel's (``experts.prepared``, whose ``w2_alpha`` also carries
    FC2's input scale, the activation's) from these
    (``experts.weights.alphas``); unmodified 0.33.0 passes the quant config's
    ``g1_alphas`` / ``g2_alphas`` (all 1 after its fold)."""
    method = layer.quant_method
    fused = method.moe_kernel.fused_experts
    if getattr(fused, "prepared", None) is not None:
        return fused.weights.alphas(layer)
    quant = method.moe_quant_config
    return quant.g1_alphas.reshape(-1), quant.g2_alphas.reshape(-1)


def prepared_dequantized_experts(
    layer: torch.nn.Module, shape: MoEShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights the prepared layer makes the b12x W4A4 kernel compute
    with, decoded from its bytes as the kernel reads them: (w13 float32
    [E, 2I, H] in [gate; up] order, w2 float32 [E, H, I]). E2M1 codes x
    the 128x4 block scales (unswizzled) x the kernel's per-expert alphas
    (:func:`prepared_kernel_alphas`: one for both halves of w13)."""
    nvfp4 = load_slice_module(_NVFP4_FORMAT)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    a1, a2 = (
        a.detach().float().reshape(e, 1, 1) for a in prepared_kernel_alphas(layer)
    )
    s13 = nvfp4.unswizzle_blockscale(layer.w13_weight_scale.data, 2 * i, h // 16)
    s2 = nvfp4.unswizzle_blockscale(layer.w2_weight_scale.data, h, i // 16)
    w13 = nvfp4.dequantize_nvfp4(layer.w13_weight.data, s13, 1.0) * a1
    w2 = nvfp4.dequantize_nvfp4(layer.w2_weight.data, s2, 1.0) * a2
    return _swap_halves(w13), w2  # [w3; w1] -> [w1; w3]


def checkpoint_dequantized_experts(
    experts: SyntheticNvfp4Experts,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's weights, float32: (w13 [E, 2I, H] [gate; up], each
    half times its own global scale; w2 [E, H, I])."""
    nvfp4 = load_slice_module(_NVFP4_FORMAT)
    i = experts.w13.shape[1] // 2
    rows = experts.w13_scale_2.repeat_interleave(i, dim=1).unsqueeze(-1)  # [E, 2I, 1]
    w13 = nvfp4.dequantize_nvfp4(experts.w13, experts.w13_scale, 1.0) * rows
    w2 = nvfp4.dequantize_nvfp4(experts.w2, experts.w2_scale, 1.0)
    return w13, w2 * experts.w2_scale_2.reshape(-1, 1, 1)


def prepared_b12x_report(
    layer: torch.nn.Module,
    experts: SyntheticNvfp4Experts,
    checkpoint_format: str = "modelopt",
) -> dict[str, Any]:
    """What a FLASHINFER_B12X preparation left in ``layer``, compared with
    the checkpoint ``experts`` it was loaded from; JSON-able. Works for the
    fork (alpha or fold mode) and for unmodified 0.33.0 (fold, [E] alphas).

    * ``method``, ``backend``, ``experts_class``: the quant method's class,
      its ``nvfp4_backend`` name, the modular kernel's experts class;
      ``global_scale_mode``: the experts' (None in unmodified 0.33.0).
    * ``w13_codes``: ``"w3_w1"`` if the FP4 bytes are [up; gate] exactly,
      ``"w1_w3"`` if still [gate; up], else ``"other"``;
      ``w2_codes_unchanged``.
    * ``w13_scale_bytes``, ``w2_scale_bytes``: ``"checkpoint"`` if the
      layer's block scales, unswizzled from the 128x4 layout, are the
      checkpoint's FP8 bytes exactly (w13 in [w3; w1] order), else
      ``"rewritten"`` (a fold re-rounds them).
    * ``w13_scale_rel_err``, ``w2_scale_rel_err``: the largest relative
      error of the effective per-block weight scale (the layer's block scale
      unswizzled, times the quant config's ``g1_alphas`` / ``g2_alphas``:
      [E], or [E, 2] per shard) against the checkpoint's (block scale x
      global scale; w13 in [w3; w1] order).
    * negative controls, errors the same measure gives for wrong answers:
      ``w13_scale_rel_err_gate_up_swapped`` (the layer against [w1; w3]),
      ``w13_scale_rel_err_no_global_scale`` (the checkpoint's block scales
      alone, as if the global scale were dropped).
    * ``g1_alphas``, ``g2_alphas``: the quant config's values (flattened);
      ``global_scales_as_loaded``: they are the checkpoint's global scales
      ([E, 2] and [E], dequantization direction) exactly.
    * ``w1_alpha``, ``w2_alpha``: the kernel's (:func:`prepared_kernel_alphas`);
      ``kernel_alphas_exact``: w1_alpha = s_gate and w2_alpha = s_w2 * s_up /
      s_gate, computed in float32, exactly.
    * ``fc2_input_scale`` (the kernel's, dequantization direction),
      ``w2_input_scale`` (the checkpoint's), ``w2_alpha_carries_fc2_input_scale``
      (the kernel's w2_alpha is the weights' times it, exactly; None without
      the fork's experts), ``w1_sf_mma_shape``, ``w2_sf_mma_shape``,
      ``sf_mma_views_alias_layer_scales`` (the experts' MMA-layout views
      share storage with the layer's block scales).
    * ``digests``: sha256 of the bytes of the weights and block scales.
    * ``parameters``: name -> [shape, dtype] after preparation.
    """
    nvfp4 = load_slice_module(_NVFP4_FORMAT)
    method = layer.quant_method
    fused = method.moe_kernel.fused_experts
    quant = method.moe_quant_config
    e, two_i, h_half = experts.w13.shape
    h = 2 * h_half
    i = two_i // 2

    w13 = layer.w13_weight.data
    if torch.equal(w13, _swap_halves(experts.w13)):
        w13_codes = "w3_w1"
    elif torch.equal(w13, experts.w13):
        w13_codes = "w1_w3"
    else:
        w13_codes = "other"

    lin13 = nvfp4.unswizzle_blockscale(layer.w13_weight_scale.data, two_i, h // 16)
    lin2 = nvfp4.unswizzle_blockscale(layer.w2_weight_scale.data, h, i // 16)

    def same_bytes(a: torch.Tensor, b: torch.Tensor) -> str:
        return (
            "checkpoint"
            if torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            else "rewritten"
        )

    # The checkpoint's effective scales, in the order the kernel wants.
    ckpt13 = experts.w13_scale.float() * experts.w13_scale_2.repeat_interleave(
        i, dim=1
    ).unsqueeze(-1)
    ckpt2 = experts.w2_scale.float() * experts.w2_scale_2.reshape(-1, 1, 1)
    eff13 = lin13.float() * _per_row_alphas(quant.g1_alphas, i)
    eff2 = lin2.float() * quant.g2_alphas.detach().float().reshape(-1, 1, 1)

    g13, g2 = checkpoint_global_scales(experts, checkpoint_format)
    a1, a2 = prepared_kernel_alphas(layer)
    s_gate, s_up = g13[:, 0], g13[:, 1]
    alphas_exact = torch.equal(a1.float(), s_gate) and torch.equal(
        a2.float(), g2 * (s_up / s_gate)
    )
    g1_vals = quant.g1_alphas.detach().float()
    as_loaded = (
        tuple(g1_vals.shape) == tuple(g13.shape)
        and torch.equal(g1_vals, g13)
        and torch.equal(quant.g2_alphas.detach().float().reshape(-1), g2)
    )

    def storage(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.untyped_storage().data_ptr()

    w1_mma = getattr(fused, "w1_sf_mma", None)
    w2_mma = getattr(fused, "w2_sf_mma", None)
    fc2 = getattr(fused, "_fc2_input_scale", None)
    prepared = getattr(fused, "prepared", None)
    carries = None
    if prepared is not None and fc2 is not None:
        carries = torch.equal(prepared.w2_alpha, a2 * fc2)
    return {
        "method": type(method).__name__,
        "backend": method.nvfp4_backend.name,
        "experts_class": type(fused).__name__,
        "global_scale_mode": getattr(fused, "global_scale_mode", None),
        "w13_codes": w13_codes,
        "w2_codes_unchanged": torch.equal(layer.w2_weight.data, experts.w2),
        "w13_scale_bytes": same_bytes(lin13, _swap_halves(experts.w13_scale)),
        "w2_scale_bytes": same_bytes(lin2, experts.w2_scale),
        "w13_scale_rel_err": _max_rel_err(eff13, _swap_halves(ckpt13)),
        "w2_scale_rel_err": _max_rel_err(eff2, ckpt2),
        "w13_scale_rel_err_gate_up_swapped": _max_rel_err(eff13, ckpt13),
        "w13_scale_rel_err_no_global_scale": _max_rel_err(
            experts.w13_scale.float(), ckpt13
        ),
        "g1_alphas": g1_vals.reshape(-1).tolist(),
        "g2_alphas": quant.g2_alphas.detach().float().reshape(-1).tolist(),
        "global_scales_as_loaded": as_loaded,
        "w1_alpha": a1.detach().float().tolist(),
        "w2_alpha": a2.detach().float().tolist(),
        "kernel_alphas_exact": alphas_exact,
        "fc2_input_scale": None if fc2 is None else fc2.float().tolist(),
        "w2_input_scale": experts.w2_input_scale.float().tolist(),
        "w2_alpha_carries_fc2_input_scale": carries,
        "w1_sf_mma_shape": None if w1_mma is None else list(w1_mma.shape),
        "w2_sf_mma_shape": None if w2_mma is None else list(w2_mma.shape),
        "sf_mma_views_alias_layer_scales": (
            storage(w1_mma) == storage(layer.w13_weight_scale.data)
            and storage(w2_mma) == storage(layer.w2_weight_scale.data)
        ),
        "digests": {
            name: _digest(getattr(layer, name).data)
            for name in (
                "w13_weight",
                "w13_weight_scale",
                "w2_weight",
                "w2_weight_scale",
            )
        },
        "parameters": {
            name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
            for name, p in layer.named_parameters()
        },
        "num_experts": e,
    }


def moe_inputs(
    shape: MoEShape, tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states bfloat16 [T, H], top-k weights float32 [T, K], top-k
    ids int32 [T, K]): random activations and softmax routing, renormalized
    (``tests/kernels/moe/moe_reference.torch_topk``)."""
    ref = load_slice_module(_MOE_REFERENCE)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, shape.hidden_size, generator=gen).bfloat16()
    logits = torch.randn(tokens, shape.num_experts, generator=gen)
    weights, ids = ref.torch_topk(logits, shape.top_k, renormalize=True)
    return x, weights, ids


def reference_moe(
    w13: torch.Tensor,
    w2: torch.Tensor,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """The BF16 reference MoE
    (``tests/kernels/moe/moe_reference.torch_experts``) on weights ``w13``
    [E, 2I, H] ([gate; up]) and ``w2`` [E, H, I], cast to bfloat16 first."""
    ref = load_slice_module(_MOE_REFERENCE)
    return ref.torch_experts(
        x, w13.bfloat16(), w2.bfloat16(), topk_weights, topk_ids, activation
    )


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in float32."""
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def prepared_function_errors(
    layer: torch.nn.Module,
    experts: SyntheticNvfp4Experts,
    shape: MoEShape,
    tokens: int = 64,
    seed: int = 1,
) -> dict[str, float]:
    """The MoE function the prepared bytes encode, against the checkpoint's:
    the BF16 reference on :func:`prepared_dequantized_experts` vs on
    :func:`checkpoint_dequantized_experts`, relative RMS (``rel_rms``), and
    the negative control ``rel_rms_gate_up_swapped`` (the checkpoint's gate
    and up halves exchanged in the reference)."""
    x, weights, ids = moe_inputs(shape, tokens, seed)
    ref13, ref2 = checkpoint_dequantized_experts(experts)
    got13, got2 = prepared_dequantized_experts(layer, shape)
    ref = reference_moe(ref13, ref2, x, weights, ids)
    return {
        "rel_rms": rel_rms(reference_moe(got13, got2, x, weights, ids), ref),
        "rel_rms_gate_up_swapped": rel_rms(
            reference_moe(_swap_halves(ref13), ref2, x, weights, ids), ref
        ),
    }


def experts_apply(
    experts,
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``experts.apply`` on ``layer``'s weights with upstream's 15 arguments
    (no expert map, no scales passed, no accumulation): a new output."""
    method = layer.quant_method
    out = torch.empty_like(x)
    experts.apply(
        out,
        x,
        layer.w13_weight,
        layer.w2_weight,
        topk_weights,
        topk_ids,
        method.moe.activation,
        method.moe.num_experts,
        None,
        None,
        None,
        None,
        None,
        None,
        False,
    )
    return out


def emulated_apply(
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    bind: bool = True,
) -> torch.Tensor:
    """The prepared ``layer`` computed by the fork's emulated experts, built
    from the quant method's configs and bound to the layer (its preparation
    is done: ``process_weights_after_loading`` only binds the views).
    ``bind=False``: apply on experts that were never bound (they must
    refuse). Fork only: unmodified 0.33.0 has no emulated experts."""
    from vllm.model_executor.layers.fused_moe.experts import (
        flashinfer_b12x_emulated,
    )

    method = layer.quant_method
    emulated = flashinfer_b12x_emulated.FlashInferB12xEmulatedExperts(
        method.moe, method.moe_quant_config, bf16_activations=True
    )
    if bind:
        emulated.process_weights_after_loading(layer)
    return experts_apply(emulated, layer, x, topk_weights, topk_ids)


def function_errors(
    layer: torch.nn.Module,
    experts: SyntheticNvfp4Experts,
    shape: MoEShape,
    tokens: int = 64,
    seed: int = 1,
) -> dict[str, float]:
    """The fork's emulated experts on the prepared layer
    (:func:`emulated_apply`) vs the checkpoint's BF16 reference, relative
    RMS (``rel_rms``), and the control ``rel_rms_gate_up_swapped`` (the
    reference with gate and up exchanged). Fork only."""
    x, weights, ids = moe_inputs(shape, tokens, seed)
    w13, w2 = checkpoint_dequantized_experts(experts)
    out = emulated_apply(layer, x, weights, ids)
    return {
        "rel_rms": rel_rms(out, reference_moe(w13, w2, x, weights, ids)),
        "rel_rms_gate_up_swapped": rel_rms(
            out, reference_moe(_swap_halves(w13), w2, x, weights, ids)
        ),
    }


def prepare_and_report(
    shape: MoEShape,
    checkpoint_format: str,
    *,
    measure: bool = False,
    seed: int = 0,
    up_gate_ratio: tuple[float, float] | None = None,
    function: bool = False,
) -> dict[str, Any]:
    """:func:`prepare_layer`, then :func:`prepared_b12x_report` plus
    ``shape``, ``checkpoint_format`` and what ``measure`` measured; with
    ``function``, :func:`prepared_function_errors` as ``function``."""
    layer, experts, extra = prepare_layer(
        shape,
        checkpoint_format,
        measure=measure,
        seed=seed,
        up_gate_ratio=up_gate_ratio,
    )
    report = prepared_b12x_report(layer, experts, checkpoint_format)
    if function:
        extra["function"] = prepared_function_errors(layer, experts, shape)
    return {
        "shape": dataclasses.asdict(shape),
        "checkpoint_format": checkpoint_format,
        **report,
        **extra,
    }


def prep_reports_on_cpu(
    cases: list[tuple[str, str]], **options: Any
) -> list[dict[str, Any]]:
    """:func:`prepare_and_report` (with ``options``) for each (shape name,
    checkpoint format), one layer alive at a time, each in a one-rank vLLM
    of its own, inside the stand-ins: the entry point of a snippet run in a
    subprocess."""
    reports = []
    with b12x_preparation_on_cpu():
        for shape_name, checkpoint_format in cases:
            # A config of its own per layer: the config's forward context
            # keeps every layer built under it (by name) alive.
            with one_rank_vllm("flashinfer_b12x"):
                shape = MOE_SHAPES[shape_name]
                reports.append(prepare_and_report(shape, checkpoint_format, **options))
            gc.collect()
    return reports
