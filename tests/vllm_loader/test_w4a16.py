# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 NVFP4 checkpoints (weight-only) through vLLM 0.34.0's own loader with
the series on ``moe_backend="flashinfer_b12x"``: the backend picks
``FlashInferB12xW4A16Experts``, whose preparation writes FlashInfer 0.7.4's
W4A16 layout over each expert's loaded weights and block scales.

    checkpoint (w4a16_checkpoints.py)            FlashInfer 0.7.4, by itself
    -> vLLM: reorder [w1; w3] -> [w3; w1],       prepare_w4a16_{modelopt_nvfp4,
       swizzle the block scales, then per        compressed_tensors}_weights(
       expert prepare_w4a16_modelopt_nvfp4_         checkpoint w13 [gate; up],
       weights(w13_layout="w31",                   scales swizzled by upstream's
       reuse_input_storage=True)                   swizzle_blockscale, globals)
    == byte for byte (weights, block scales, global scales) ==

Checkpoints: ModelOpt MIXED_PRECISION with the experts ``W4A16_NVFP4``
(NVIDIA's Qwen3.6 release) and compressed-tensors NVFP4A16. A ModelOpt
``W4A16_NVFP4`` config alone is refused by 0.34.0 itself. FlashInfer's host
code asks the device's SM count (``vllm_cpu_stand_ins.sm_count``).
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from cpu_loading import load_model
from preparation_peaks import load_model_measured, peak_bytes
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from w4a16_checkpoints import write_w4a16_checkpoint

from nvfp4_checkpoint import PRESETS
from vllm_cpu_stand_ins import cuda_is_identity, sm_count

pytestmark = pytest.mark.usefixtures("vllm_cpu", "flashinfer_sm_count")

TINY = PRESETS["tiny"]
SCHEMES = ("modelopt-mixed", "compressed-tensors")
EXPERTS = "model.layers.{}.mlp.experts.routed_experts"


@pytest.fixture(scope="module")
def flashinfer_sm_count():
    with sm_count():
        yield


def _prepare_fn(scheme: str):
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_prepare

    if scheme == "compressed-tensors":
        return moe_w4a16_prepare.prepare_w4a16_compressed_tensors_weights
    return moe_w4a16_prepare.prepare_w4a16_modelopt_nvfp4_weights


def _checkpoint_layer(checkpoint: Path, layer: int, num_experts: int) -> dict:
    """Layer ``layer``'s experts as the checkpoint holds them, stacked: w13
    codes [E, 2I, H/2] as [gate; up] and w2 [E, H, I/2], their block scales
    swizzled to 128x4 by upstream's ``swizzle_blockscale`` (the layout
    FlashInfer's prepare takes; it ends in ``.cuda()``, stood in), the global
    scales [E] as stored (ModelOpt ``weight_scale_2``, compressed-tensors
    ``weight_global_scale``)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
        swizzle_blockscale as swizzle,
    )

    def swizzle_blockscale(scale):
        with cuda_is_identity():
            return swizzle(scale)

    path = checkpoint / f"model-layer{layer:03d}.safetensors"
    prefix = f"model.layers.{layer}.mlp.experts"
    with safe_open(path, "pt") as f:
        ct = f"{prefix}.0.down_proj.weight_packed" in set(f.keys())
        codes = "weight_packed" if ct else "weight"
        global_scale = "weight_global_scale" if ct else "weight_scale_2"

        def stack(suffix: str, *projections: str) -> torch.Tensor:
            """[E, ...]: each expert's ``projections`` concatenated by rows
            (a 0-d global scale as one row)."""
            return torch.stack(
                [
                    torch.cat(
                        [
                            torch.atleast_1d(f.get_tensor(f"{prefix}.{e}.{p}.{suffix}"))
                            for p in projections
                        ]
                    )
                    for e in range(num_experts)
                ]
            )

        gate_up = ("gate_proj", "up_proj")
        return {
            "w13_fp4": stack(codes, *gate_up),
            "w13_blockscale": swizzle_blockscale(stack("weight_scale", *gate_up)),
            "w13_global_scale": stack(global_scale, "gate_proj").reshape(-1),
            "w2_fp4": stack(codes, "down_proj"),
            "w2_blockscale": swizzle_blockscale(stack("weight_scale", "down_proj")),
            "w2_global_scale": stack(global_scale, "down_proj").reshape(-1),
        }


def _assert_prepared_as(experts: torch.nn.Module, want) -> None:
    """The layer's prepared parameters hold ``want``'s bytes (a
    ``W4A16PackedWeights``), its global scales ``want``'s values."""
    for param, packed in (
        (experts.w13_weight, want.w13),
        (experts.w13_weight_scale, want.w13_scale),
        (experts.w2_weight, want.w2),
        (experts.w2_weight_scale, want.w2_scale),
    ):
        got = param.view(torch.uint8).reshape(-1)
        assert torch.equal(got, packed.view(torch.uint8).reshape(-1))
    prepared = experts.quant_method.moe_kernel.fused_experts._layout
    assert torch.equal(prepared.w13_global_scale, want.w13_global_scale)
    assert torch.equal(prepared.w2_global_scale, want.w2_global_scale)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_w4a16_checkpoint_runs_on_the_w4a16_experts(scheme, tmp_path):
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xW4A16Experts,
    )

    checkpoint = write_w4a16_checkpoint(tmp_path, TINY, 2, scheme)
    model, _ = load_model(checkpoint)
    for layer in range(2):
        kernel = model.get_submodule(EXPERTS.format(layer)).quant_method.moe_kernel
        assert type(kernel.fused_experts) is FlashInferB12xW4A16Experts
        assert kernel.fused_experts.quant_config.use_nvfp4_w4a16


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepared_parameters_are_flashinfers_prepare(scheme, tmp_path):
    checkpoint = write_w4a16_checkpoint(tmp_path, TINY, 2, scheme)
    model, _ = load_model(checkpoint)
    for layer in range(2):
        source = _checkpoint_layer(checkpoint, layer, TINY.num_experts)
        want = _prepare_fn(scheme)(**source, activation="silu")
        _assert_prepared_as(model.get_submodule(EXPERTS.format(layer)), want)


