# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoints of the real quantizers through vLLM 0.34.0's own loader with
``moe_backend="flashinfer_b12x"``: each MoE layer is prepared in place with a
small peak, and computes the tool's own function (W4A4) or holds FlashInfer's
own W4A16 layout of the checkpoint (W4A16).

    write_checkpoints.py, in .venv-quantizers  ->  OUT_DIR/<name>/ and
                                                   <name>.reference.safetensors
    here, each checkpoint loaded once (tests/vllm_loader's helpers):
        load_model_measured: EngineArgs(moe_backend="flashinfer_b12x"),
            get_model_loader(...).load_model(...), each MoE layer's
            process_weights_after_loading profiled (peak of torch's CPU
            allocations above its start)
        W4A4: each layer's modular kernel applied to the reference's inputs
            and routes, FlashInfer's launch stood in by upstream's
            _TorchB12xMoEWrapper (the b12x kernels' arithmetic in torch)
        W4A16: the layer's bytes against FlashInfer's own prepare of the
            checkpoint (the kernel itself needs SM12x)

OUT_DIR: $VLLM_QUANTIZER_CHECKPOINTS, default build/quantizer-checkpoints.
"""

import os
import re
from pathlib import Path

import pytest
import torch
from cpu_loading import vllm_world
from preparation_peaks import load_model_measured, peak_bytes
from safetensors import safe_open
from safetensors.torch import load_file
from upstream_b12x_test import b12x_test_module

from tests.quantizers.write_checkpoints import (
    CHECKPOINTS,
    NUM_LAYERS,
    W4A4,
    reference_path,
)

from vllm_cpu_stand_ins import b12x_kernels_in_torch, cuda_is_identity, sm_count

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = Path(
    os.environ.get("VLLM_QUANTIZER_CHECKPOINTS", REPO / "build/quantizer-checkpoints")
)
pytestmark = pytest.mark.skipif(
    not OUT_DIR.is_dir(),
    reason=f"no {OUT_DIR}: write it with the real quantizers, README.md "
    "'Checkpoints from the real quantizers (CPU)' (in .venv-quantizers: "
    "python tests/quantizers/write_checkpoints.py build/quantizer-checkpoints)",
)

_W4A4 = [n for n, (_, _, mode) in CHECKPOINTS.items() if mode == W4A4]
_W4A16 = [n for n in CHECKPOINTS if n not in _W4A4]
#: vLLM's layer against the reference, relative RMS: the same arithmetic in
#: float32 but the kernel's BF16 output (rounding <= 2^-9 relative), twice.
OUTPUT_TOL = 2.0**-8
#: vLLM's layer against the tool's own output, at most this fraction of the
#: tool's own activation-quantization error (its output against the same
#: weights with BF16 activations): llm-compressor's forward runs in BF16,
#: whose roundings move the FC2 input's E2M1 codes (measured: a third).
TOOL_RATIO = 0.5
#: A negative control misses its tolerance by at least this factor.
MISS = 10
#: Per expert, the float32 scale vectors the quant methods derive ([E] and
#: [E, 2]: inverted global scales, gate/up maxima, their inverses).
SCALE_BYTES_PER_EXPERT = 8 * 4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """``get(name)``: checkpoint ``name`` as vLLM loaded it, per MoE layer
    index (the layer, its preparation's peak bytes), and the tool's
    reference tensors; each checkpoint loaded once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            checkpoint, ref = OUT_DIR / name, reference_path(OUT_DIR, name)
            assert checkpoint.is_dir() and ref.is_file(), (
                f"{name} is missing in {OUT_DIR}: write the checkpoints again"
            )
            model, _, peaks = load_model_measured(checkpoint)
            layers = {}
            for prefix, peak in peaks.items():
                i = int(re.search(r"layers\.(\d+)\.", prefix)[1])
                layers[i] = (model.get_submodule(prefix), peak)
            assert sorted(layers) == list(range(NUM_LAYERS)), sorted(peaks)
            cache[name] = layers, load_file(ref)
        return cache[name]

    # FlashInfer's W4A16 prepare asks the SM count.
    with vllm_world(tmp_path_factory.mktemp("gloo") / "init"), sm_count():
        yield get


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of ``a`` against ``b``."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _reference_moe(
    ref: dict, i: int, swap: bool = False, a4: bool = True
) -> torch.Tensor:
    """The tool's function of layer ``i``'s experts on the reference's inputs
    and routes, float32 [T, H]: its dequantized weights, each GEMM's input
    NVFP4-quantized at the tool's calibrated input scale (vLLM's reference
    ``ref_nvfp4_quant_dequant``; ``a4=False``: left as they are), GEMMs in
    float32, the SiLU product rounded to BF16 (the model's dtype, where the
    kernel rounds it); ``swap``: gate and up exchanged, silu(up) * gate."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        ref_nvfp4_quant_dequant,
    )

    def quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return ref_nvfp4_quant_dequant(x, 1 / scale, 16) if a4 else x

    w13, w2 = ref[f"layers.{i}.w13"], ref[f"layers.{i}.w2"]  # [E, 2I, H], [E, H, I]
    a13, a2 = ref[f"layers.{i}.a13_scale"], ref[f"layers.{i}.a2_scale"]  # [E, 2], [E]
    x, ids = ref[f"layers.{i}.x"], ref[f"layers.{i}.topk_ids"]  # [T, H], [T, K]
    weights = ref[f"layers.{i}.topk_weights"]  # [T, K]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w_gate, w_up = w13[e].chunk(2)  # [I, H] each
        gate = quant(x[rows], a13[e, 0]) @ w_gate.T  # [n, I]
        up = quant(x[rows], a13[e, 1]) @ w_up.T
        if swap:
            gate, up = up, gate
        h = (torch.nn.functional.silu(gate) * up).bfloat16()
        y = quant(h, a2[e]) @ w2[e].T  # [n, H]
        out.index_add_(0, rows, y * weights[rows, slots, None])
    return out


def _experts_output(layer: torch.nn.Module, ref: dict, i: int) -> torch.Tensor:
    """vLLM's prepared layer applied to layer ``i``'s reference inputs and
    routes through its modular kernel (the b12x launch in torch), [T, H]."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    with b12x_kernels_in_torch(b12x_test_module()._TorchB12xMoEWrapper):
        return layer.quant_method.moe_kernel.apply(
            hidden_states=ref[f"layers.{i}.x"],
            w1=layer.w13_weight,
            w2=layer.w2_weight,
            topk_weights=ref[f"layers.{i}.topk_weights"],
            topk_ids=ref[f"layers.{i}.topk_ids"],
            global_num_experts=layer.w13_weight.shape[0],
            activation=MoEActivation.SILU,
            apply_router_weight_on_input=False,
            expert_map=None,
        )


def _checkpoint_experts(checkpoint: Path, i: int, num_experts: int):
    """FlashInfer's W4A16 prepare for the tool's format, and layer ``i``'s
    experts as the tool wrote them, stacked as that prepare takes them: w13
    codes [E, 2I, H/2] as [gate; up], w2 [E, H, I/2], block scales swizzled
    to 128x4 by upstream's ``swizzle_blockscale``, global scales [E] as stored
    (ModelOpt ``weight_scale_2``, compressed-tensors ``weight_global_scale``,
    which that prepare inverts)."""
    from flashinfer.fused_moe.cute_dsl.blackwell_sm12x import moe_w4a16_prepare

    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
        swizzle_blockscale,
    )

    prefix = f"model.layers.{i}.mlp.experts"
    tensors = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names = [k for k in f.keys() if k.startswith(prefix)]  # noqa: SIM118
            tensors |= {k: f.get_tensor(k) for k in names}
    ct = f"{prefix}.0.down_proj.weight_packed" in tensors
    codes, scale_2 = (
        ("weight_packed", "weight_global_scale") if ct else ("weight", "weight_scale_2")
    )

    def stack(projections: tuple[str, ...], suffix: str) -> torch.Tensor:
        return torch.stack(
            [
                torch.cat([tensors[f"{prefix}.{e}.{p}.{suffix}"] for p in projections])
                for e in range(num_experts)
            ]
        )

    def globals_(projection: str) -> torch.Tensor:
        return torch.stack(
            [
                tensors[f"{prefix}.{e}.{projection}.{scale_2}"].reshape(())
                for e in range(num_experts)
            ]
        )

    prepare = (
        moe_w4a16_prepare.prepare_w4a16_compressed_tensors_weights
        if ct
        else moe_w4a16_prepare.prepare_w4a16_modelopt_nvfp4_weights
    )
    w13, w2 = ("gate_proj", "up_proj"), ("down_proj",)
    with cuda_is_identity():  # swizzle_blockscale ends in .cuda()
        return prepare, {
            "w13_fp4": stack(w13, codes),
            "w13_blockscale": swizzle_blockscale(stack(w13, "weight_scale")),
            "w13_global_scale": globals_("gate_proj"),
            "w2_fp4": stack(w2, codes),
            "w2_blockscale": swizzle_blockscale(stack(w2, "weight_scale")),
            "w2_global_scale": globals_("down_proj"),
        }


def _w4a4_bound(layer: torch.nn.Module) -> tuple[int, int]:
    """(the bound, a whole-layer transform's peak): one expert's w13 half and
    its block-scale half (the reorder's buffers; the swizzle's, one expert's
    scales, are smaller) and a few scale bytes per expert; upstream's
    ``swizzle_blockscale`` of the layer's w13 scales."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_utils import (
        swizzle_blockscale,
    )

    num_experts, rows, packed_k = layer.w13_weight.shape  # [E, 2I, H/2]
    half = rows // 2 * packed_k
    bound = half + half // 8 + SCALE_BYTES_PER_EXPERT * num_experts
    scales = torch.ones(layer.w13_weight_scale.shape, dtype=torch.float8_e4m3fn)
    with cuda_is_identity():
        return bound, peak_bytes(lambda: swizzle_blockscale(scales))


def _w4a16_bound(layer: torch.nn.Module, checkpoint: Path, i: int) -> tuple[int, int]:
    """(the bound, a whole-layer transform's peak): FlashInfer's own prepare
    of one expert as the branch calls it (in place, rows [w3; w1]), measured
    alike, plus what it returns (the branch's loop holds one expert's result
    until the next one's returns) and a few scale bytes per expert;
    FlashInfer's public prepare of the layer (a W4A16 copy beside it)."""
    num_experts = layer.w13_weight.shape[0]
    prepare, source = _checkpoint_experts(checkpoint, i, num_experts)
    one = {k: v[:1].clone() for k, v in source.items()}
    kept = []

    def prepare_one():
        p = prepare(
            **one, activation="silu", w13_layout="w31", reuse_input_storage=True
        )
        kept.extend([p.w13_scale, p.w2_scale, p.w13_global_scale, p.w2_global_scale])
        kept.append(p.workspace)  # w13, w2: the input's storage

    scratch = peak_bytes(prepare_one)
    returned = sum(t.nbytes for t in kept)
    bound = scratch + returned + SCALE_BYTES_PER_EXPERT * num_experts
    return bound, peak_bytes(lambda: prepare(**source, activation="silu"))


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_preparation_peak_per_moe_layer(name, loaded, record_property):
    """Each MoE layer's preparation peak within its bound (``_w4a4_bound``,
    ``_w4a16_bound``); negative control: a whole-layer transform of the same
    layer exceeds it twice over."""
    layers, _ = loaded(name)
    for i, (layer, peak) in sorted(layers.items()):
        if CHECKPOINTS[name][2] == W4A4:
            bound, whole = _w4a4_bound(layer)
        else:
            bound, whole = _w4a16_bound(layer, OUT_DIR / name, i)
        record_property(f"layer{i}", dict(peak=peak, bound=bound, whole=whole))
        assert peak <= bound, (i, peak, bound)
        assert whole > 2 * bound, (i, whole, bound)


@pytest.mark.parametrize("name", _W4A4)
def test_w4a4_layers_compute_the_tools_function(name, loaded, record_property):
    """Each layer's output against the reference (the tool's weights and
    activation quantization, float32) within OUTPUT_TOL, and against the
    tool's own output within TOOL_RATIO of the tool's own W4A4 error; the
    reference with gate and up swapped misses by MISS times OUTPUT_TOL."""
    layers, ref = loaded(name)
    for i, (layer, _) in sorted(layers.items()):
        out = _experts_output(layer, ref, i)
        tool = ref[f"layers.{i}.out"]
        err = _rel(out, _reference_moe(ref, i))
        swapped = _rel(out, _reference_moe(ref, i, swap=True))
        tool_err = _rel(out, tool)
        tool_own = _rel(tool, _reference_moe(ref, i, a4=False))
        figures = dict(err=err, swapped=swapped, tool=tool_err, tool_own=tool_own)
        record_property(f"layer{i}", {k: round(v, 5) for k, v in figures.items()})
        assert err <= OUTPUT_TOL, (i, figures)
        assert swapped > MISS * OUTPUT_TOL, (i, figures)
        assert tool_err <= TOOL_RATIO * tool_own, (i, figures)


@pytest.mark.parametrize("name", _W4A16)
def test_w4a16_layers_hold_flashinfers_prepare_of_the_checkpoint(name, loaded):
    """Each layer's weights and block scales hold the bytes, and its experts'
    global scales the values, of FlashInfer's own prepare of the checkpoint
    (the tool's format, [gate; up] as written); FlashInfer told the rows are
    [up; gate] gives other bytes."""
    layers, _ = loaded(name)
    for i, (layer, _) in sorted(layers.items()):
        prepare, source = _checkpoint_experts(
            OUT_DIR / name, i, layer.w13_weight.shape[0]
        )
        want = prepare(**source, activation="silu")
        for param, packed in (
            (layer.w13_weight, want.w13),
            (layer.w13_weight_scale, want.w13_scale),
            (layer.w2_weight, want.w2),
            (layer.w2_weight_scale, want.w2_scale),
        ):
            got = param.view(torch.uint8).reshape(-1)
            assert torch.equal(got, packed.view(torch.uint8).reshape(-1)), i
        prepared = layer.quant_method.moe_kernel.fused_experts._layout
        assert torch.equal(prepared.w13_global_scale, want.w13_global_scale), i
        assert torch.equal(prepared.w2_global_scale, want.w2_global_scale), i
        swapped = prepare(**source, activation="silu", w13_layout="w31")
        got = layer.w13_weight.view(torch.uint8).reshape(-1)
        assert not torch.equal(got, swapped.w13.view(torch.uint8).reshape(-1)), i
