# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own NVFP4 MoE layers, built and prepared on CPU: a one-rank
vLLM context, the layer as upstream's factory makes it, synthetic checkpoint
weights of real magnitude, and a report of what the preparation left.

Works against whichever vllm the interpreter imports (the installed fork, or
unmodified 0.33.0 in a subprocess through ``upstream_env.run_unmodified_json``).

What is real and what is a stand-in:

* Real (vLLM 0.33.0's code, unmodified, as a model's constructor runs it):
  ``VllmConfig`` (``DeviceConfig(device="cpu")``,
  ``KernelConfig(moe_backend=...)``) made current with
  ``set_current_vllm_config``; a one-rank gloo world and tensor-parallel group
  from ``init_distributed_environment`` + ``initialize_model_parallel``
  (upstream's own test fixture does the same with NCCL), torn down with
  ``destroy_model_parallel`` + ``destroy_distributed_environment``; the
  layer from ``FusedMoEFactory`` (the router, ``ExpertMapManager``,
  ``FusedMoEConfig`` and its ``FusedMoEParallelConfig``, the
  ``RoutedExperts`` module); the quant method
  resolved by the quant config (``ModelOptNvFp4Config`` ->
  ``ModelOptNvFp4FusedMoE``; ``CompressedTensorsConfig`` ->
  ``CompressedTensorsW4A4Nvfp4MoEMethod``), its backend selection
  (``select_nvfp4_moe_backend``) and its ``create_weights``;
  ``process_weights_after_loading`` end to end: the oracle's
  ``convert_to_nvfp4_moe_kernel_format`` ->
  ``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` (reorder, input-scale
  reduction, swizzle), ``replace_parameter``, ``make_nvfp4_moe_quant_config``,
  ``make_nvfp4_moe_kernel`` (prepare/finalize, ``FlashInferB12xExperts``) and
  the experts' own ``process_weights_after_loading`` (fold, FC2 input scale,
  MMA views through FlashInfer 0.7.4's ``convert_sf_to_mma_layout``).
* Stand-ins (``cpu_stand_ins.b12x_preparation_on_cpu``): ``torch.Tensor.cuda``
  returns the tensor; ``FlashInferB12xExperts._supports_current_device`` says
  yes; vLLM's lazy FlashInfer wrapper is bypassed for FlashInfer's real
  function.
* Not upstream's: the checkpoint. Synthetic NVFP4 tensors of the layer's
  shapes (random E2M1 codes, E4M3 block scales 90..448, per-expert global
  scales 1e-3..1e-2, input scales of activations with amax 4..64) are copied
  into the parameters ``create_weights`` made, as a finished weight load
  leaves them (not through each parameter's ``weight_loader``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cpu_stand_ins import b12x_preparation_on_cpu
from upstream_env import load_slice_module

__all__ = [
    "CHECKPOINT_FORMATS",
    "E4M3_RELATIVE_ROUNDING",
    "MOE_SHAPES",
    "QWEN36_35B_A3B",
    "REL_RMS_TOLERANCE",
    "SMALL",
    "UP_GATE_RATIO",
    "W4A16_CONFIGS",
    "MoEShape",
    "SyntheticNvfp4Experts",
    "checkpoint_dequantized_experts",
    "checkpoint_global_scales",
    "checkpoint_format_of",
    "checkpoint_params",
    "emulated_apply",
    "function_errors",
    "load_synthetic_experts",
    "make_nvfp4_moe_layer",
    "moe_inputs",
    "nvfp4_quant_config",
    "one_rank_vllm",
    "prep_reports_on_cpu",
    "prepare_and_report",
    "prepare_layer",
    "prepared_b12x_report",
    "prepared_dequantized_experts",
    "prepared_function_errors",
    "prepared_kernel_alphas",
    "reference_moe",
    "rel_rms",
    "synthetic_nvfp4_experts",
]


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer's routed experts (tensor parallel size 1)."""

    name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    activation: str = "silu"

    @property
    def id(self) -> str:
        return f"{self.num_experts}x{self.hidden_size}x{self.intermediate_size}"


SMALL = MoEShape("small", 8, 256, 128, 2)
#: Qwen3.6-35B-A3B's MoE layer (40 of them): w13 256 MiB, its scales 32 MiB.
QWEN36_35B_A3B = MoEShape("qwen3.6-35b-a3b", 256, 2048, 512, 8)
MOE_SHAPES = {s.name: s for s in (SMALL, QWEN36_35B_A3B)}

#: up's global scale / gate's, per expert, log-uniform in this range, for the
#: checkpoints whose gate and up global scales differ (upstream's methods
#: warn and use gate's for both).
UP_GATE_RATIO = (0.5, 2.0)

#: Relative RMS error of an NVFP4 layer's function against the BF16
#: reference on its dequantized weights (the reference rounds the weights to
#: BF16, 2^-9 relative; both round the intermediate to BF16).
REL_RMS_TOLERANCE = 0.01

#: The two NVFP4 checkpoint formats whose MoE methods reach FLASHINFER_B12X.
CHECKPOINT_FORMATS = ("modelopt", "compressed-tensors")

#: E4M3 has 3 mantissa bits: rounding a normal value to nearest moves it by
#: at most half a unit in the last place, 2^-4 of the value. Upstream's fold
#: re-rounds every block scale once (the synthetic products lie in E4M3's
#: normal range, >= 2^-6); an exact preparation (no fold) is off by 0.
E4M3_RELATIVE_ROUNDING = 2.0**-4

_NVFP4_UTILS = "vllm/model_executor/layers/quantization/utils/nvfp4_utils.py"
_MEM_UTILS = "vllm/utils/mem_utils.py"
_MOE_REFERENCE = "tests/kernels/moe/moe_reference.py"
_E2M1_MAX, _E4M3_MAX = 6.0, torch.finfo(torch.float8_e4m3fn).max


#: Weight-only (W4A16) NVFP4 checkpoint configurations: ModelOpt's
#: W4A16_NVFP4, ModelOpt's MIXED_PRECISION naming the experts W4A16_NVFP4
#: (as NVIDIA's Qwen3.6 NVFP4 release does), compressed-tensors' NVFP4A16.
W4A16_CONFIGS = ("modelopt-w4a16", "modelopt-mixed-w4a16", "compressed-tensors-w4a16")


def checkpoint_format_of(config: str) -> str:
    """The tensor names' format of a config name (``nvfp4_quant_config``)."""
    return (
        "compressed-tensors" if config.startswith("compressed-tensors") else "modelopt"
    )


def nvfp4_quant_config(checkpoint_format: str) -> Any:
    """The quantization config a W4A4 NVFP4 checkpoint of that format
    declares: ModelOpt ``quant_algo: NVFP4`` (serialized, group size 16), or
    compressed-tensors ``nvfp4-pack-quantized`` with tensor-group FP4 weights
    and input activations (as llm-compressor's NVFP4 recipe writes it)."""
    if checkpoint_format == "modelopt":
        from vllm.model_executor.layers.quantization.modelopt import (
            ModelOptNvFp4Config,
        )

        return ModelOptNvFp4Config(
            quant_method="NVFP4", is_checkpoint_nvfp4_serialized=True, group_size=16
        )
    if checkpoint_format == "modelopt-w4a16":
        from vllm.model_executor.layers.quantization.modelopt import (
            ModelOptNvFp4Config,
        )

        quantization = {
            "quant_algo": "W4A16_NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "exclude_modules": [],
        }
        return ModelOptNvFp4Config.from_config({"quantization": quantization})
    if checkpoint_format == "modelopt-mixed-w4a16":
        from vllm.model_executor.layers.quantization.modelopt import (
            ModelOptMixedPrecisionConfig,
        )

        experts = {"quant_algo": "W4A16_NVFP4", "group_size": 16}
        quantization = {
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {"model.layers.0.mlp.experts": experts},
        }
        return ModelOptMixedPrecisionConfig.from_config({"quantization": quantization})
    if checkpoint_format.startswith("compressed-tensors"):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
            CompressedTensorsConfig,
        )

        weight_only = checkpoint_format == "compressed-tensors-w4a16"

        fp4 = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "symmetric": True,
            "dynamic": False,
        }
        return CompressedTensorsConfig.from_config(
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": fp4,
                        "input_activations": (
                            None if weight_only else {**fp4, "dynamic": "local"}
                        ),
                        "format": "nvfp4-pack-quantized",
                    }
                },
                "ignore": ["lm_head"],
            }
        )
    raise ValueError(
        f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, "
        f"got {checkpoint_format!r}"
    )


@contextlib.contextmanager
def one_rank_vllm(moe_backend: str = "flashinfer_b12x") -> Iterator[Any]:
    """A current ``VllmConfig`` for CPU with ``moe_backend`` and a one-rank
    gloo world with its model-parallel groups, torn down on exit. Yields the
    config. Needed by ``FusedMoEFactory`` (it reads the current config) and
    by ``create_weights`` (its parameters ask the tensor-parallel group for
    their rank). ``VllmConfig()`` alone fails on a CPU machine with the CUDA
    wheel: its platform is ``UnspecifiedPlatform``, whose device type is
    empty, so the device is given. Torn down with upstream's
    ``destroy_model_parallel`` + ``destroy_distributed_environment``, not
    ``cleanup_dist_env_and_memory``, which on a platform other than
    ``CpuPlatform`` empties the accelerator's cache and raises without one."""
    from vllm.config import (
        DeviceConfig,
        KernelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kernel_config=KernelConfig(moe_backend=moe_backend),
    )
    with (
        tempfile.TemporaryDirectory(prefix="vllm-one-rank-") as tmp,
        set_current_vllm_config(config),
    ):
        store = os.path.join(tmp, "store")
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{store}",
            backend="gloo",
        )
        try:
            initialize_model_parallel(1, 1)
            yield config
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def make_nvfp4_moe_layer(
    shape: MoEShape,
    checkpoint_format: str,
    params_dtype: torch.dtype = torch.bfloat16,
    prefix: str = "model.layers.0.mlp.experts",
) -> Any:
    """The ``RoutedExperts`` module upstream's ``FusedMoEFactory`` builds for
    one MoE layer of ``shape`` with that checkpoint format's quant config,
    its parameters made by the quant method's ``create_weights`` (empty, in
    the load layout). Call inside :func:`one_rank_vllm`, with the b12x device
    stand-in active when the backend is ``flashinfer_b12x`` (the method picks
    its backend in its constructor). The factory registers the layer under
    ``prefix`` in the current config's forward context, which refuses a
    second layer of the same name."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    runner = FusedMoEFactory(
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        params_dtype=params_dtype,
        quant_config=nvfp4_quant_config(checkpoint_format),
        activation=shape.activation,
        prefix=prefix,
    )
    return runner.routed_experts


@dataclass
class SyntheticNvfp4Experts:
    """A layer's NVFP4 expert tensors as a checkpoint holds them, fused in the
    load layout, global scales in the dequantization direction (ModelOpt's
    ``weight_scale_2 = amax / (6 * 448)``; compressed-tensors stores the
    inverses, see :func:`load_synthetic_experts`).

    * ``w13`` uint8 [E, 2I, H/2], two E2M1 codes per byte; rows [0, I) are
      w1 (gate_proj), rows [I, 2I) w3 (up_proj)
    * ``w13_scale`` float8_e4m3fn [E, 2I, H/16], linear (row-major) layout
    * ``w13_scale_2`` float32 [E, 2] (gate's and up's: equal, as upstream's
      methods assume, unless made with ``up_gate_ratio``);
      ``w13_input_scale`` float32 [E, 2]
    * ``w2`` uint8 [E, H, I/2]; ``w2_scale`` float8_e4m3fn [E, H, I/16];
      ``w2_scale_2``, ``w2_input_scale`` float32 [E]
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w13_input_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    w2_input_scale: torch.Tensor


def _log_uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return torch.exp(torch.log(torch.tensor(lo)) + u * torch.log(torch.tensor(hi / lo)))


def _block_scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # A block scale is 448 * block_amax / tensor_amax; for weight-like data
    # the block amax of 16 values is a sizeable fraction of the tensor's.
    frac = 0.2 + 0.8 * torch.rand(shape, generator=gen)
    return (_E4M3_MAX * frac).to(torch.float8_e4m3fn)


def synthetic_nvfp4_experts(
    shape: MoEShape, seed: int = 0, up_gate_ratio: tuple[float, float] | None = None
) -> SyntheticNvfp4Experts:
    """Random NVFP4 experts of ``shape``: every byte value equally likely
    (all 16 E2M1 codes in both nibbles), E4M3 block scales in 89.6..448,
    per-expert global scales log-uniform in 1e-3..1e-2, input scales of
    activations whose amax is log-uniform in 4..64. Gate and up share one
    global scale, or with ``up_gate_ratio=(lo, hi)`` up's is gate's times a
    per-expert factor log-uniform in lo..hi (drawn after everything else, so
    the other tensors are those of the same seed without it).
    Deterministic in ``seed``."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator().manual_seed(seed)
    w13_scale_2 = _log_uniform(e, 1e-3, 1e-2, gen).float()
    act = _E2M1_MAX * _E4M3_MAX
    experts = SyntheticNvfp4Experts(
        w13=torch.randint(0, 256, (e, 2 * i, h // 2), generator=gen, dtype=torch.uint8),
        w13_scale=_block_scales((e, 2 * i, h // 16), gen),
        w13_scale_2=w13_scale_2[:, None].repeat(1, 2),
        w13_input_scale=(_log_uniform(e, 4.0, 64.0, gen).float() / act)[:, None]
        .repeat(1, 2)
        .contiguous(),
        w2=torch.randint(0, 256, (e, h, i // 2), generator=gen, dtype=torch.uint8),
        w2_scale=_block_scales((e, h, i // 16), gen),
        w2_scale_2=_log_uniform(e, 1e-3, 1e-2, gen).float(),
        w2_input_scale=_log_uniform(e, 4.0, 64.0, gen).float() / act,
    )
    if up_gate_ratio is not None:
        ratio = _log_uniform(e, *up_gate_ratio, gen).float()
        experts.w13_scale_2[:, 1] *= ratio
    return experts


def checkpoint_params(
    experts: SyntheticNvfp4Experts, checkpoint_format: str
) -> dict[str, torch.Tensor]:
    if checkpoint_format == "modelopt":
        return {
            "w13_weight": experts.w13,
            "w13_weight_scale": experts.w13_scale,
            "w13_weight_scale_2": experts.w13_scale_2,
            "w13_input_scale": experts.w13_input_scale,
            "w2_weight": experts.w2,
            "w2_weight_scale": experts.w2_scale,
            "w2_weight_scale_2": experts.w2_scale_2,
            "w2_input_scale": experts.w2_input_scale,
        }
    if checkpoint_format == "compressed-tensors":
        # Quantization-direction global scales: the inverses.
        return {
            "w13_weight_packed": experts.w13,
            "w13_weight_scale": experts.w13_scale,
            "w13_weight_global_scale": 1.0 / experts.w13_scale_2,
            "w13_input_global_scale": 1.0 / experts.w13_input_scale,
            "w2_weight_packed": experts.w2,
            "w2_weight_scale": experts.w2_scale,
            "w2_weight_global_scale": 1.0 / experts.w2_scale_2,
            "w2_input_global_scale": 1.0 / experts.w2_input_scale,
        }
    raise ValueError(
        f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, "
        f"got {checkpoint_format!r}"
    )


def load_synthetic_experts(
    layer: torch.nn.Module, experts: SyntheticNvfp4Experts, checkpoint_format: str
) -> None:
    """Copy ``experts`` into the parameters ``create_weights`` made, under
    that format's names (ModelOpt: ``w13_weight``, ``*_weight_scale_2``,
    ``*_input_scale``; compressed-tensors: ``w13_weight_packed``,
    ``*_weight_global_scale``, ``*_input_global_scale``, inverted); for a
    W4A16 config (:data:`W4A16_CONFIGS`) its format's names without the
    input scales, which such checkpoints lack. Raises ValueError naming the
    parameter if a shape or dtype differs."""
    params = dict(layer.named_parameters())
    weight_only = checkpoint_format in W4A16_CONFIGS
    tensors = checkpoint_params(experts, checkpoint_format_of(checkpoint_format))
    for name, value in tensors.items():
        if weight_only and "input" in name:
            continue  # a W4A16 checkpoint has no activation scales
        if name not in params:
            raise ValueError(f"layer has no parameter {name!r}: {sorted(params)}")
        param = params[name]
        if param.shape != value.shape or param.dtype != value.dtype:
            raise ValueError(
                f"{name}: layer has {tuple(param.shape)} {param.dtype}, "
                f"checkpoint {tuple(value.shape)} {value.dtype}"
            )
        with torch.no_grad():
            param.copy_(value)


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
    nvfp4 = load_slice_module(_NVFP4_UTILS)
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
    nvfp4 = load_slice_module(_NVFP4_UTILS)
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
    nvfp4 = load_slice_module(_NVFP4_UTILS)
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


def prepare_layer(
    shape: MoEShape,
    checkpoint_format: str,
    *,
    measure: bool = False,
    seed: int = 0,
    up_gate_ratio: tuple[float, float] | None = None,
    prefix: str = "model.layers.0.mlp.experts",
) -> tuple[torch.nn.Module, SyntheticNvfp4Experts, dict[str, Any]]:
    """Build the layer, load synthetic weights (:func:`synthetic_nvfp4_experts`
    with ``seed`` and ``up_gate_ratio``) and run the quant method's
    ``process_weights_after_loading``. Returns (layer, the checkpoint, extra):
    with ``measure``, extra has the preparation's ``peak_bytes`` and
    ``net_bytes`` by this repository's ``measure_peak_memory`` (torch's CPU
    allocator accounting; loaded by path) and its ``prep_seconds`` (wall
    time of the call). ``prefix``: the layer's name (one config holds one
    layer per name). Call inside :func:`one_rank_vllm` with
    ``b12x_preparation_on_cpu`` active."""
    layer = make_nvfp4_moe_layer(shape, checkpoint_format, prefix=prefix)
    experts = synthetic_nvfp4_experts(shape, seed, up_gate_ratio)
    load_synthetic_experts(layer, experts, checkpoint_format)
    extra: dict[str, Any] = {}
    if measure:
        mem_utils = load_slice_module(_MEM_UTILS)
        gc.collect()
        with mem_utils.measure_peak_memory("cpu") as mem:
            start = time.perf_counter()
            layer.quant_method.process_weights_after_loading(layer)
            seconds = time.perf_counter() - start
        extra = {
            "peak_bytes": mem.peak_bytes,
            "net_bytes": mem.net_bytes,
            "prep_seconds": seconds,
        }
    else:
        layer.quant_method.process_weights_after_loading(layer)
    return layer, experts, extra


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
        method.moe, method.moe_quant_config, weights_only=True
    )
    if bind:
        emulated.process_weights_after_loading(layer)
    out = torch.empty_like(x)
    emulated.apply(
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
