# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoints written by the real quantizers, read, prepared and run here.

Tiny Qwen3-MoE and Qwen3.5-MoE models (``tiny_moe``: built from their
configs, random weights of real magnitude, nothing downloaded) are quantized
on CPU by llm-compressor 0.14.0.1 (``NVFP4``, ``NVFP4A16``) and ModelOpt
0.47.0 (``NVFP4``, ``W4A16_NVFP4``, ``MIXED_PRECISION`` with FP8 attention),
their checkpoints written (some sharded), read by ``NVFP4MoECheckpoint``,
loaded into ``FusedMoE`` with the emulated b12x backend, prepared, and run.
What each tool does and does not do on CPU is in ``llmcompressor_tool`` and
``modelopt_tool``; what is recorded of the tool, in ``tool_reference``.

Each MoE layer is compared with the tool's own computation:

* decode: the checkpoint's expert weights as this tree decodes them against
  the tool's own dequantization of its in-memory weights (``DECODE_RTOL``);
* BF16-activation function: the W4A16 layer, and a W4A4 checkpoint's layer
  with BF16 activations (the emulation's ``bf16_activations``), against the
  tool's function with BF16 activations (``BF16_ACTIVATIONS_TOL``);
* W4A4 function: the emulated W4A4 layer against the tool's own W4A4
  function (its NVFP4 activation quantizer at the calibrated input scales in
  front of each GEMM). The tool's own W4A4 error is its W4A4 function
  against its BF16-activation function; at every input std from 0.03 to 2
  both the layer's distance from the tool's W4A4 function and the layer's
  own W4A4 error (against the same BF16-activation function) must be within
  ``W4A4_RATIO`` times it.

Every comparison has a gate/up-swapped negative control (the tool's own
function with gate and up exchanged), asserted to miss wherever a swap is
visible at all. It is not visible everywhere: ``silu(g) * u - silu(u) * g``
is about ``g * u * (g - u) / 4``, so where FC1's outputs are small (inputs
of small std, small weights) SiLU is nearly linear, and the swapped
function differs from the right one by about the FC1 outputs' RMS
(relative, measured, while that is below 1). For the BF16-activation comparison
(noise under 1%) the swap is visible, and asserted, from input std 0.03-0.3
on depending on the layer, and at std 2 for every layer; for W4A4 (the
tools' own error is about 16%) only where FC1's outputs reach an RMS of
about 0.5 (the layers of weight std 0.02-0.05 at input std 1-2). Elsewhere
the swap is recorded, not asserted: no comparison at that noise can see it,
and it changes the function by less than the noise. Gate/up order does not
depend on the input std; the decode test pins it for every weight. The W4A4
comparison has a second control, the tool's own function with activation
global scales of 1, which the criterion rejects at small std (its FC2 input
block scales underflow E4M3).

The routes come from fixed logits (``tiny_moe.expert_inputs``: softmax
top-k, renormalized, as both tiny models' configs declare); the tool's side
takes them as computed, the layer routes the same logits itself with the
routing the reader finds in the tool's checkpoint (``ckpt.routing``,
asserted renormalized in the read test).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.kernels.moe.utils import dequantized_checkpoint_layer, rel_rms_error
from tests.quantizers.quantizer_env import (
    LLMCOMPRESSOR,
    MODELOPT,
    QUANTIZERS_COMMAND,
    tool_problem,
)
from tests.quantizers.tiny_moe import INPUT_STDS, MODELS, TOKENS, expert_inputs
from tests.quantizers.tool_reference import (
    BF16_ACTIVATIONS,
    BF16_GATE_UP_SWAPPED,
    GATE_UP_SWAPPED,
    GLOBAL_SCALE_ONE,
    TOOL,
)
from vllm.model_executor.layers.fused_moe.layer import FusedMoE
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    COMPRESSED_TENSORS,
    NVFP4MoECheckpoint,
)
from vllm.model_executor.model_loader.nvfp4_moe_checkpoint import (
    MODELOPT as MODELOPT_FORMAT,
)

