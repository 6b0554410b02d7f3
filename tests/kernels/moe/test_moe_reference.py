# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The routing, the activations and the torch reference MoE the other MoE
tests compare against."""

import pytest
import torch

from tests.kernels.moe.moe_reference import torch_experts, torch_topk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe import fused_topk


def test_fused_topk():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    x = torch.zeros(2, 8)
    weights, ids = fused_topk(x, logits, 2, renormalize=False)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [2, 3]]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights[0], probs[0, [1, 2]])
    weights, _ = fused_topk(x, logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights[0, 0] / weights[0, 1], torch.e * torch.ones(()))
    with pytest.raises(ValueError, match="topk must be in"):
        fused_topk(x, logits, 5, True)
    with pytest.raises(ValueError, match="gating_output must be"):
        fused_topk(x, logits[:1], 2, True)
    # The test reference routes the same way.
    for renormalize in (False, True):
        want = fused_topk(x, logits, 2, renormalize)
        got = torch_topk(logits, 2, renormalize)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_activations():
    gate = torch.tensor([[-2.0, 0.0, 1.0]])
    up = torch.tensor([[10.0, 20.0, 30.0]])
    out = MoEActivation.SILU.apply(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, gate * torch.sigmoid(gate) * up)
    # Control: the wrong order gives a different answer.
    assert not torch.allclose(out, up * torch.sigmoid(up) * gate)
    gelu = MoEActivation.GELU_TANH.apply(torch.cat([gate, up], dim=-1))
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(gelu, want)
    x = torch.tensor([-3.0, -0.5, 0.0, 0.5, 3.0])
    assert MoEActivation.RELU2_NO_MUL.apply(x).tolist() == [0, 0, 0, 0.25, 9.0]
    # vLLM's values, and this tree's short names.
    assert MoEActivation.RELU2_NO_MUL.value == "relu2_no_mul"
    assert not MoEActivation.RELU2_NO_MUL.is_gated and MoEActivation.SILU.is_gated
    assert MoEActivation.from_str("relu2") is MoEActivation.RELU2_NO_MUL
    assert MoEActivation.from_str("gelu_pytorch_tanh") is MoEActivation.GELU_TANH
    assert MoEActivation.SILU.fc1_rows(64) == 128
    assert MoEActivation.RELU2_NO_MUL.fc1_rows(64) == 64
    with pytest.raises(ValueError, match="unknown MoE activation"):
        MoEActivation.from_str("gelu")


@pytest.mark.parametrize("activation", list(MoEActivation), ids=lambda a: a.value)
def test_reference_matches_naive_per_token_loop(activation):
    gen = torch.Generator().manual_seed(21)
    t, e, h, i, k = 5, 4, 32, 16, 2
    gated = activation.is_gated
    w1 = torch.randn(e, 2 * i if gated else i, h, generator=gen).bfloat16()
    w2 = torch.randn(e, h, i, generator=gen).bfloat16()
    x = torch.randn(t, h, generator=gen).bfloat16()
    weights, ids = torch_topk(torch.randn(t, e, generator=gen), k, True)
    out = torch_experts(x, w1, w2, weights, ids, activation)
    for tok in range(t):
        acc = torch.zeros(h)
        for slot in range(k):
            ex = ids[tok, slot].item()
            hmid = w1[ex].float() @ x[tok].float()
            if activation is MoEActivation.SILU:
                hmid = torch.nn.functional.silu(hmid[:i]) * hmid[i:]
            elif activation is MoEActivation.GELU_TANH:
                gelu = torch.nn.functional.gelu(hmid[:i], approximate="tanh")
                hmid = gelu * hmid[i:]
            else:
                hmid = torch.relu(hmid) ** 2
            hmid = hmid.bfloat16().float()
            acc += weights[tok, slot] * (w2[ex].float() @ hmid)
        torch.testing.assert_close(out[tok], acc.bfloat16(), rtol=1.6e-2, atol=1e-2)


def test_reference_rejects_inconsistent_shapes():
    w1 = torch.zeros(4, 10, 32)
    w2 = torch.zeros(4, 32, 8)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        torch_experts(
            torch.zeros(2, 32),
            w1,
            w2,
            torch.ones(2, 1),
            torch.zeros(2, 1, dtype=torch.int32),
        )
