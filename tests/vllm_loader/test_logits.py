# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The function, inside vLLM: a tiny Qwen3-MoE whose experts are quantized to
NVFP4 for real (``tiny_qwen3_moe.py``), loaded as a ModelOpt checkpoint by
vLLM 0.34.0's own loader with the series (``moe_backend="flashinfer_b12x"``),
run by vLLM's own forward, against transformers running the checkpoint.

    vLLM: load_model -> model(input_ids, positions) -> compute_logits
          (b12x launch: its arithmetic in torch, upstream's
          _TorchB12xMoEWrapper; attention: causal SDPA; RoPE: torch's)
    transformers: Qwen3MoeForCausalLM, experts = the checkpoint's decoded
          weights, float32; "w4a4": their inputs also NVFP4-quantized at the
          checkpoint's input scales, as a W4A4 kernel quantizes them

Metrics over ``TOKENS`` (one sequence per forward): the median over tokens of
``1 - cosine`` of each token's logits, and the fraction of tokens whose top-1
differs. W4A4 amplifies rounding (a BF16 rounding that moves an activation
across an FP4 decision changes a code; a near-tied route flips), so a few
tokens land far apart in any low-precision run: the median and the fraction
are robust to them. Tolerances are ``K`` times a yardstick computed in the
test (flash-attention's low-precision-reference rule): the same reference in
BF16, or, against the decoded weights alone, the W4A4 function's own
distance from them. The negative control, the checkpoint with each expert's
gate and up tensors swapped, misses both.
"""

from typing import NamedTuple

import pytest
import tiny_qwen3_moe as tiny
import torch
from cpu_loading import load_model
from upstream_b12x_test import b12x_test_module

from vllm_cpu_stand_ins import (
    b12x_kernels_in_torch,
    causal_sdpa_attention,
)

TOKENS = (8, 32)  # sequences x tokens, random ids, seeded
K = 2.0


class Distance(NamedTuple):
    cosine: float  # median over tokens of 1 - cosine
    top1: float  # fraction of tokens whose argmax differs

    def within(self, k: float, yardstick: "Distance") -> bool:
        return self.cosine <= k * yardstick.cosine and self.top1 <= k * yardstick.top1


def _distance(logits: torch.Tensor, ref: torch.Tensor) -> Distance:
    cos = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    top1 = (logits.argmax(-1) != ref.argmax(-1)).float().mean()
    return Distance((1 - cos).median().item(), top1.item())


def _tokens() -> torch.Tensor:
    return torch.randint(tiny.VOCAB, TOKENS, generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _transformers_logits(model) -> torch.Tensor:
    """float32 [sequences * tokens, vocab]."""
    return model(_tokens()).logits.float().reshape(-1, tiny.VOCAB)


@torch.inference_mode()
def _vllm_logits(checkpoint) -> torch.Tensor:
    """float32 [sequences * tokens, vocab] from vLLM's forward, one sequence
    at a time, positions from 0, no KV cache."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    # RoPE's custom op is vLLM's compiled one; "-rotary_embedding" selects
    # upstream's torch implementation.
    custom_ops = {"custom_ops": ["-rotary_embedding"]}
    model, cfg = load_model(checkpoint, compilation_config=custom_ops)
    logits = []
    with (
        causal_sdpa_attention(),
        b12x_kernels_in_torch(b12x_test_module()._TorchB12xMoEWrapper),
        set_forward_context(None, cfg),
    ):
        for ids in _tokens():
            hidden = model(input_ids=ids, positions=torch.arange(len(ids)))
            logits.append(model.compute_logits(hidden).float())
    # The series' b12x experts ran, through the stand-in of the launch.
    wrapper = b12x_test_module()._TorchB12xMoEWrapper
    for layer in model.model.layers:
        kernel = layer.mlp.experts.routed_experts.quant_method.moe_kernel
        assert type(kernel.fused_experts) is FlashInferB12xExperts
        assert isinstance(kernel.fused_experts._wrapper, wrapper)
    return torch.cat(logits)


@pytest.fixture(scope="module")
def logits(tmp_path_factory, vllm_cpu) -> dict[str, torch.Tensor]:
    """Each side's logits: vLLM on the checkpoint and on its gate/up-swapped
    control; transformers' references."""
    out = tmp_path_factory.mktemp("tiny_qwen3_moe")
    bf16 = tiny.bf16_model()
    quantized = tiny.quantize(bf16)
    checkpoint = tiny.write_modelopt_checkpoint(bf16, quantized, out / "nvfp4")
    swapped = tiny.write_modelopt_checkpoint(
        bf16, quantized, out / "swapped", swap_gate_up=True
    )
    return {
        "vllm": _vllm_logits(checkpoint),
        "vllm_swapped": _vllm_logits(swapped),
        "w4a4": _transformers_logits(tiny.decoded_model(bf16, quantized)),
        "w4a4_bf16": _transformers_logits(
            tiny.decoded_model(bf16, quantized, torch.bfloat16)
        ),
        "decoded": _transformers_logits(
            tiny.decoded_model(bf16, quantized, w4a4=False)
        ),
    }


def test_logits_match_the_checkpoints_w4a4_function(logits, record_property):
    ref = logits["w4a4"]
    yardstick = _distance(logits["w4a4_bf16"], ref)
    got = _distance(logits["vllm"], ref)
    record_property("distances", {"vllm": got, "bf16_reference": yardstick})
    assert got.within(K, yardstick)
    # Negative control: gate and up swapped misses both metrics, the cosine
    # by more than ten times the tolerance.
    swapped = _distance(logits["vllm_swapped"], ref)
    record_property("swapped", swapped)
    assert swapped.cosine > 10 * K * yardstick.cosine
    assert swapped.top1 > K * yardstick.top1


def test_logits_match_the_decoded_weights_but_for_activation_quantization(
    logits, record_property
):
    """Against the decoded weights alone (float32 activations), vLLM's W4A4
    logits are as far as the checkpoint's W4A4 function is."""
    ref = logits["decoded"]
    yardstick = _distance(logits["w4a4"], ref)
    got = _distance(logits["vllm"], ref)
    record_property("distances", {"vllm": got, "w4a4_reference": yardstick})
    assert got.within(K, yardstick)
    swapped = _distance(logits["vllm_swapped"], ref)
    record_property("swapped", swapped)
    assert swapped.cosine > 5 * K * yardstick.cosine
    assert swapped.top1 > K * yardstick.top1
