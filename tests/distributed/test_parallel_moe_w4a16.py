# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""W4A16 expert parallelism across real processes (gloo on CPU).

Two spawned ranks each hold half of the experts of one W4A16 layer (the
emulated b12x experts, which take global expert ids and an ``expert_map``
as the kernel does), prepare them and run ``forward`` with
``reduce_results=True``: every rank must return the single-process output.
Tolerance as tests/distributed/test_parallel_moe.py (three BF16 roundings
of partials instead of one: 0.006). Negative control: both ranks claim rank
0's experts (summed by hand: a reducing layer refuses two ranks holding the
same shard), so the sum counts those twice and misses the others.
"""

import pytest
import torch

from tests.kernels.moe.nvfp4_w4a16_utils import w4a16_layer
from tests.kernels.moe.test_nvfp4_moe_prep_state import _load_through_loader
from tests.kernels.moe.utils import (
    bf16_experts,
    quantize_experts_modelopt,
    rel_rms_error,
)
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.launcher import spawn_workers

TOL = 0.006
E, H, I_SIZE = 8, 256, 128


def _layer(gated, **parallel):
    return w4a16_layer(E, H, I_SIZE, gated, place_w3w1=None, top_k=4, **parallel)


def _tensors(gated):
    w1, w2 = bf16_experts(E, I_SIZE, H, gated=gated, seed=31)
    w1, w2 = w1.float() * 0.02 * H**0.5, w2.float() * 0.02 * I_SIZE**0.5
    return quantize_experts_modelopt(w1, w2, gated)


def _run(tensors, gated, x, logits, **parallel):
    layer = _layer(gated, **parallel)
    _load_through_loader(layer, tensors)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, layer(x, logits)


def _worker(rank, x, logits):
    assert get_tensor_model_parallel_rank() == rank
    out = {}
    for gated in (True, False):
        tensors = _tensors(gated)
        layer, y = _run(
            tensors, gated, x, logits, enable_expert_parallel=True, reduce_results=True
        )
        emap = layer.expert_map
        out[gated] = {"y": y, "map": emap.tolist(), "local": layer.local_num_experts}
        # Control: both ranks hold rank 0's experts (the layer refuses that
        # with reduce_results=True, so the partials are summed here).
        _, partial = _run(
            tensors, gated, x, logits, tp_rank=0, tp_size=1, ep_rank=0, ep_size=2
        )
        out[gated]["wrong"] = tensor_model_parallel_all_reduce(partial)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, H, generator=gen).bfloat16()
    logits = torch.randn(16, E, generator=gen)
    reference = {g: _run(_tensors(g), g, x, logits)[1] for g in (True, False)}
    results = spawn_workers(_worker, 2, args=(x, logits), timeout_s=600, deadline_s=600)
    return results, reference


@pytest.mark.parametrize("gated", [True, False], ids=["silu", "relu2"])
def test_w4a16_expert_parallel_equals_single_process(two_ranks, gated):
    results, reference = two_ranks
    for rank, result in enumerate(results):
        r = result[gated]
        assert r["local"] == E // 2
        # Rank r holds global experts [4r, 4r + 4) at local 0..3.
        assert r["map"] == [e - 4 * rank if e // 4 == rank else -1 for e in range(E)]
        err = rel_rms_error(r["y"], reference[gated])
        assert err < TOL, f"rank {rank}: {err:.4f}"
        control = rel_rms_error(r["wrong"], reference[gated])
        assert control > 50 * TOL, f"rank {rank}: both hold rank 0's: {control:.4f}"
    assert torch.equal(results[0][gated]["y"], results[1][gated]["y"])