#: Decode: this tree computes ``e2m1 * block_scale / global_scale`` in
#: float32 with the global scale inverted from the file's direction;
#: compressed-tensors ``e2m1 * (block_scale / global_scale)``, ModelOpt
#: ``e2m1 * (block_scale * scale_2)``: the same real number rounded at two or
#: three different points, so at most a few float32 ulps apart (2^-21 is
#: four; measured: at most about one).
DECODE_RTOL = 2.0**-21
#: BF16-activation function, relative RMS. Both sides decode the same codes and
#: scales (the decode test), so they differ by BF16 rounding alone (<= 2^-9
#: relative each time). llm-compressor's function is BF16 throughout: its
#: fake-quantized weights cast to BF16, every Linear's output, the SiLU
#: product, the router-weighted sum accumulated in BF16 by index_add
#: (measured 0.6%). ModelOpt's function here is float32 but for the BF16
#: SiLU product: the W4A4 layer's BF16-activation emulation, which rounds at the
#: same point, is within 0.01% of it, the W4A16 layer, which also rounds
#: FC1's output to BF16 as the kernel does, within 0.4%. Tolerances about
#: 2.5 times the measured.
BF16_ACTIVATIONS_TOL = {LLMCOMPRESSOR: 0.015, MODELOPT: 0.01}
#: W4A4: the emulated layer's error against the tool's W4A4 function, at
#: most this many times the tool's own W4A4 error (issue 25's acceptance).
W4A4_RATIO = 1.1
#: A negative control misses by at least this factor.
MISS = 2.0

# (tool, tiny model, scheme, written sharded)
_CASE_LIST = (
    (LLMCOMPRESSOR, "qwen3_moe", "NVFP4", False),
    (LLMCOMPRESSOR, "qwen3_moe", "NVFP4A16", False),
    (LLMCOMPRESSOR, "qwen3_5_moe", "NVFP4", True),
    (LLMCOMPRESSOR, "qwen3_5_moe", "NVFP4A16", False),
    (MODELOPT, "qwen3_moe", "NVFP4", False),
    (MODELOPT, "qwen3_moe", "W4A16_NVFP4", False),
    (MODELOPT, "qwen3_moe", "MIXED_PRECISION-W4A16", False),
    (MODELOPT, "qwen3_5_moe", "NVFP4", True),
    (MODELOPT, "qwen3_5_moe", "MIXED_PRECISION-NVFP4", True),
    # One layer of a real model's size (E=8, H=2048, I=512), W4A4; slow.
    (LLMCOMPRESSOR, "qwen3_moe-2048x512", "NVFP4", False),
    (MODELOPT, "qwen3_moe-2048x512", "NVFP4", False),
)
_CASES = {
    f"{case[0]}-{case[1]}-{case[2]}{'-sharded' if case[3] else ''}": case
    for case in _CASE_LIST
}
_W4A4_SCHEMES = {"NVFP4", "MIXED_PRECISION-NVFP4"}


def _marks(case_id: str) -> list[pytest.MarkDecorator]:
    tool, model, _, _ = _CASES[case_id]
    problem = tool_problem(tool)
    marks = [
        pytest.mark.skipif(
            problem is not None,
            reason=f"needs {tool}: {problem}; run {QUANTIZERS_COMMAND}",
        )
    ]
    if MODELS[model].hidden_size >= 2048:
        marks.append(pytest.mark.slow)
    return marks


def _params(w4a4_only: bool = False) -> list:
    return [
        pytest.param(case_id, marks=_marks(case_id), id=case_id)
        for case_id, (_, _, scheme, _) in _CASES.items()
        if not w4a4_only or scheme in _W4A4_SCHEMES
    ]


@pytest.fixture(scope="session")
def prepared_layer(quantized_case):
    """``get(case_id, layer, bf16_activations)``: a ``FusedMoE`` (emulated b12x)
    built as the checkpoint declares the layer, loaded by the reader and
    prepared; made once per run."""
    layers = {}

    def get(case_id: str, idx: int, bf16_activations: bool = False) -> FusedMoE:
        key = (case_id, idx, bf16_activations)
        if key not in layers:
            ckpt = NVFP4MoECheckpoint(quantized_case(*_CASES[case_id]).checkpoint)
            kwargs = {"bf16_activations": True} if bf16_activations else None
            layer = FusedMoE(
                **ckpt.routing.layer_kwargs(),
                num_experts=ckpt.num_experts,
                hidden_size=ckpt.hidden_size,
                intermediate_size=ckpt.intermediate_size,
                activation=ckpt.activation,
                quant_config=ckpt.quant_config(idx),
                moe_backend="flashinfer_b12x_emulated",
                device="cpu",
                experts_kwargs=kwargs,
                max_num_tokens=TOKENS,
            )
            ckpt.load_layer(layer, idx)
            layer.quant_method.process_weights_after_loading(layer)
            layers[key] = layer
        return layers[key]

    return get


