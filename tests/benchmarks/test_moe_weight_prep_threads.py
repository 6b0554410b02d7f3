# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``vllm bench moe-weight-prep`` prepares under the commands' policy
(``vllm.entrypoints.process_policy``): one intra-op thread on CPU."""

import torch

from vllm.benchmarks.moe_weight_prep import w4a4_layers
from vllm.benchmarks.moe_weight_prep.presets import MoEModelPreset
from vllm.benchmarks.moe_weight_prep.shard import RankShard
from vllm.benchmarks.moe_weight_prep.synthetic_weights import synthetic_layer_tensors


def test_the_benchmark_prepares_on_one_thread(two_threads, monkeypatch):
    # The measured behaviour of `vllm bench moe-weight-prep`: its bounded
    # steps on one intra-op thread (the library itself sets none).
    seen = []
    real = w4a4_layers._run_steps

    def run_steps(steps, *args):
        timed = [
            (n, lambda fn=fn: (seen.append(torch.get_num_threads()), fn()))
            for n, fn in steps
        ]
        return real(timed, *args)

    monkeypatch.setattr(w4a4_layers, "_run_steps", run_steps)
    preset = MoEModelPreset("tiny", "tiny", 1, 256, 4, 2, 128, "silu")
    cpu = torch.device("cpu")
    tensors = synthetic_layer_tensors(preset, 1, cpu, 0)
    records, _ = w4a4_layers._bounded_run(
        preset, RankShard(), tensors, cpu, 64 << 20, False
    )
    assert records and all(r.error is None for r in records)
    assert len(seen) == len(records) and set(seen) == {1}
    assert torch.get_num_threads() == 2
