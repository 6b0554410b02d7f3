# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The release's own NVFP4 MoE layers (vLLM 0.34.0 or 0.33.0), built and
prepared on CPU: a one-rank vLLM context, the layer as upstream's factory
makes it, synthetic checkpoint weights of real magnitude (what the
preparation left: upstream_reports.py).

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
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

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
    "checkpoint_format_of",
    "checkpoint_params",
    "load_synthetic_experts",
    "make_nvfp4_moe_layer",
    "nvfp4_quant_config",
    "one_rank_vllm",
    "prepare_layer",
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