@pytest.mark.parametrize("case_id", _params())
def test_checkpoint_reads_as_the_tool_declared_it(
    case_id, quantized_case, quantizer_measurements
):
    case = quantized_case(*_CASES[case_id])
    seconds = f"{case.seconds:.1f} s"
    quantizer_measurements(f"{case_id}: quantized, recorded, written in", seconds)
    ckpt = NVFP4MoECheckpoint(case.checkpoint)
    spec = case.model
    want = MODELOPT_FORMAT if case.tool == MODELOPT else COMPRESSED_TENSORS
    assert ckpt.format == want
    assert ckpt.moe_layers == list(range(spec.num_layers))
    sizes = (ckpt.num_experts, ckpt.top_k, ckpt.hidden_size, ckpt.intermediate_size)
    h, i = spec.hidden_size, spec.moe_intermediate_size
    assert sizes == (spec.num_experts, spec.top_k, h, i)
    assert ckpt.activation == "silu"
    # As expert_inputs routes the tool's side (norm_topk_prob=True, written
    # by the tool from the tiny model's config; Qwen3.5-MoE always).
    assert ckpt.routing.renormalize and ckpt.routing.top_k == spec.top_k
    assert {ckpt.quant_mode(i) for i in ckpt.moe_layers} == {case.mode}
    for i in ckpt.moe_layers:
        names = [name for name, *_ in ckpt.iter_layer_tensors(i, range(1))]
        assert all(n.startswith(f"{spec.experts_module(i)}.0.") for n in names), names
    index = case.checkpoint / "model.safetensors.index.json"
    if case.sharded:
        shards = set(json.loads(index.read_text())["weight_map"].values())
        assert len(shards) > 1, shards
    else:
        assert not index.exists()
    if case.scheme.startswith("MIXED_PRECISION"):
        quant = json.loads((case.checkpoint / "hf_quant_config.json").read_text())
        layers = quant["quantization"]["quantized_layers"]
        assert quant["quantization"]["quant_algo"] == "MIXED_PRECISION"
        algos = {n.rsplit(".", 1)[-1]: e["quant_algo"] for n, e in layers.items()}
        assert algos["q_proj"] == "FP8" and algos["o_proj"] == "FP8", algos
        assert algos["experts"] in ("NVFP4", "W4A16_NVFP4"), algos


def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a - b).abs()
    return (diff / b.abs().clamp(min=torch.finfo(torch.float32).tiny)).max().item()


@pytest.mark.parametrize("case_id", _params())
def test_decode_equals_the_tools_own_dequantization(
    case_id, quantized_case, quantizer_measurements
):
    case = quantized_case(*_CASES[case_id])
    ckpt = NVFP4MoECheckpoint(case.checkpoint)
    for idx, ref in case.layers.items():
        w13, w2 = dequantized_checkpoint_layer(ckpt, idx, gated=True)
        for name, ours, theirs in (("w13", w13, ref.w13), ("w2", w2, ref.w2)):
            assert ours.shape == theirs.shape, name
            torch.testing.assert_close(ours, theirs, rtol=DECODE_RTOL, atol=0.0)
            equal = (ours == theirs).float().mean().item()
            quantizer_measurements(
                f"{case_id}: layer {idx} {name} decode vs the tool's",
                f"max rel diff {_max_rel_diff(ours, theirs):.2e}, "
                f"{100 * equal:.1f}% bit-equal",
            )
        # Negative control: the tool's weights with gate and up swapped.
        gate, up = ref.w13.chunk(2, dim=1)
        swapped = torch.cat([up, gate], dim=1)
        assert rel_rms_error(w13, swapped) > 0.5


def _bf16_activations(case_id: str) -> bool:
    """Whether the case's W4A4 layer is compared with BF16 activations (the
    emulation's ``bf16_activations``); W4A16 layers have them anyway."""
    return _CASES[case_id][2] in _W4A4_SCHEMES


@pytest.mark.parametrize("std", INPUT_STDS)
@pytest.mark.parametrize("case_id", _params())
def test_bf16_activation_function_matches_the_tools(
    case_id, std, quantized_case, prepared_layer, quantizer_measurements
):
    case = quantized_case(*_CASES[case_id])
    tol = BF16_ACTIVATIONS_TOL[case.tool]
    found = {}
    for idx, ref in case.layers.items():
        layer = prepared_layer(
            case_id, idx, bf16_activations=_bf16_activations(case_id)
        )
        inputs = expert_inputs(case.model, std)
        out = layer(inputs.x, inputs.logits)
        outs = ref.outputs[std]
        err = rel_rms_error(out, outs[BF16_ACTIVATIONS])
        swap = rel_rms_error(out, outs[BF16_GATE_UP_SWAPPED])
        visible = rel_rms_error(outs[BF16_GATE_UP_SWAPPED], outs[BF16_ACTIVATIONS])
        found[idx] = (err, swap, visible)
        quantizer_measurements(
            f"{case_id}: layer {idx} std {std} BF16 activations vs the tool's",
            f"{err:.4f} (gate/up swapped {swap:.4f})",
        )
    for idx, (_, swap, visible) in found.items():
        # The control misses wherever the swap moves the tool's function by
        # more than MISS + 1 tolerances (then it must: |out - swapped| >=
        # visible - err); at the largest std the swap is visible.
        if visible > (MISS + 1) * tol or std == max(INPUT_STDS):
            assert swap > MISS * tol, (idx, swap, visible, tol)
    assert max(err for err, _, _ in found.values()) < tol, (found, tol)