def test_prepared_per_expert_when_the_experts_scale_ranges_differ(tmp_path):
    """FlashInfer scales the block scales by a power of two from the largest
    one among the experts it is given (``_nvfp4_compute_scale_factor``), and
    divides the global scale by it. Prepared one expert at a time, each
    expert gets its own: the bytes are FlashInfer's prepare of each expert
    alone, the same weights. Exports whose every expert has a block scale
    of 448 (global scale = amax / (6 * 448)) give one factor for all."""
    checkpoint = write_w4a16_checkpoint(tmp_path, TINY, 1, "modelopt-mixed")
    # Expert 0's block scales halved (exact in E4M3): its largest is 224.
    path = checkpoint / "model-layer000.safetensors"
    tensors = load_file(path)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.0.{proj}.weight_scale"
        tensors[name] = (tensors[name].float() / 2).to(torch.float8_e4m3fn)
    save_file(tensors, path, metadata={"format": "pt"})

    model, _ = load_model(checkpoint)
    experts = model.get_submodule(EXPERTS.format(0))
    source = _checkpoint_layer(checkpoint, 0, TINY.num_experts)
    prepare = _prepare_fn("modelopt-mixed")
    per_expert = [
        prepare(**{k: v[e : e + 1] for k, v in source.items()}, activation="silu")
        for e in range(TINY.num_experts)
    ]
    fields = ("w13", "w13_scale", "w13_global_scale", "w2", "w2_scale")
    want = dataclasses.replace(
        per_expert[0],
        **{k: torch.cat([getattr(p, k) for p in per_expert]) for k in fields},
        w2_global_scale=torch.cat([p.w2_global_scale for p in per_expert]),
    )
    _assert_prepared_as(experts, want)
    # Not FlashInfer's prepare of the whole layer: its one factor differs.
    whole = prepare(**source, activation="silu")
    assert not torch.equal(
        experts.w13_weight_scale.view(torch.uint8).reshape(-1),
        whole.w13_scale.view(torch.uint8).reshape(-1),
    )


def _expert_bytes(preset) -> tuple[int, int, int]:
    """One expert's w13 codes, w13 block scales and w2 block scales, in
    bytes."""
    w13 = 2 * preset.intermediate_size * preset.hidden_size
    return w13 // 2, w13 // 16, w13 // 32


@pytest.mark.parametrize(
    "preset",
    [
        pytest.param(TINY, id="tiny"),
        pytest.param(
            PRESETS["qwen3.6-35b-a3b"], id="qwen3.6-35b-a3b", marks=pytest.mark.slow
        ),
    ],
)
def test_w4a16_preparation_peak_is_flashinfers_one_expert_scratch(
    preset, tmp_path, record_property
):
    """Per MoE layer, the preparation's peak is FlashInfer's scratch for one
    expert: three buffers of one expert's w13 codes (``_repack_weight``'s
    qweight, flat and gather scratch), block scales of two experts
    (FlashInfer's working copy of this expert's; the previous expert's
    prepared ones, still bound while the next expert is prepared) and 64 KiB
    (FlashInfer's index tensors, about 47 KiB, and per-expert vectors)."""
    w13, w13_scales, w2_scales = _expert_bytes(preset)
    bound = 3 * w13 + 2 * (w13_scales + w2_scales) + (64 << 10)
    checkpoint = write_w4a16_checkpoint(tmp_path, preset, 1, "modelopt-mixed")
    model, _, peaks = load_model_measured(checkpoint)
    (peak,) = peaks.values()
    record_property("peak_bytes", peak)
    record_property("bound_bytes", bound)
    assert peak <= bound
    # Negative control, measured alike: FlashInfer's public prepare (a new
    # W4A16 copy beside the source) of the layer's first 8 experts.
    experts = model.get_submodule(EXPERTS.format(0))
    prepared = experts.quant_method.moe_kernel.fused_experts._layout
    source = dict(
        w13_fp4=experts.w13_weight[:8],
        w13_blockscale=experts.w13_weight_scale[:8],
        w13_global_scale=prepared.w13_global_scale[:8],
        w2_fp4=experts.w2_weight[:8],
        w2_blockscale=experts.w2_weight_scale[:8],
        w2_global_scale=prepared.w2_global_scale[:8],
    )
    prepare = _prepare_fn("modelopt-mixed")
    public = peak_bytes(lambda: prepare(**source, activation="silu"))
    record_property("flashinfer_public_8_experts_peak_bytes", public)
    assert public > 2 * bound