@pytest.mark.parametrize("std", INPUT_STDS)
@pytest.mark.parametrize("case_id", _params(w4a4_only=True))
def test_w4a4_error_within_1_1x_of_the_tools_own(
    case_id, std, quantized_case, prepared_layer, quantizer_measurements
):
    case = quantized_case(*_CASES[case_id])
    found = {}
    for idx, ref in case.layers.items():
        layer = prepared_layer(case_id, idx)
        inputs = expert_inputs(case.model, std)
        out = layer(inputs.x, inputs.logits)
        outs = ref.outputs[std]
        tool_error = rel_rms_error(outs[TOOL], outs[BF16_ACTIVATIONS])
        ratio = rel_rms_error(out, outs[TOOL]) / tool_error
        own = rel_rms_error(out, outs[BF16_ACTIVATIONS]) / tool_error
        swap = rel_rms_error(outs[GATE_UP_SWAPPED], outs[TOOL]) / tool_error
        visible = rel_rms_error(outs[BF16_GATE_UP_SWAPPED], outs[BF16_ACTIVATIONS])
        found[idx] = (max(ratio, own), swap, visible / tool_error)
        quantizer_measurements(
            f"{case_id}: layer {idx} std {std} W4A4",
            f"tool's own error {tool_error:.4f}; emulated, in tool's errors: "
            f"own error {own:.3f}, from the tool's function {ratio:.3f} "
            f"(gate/up swapped {swap:.2f})",
        )
    for idx, (_, swap, visible) in found.items():
        # The control misses wherever the swap moves the exact function by
        # more than MISS * W4A4_RATIO + 1 times the tool's W4A4 error (the
        # swapped and the right W4A4 function each carry that error, in
        # quadrature about one more); elsewhere no W4A4 comparison sees it.
        if visible > MISS * W4A4_RATIO + 1:
            assert swap > MISS * W4A4_RATIO, (idx, swap, visible)
    ratios = {idx: round(ratio, 3) for idx, (ratio, _, _) in found.items()}
    assert max(ratios.values()) <= W4A4_RATIO, ratios


@pytest.mark.parametrize("case_id", _params(w4a4_only=True))
def test_global_scale_one_misses_the_w4a4_criterion_at_small_std(
    case_id, quantized_case, quantizer_measurements
):
    """The tool's own W4A4 function with activation global scales of 1 (the
    tool's quantizer, scale 1 given explicitly): what a layer that ignores
    the calibrated scales computes. At the smallest input std its error
    against the BF16-activation function blows up (the FC2 input's E4M3
    block scales, block amax / 6, underflow to zero) and the acceptance
    criterion rejects it by far; at std 2 nothing underflows and it is about
    as far from the tool's function as an independent NVFP4 rounding."""
    case = quantized_case(*_CASES[case_id])
    low = min(INPUT_STDS)
    for idx, ref in case.layers.items():
        ratios, errors = {}, {}
        for std in INPUT_STDS:
            outs = ref.outputs[std]
            tool_error = rel_rms_error(outs[TOOL], outs[BF16_ACTIVATIONS])
            one = outs[GLOBAL_SCALE_ONE]
            ratios[std] = rel_rms_error(one, outs[TOOL]) / tool_error
            errors[std] = (rel_rms_error(one, outs[BF16_ACTIVATIONS]), tool_error)
        quantizer_measurements(
            f"{case_id}: layer {idx} global scale 1: its error / the tool's, "
            "and its ratio, by std",
            ", ".join(
                f"{s}: {e:.3f} / {t:.3f}, {ratios[s]:.2f}"
                for s, (e, t) in errors.items()
            ),
        )
        assert errors[low][0] > MISS * errors[low][1], errors
        assert ratios[low] > MISS * W4A4_RATIO, ratios
