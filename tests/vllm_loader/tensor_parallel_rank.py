# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One rank of a tensor-parallel world on CPU, run as a script:

    python tensor_parallel_rank.py RANK TP CHECKPOINT INIT_FILE OUT_JSON

joins vLLM's parallel state on gloo (world size TP, this process RANK),
loads its shard of CHECKPOINT through vLLM's own loader with the b12x
backend, and writes to OUT_JSON, per MoE layer, the peak of its preparation
and of a whole copy of its prepared ``w13_weight`` (the measurement's
control), and the records of every tensor reachable from the model
(``model_tensors.records``).

Run with this directory and ``benchmarks/`` on PYTHONPATH (the helpers import
each other by bare name) and ``VLLM_TARGET_DEVICE=cpu``.
"""

import json
import sys

import torch
from cpu_loading import engine_config, vllm_world
from model_tensors import records
from preparation_peaks import load_model_measured, peak_bytes


def main(rank: str, tp: str, checkpoint: str, init_file: str, out: str) -> None:
    cfg = engine_config(checkpoint, tensor_parallel_size=int(tp))
    with vllm_world(init_file, cfg, rank=int(rank)):
        model, _, peaks = load_model_measured(checkpoint, tensor_parallel_size=int(tp))
        copies = {
            name: peak_bytes(model.get_submodule(name).w13_weight.clone)
            for name in peaks
        }
        result = {"peaks": peaks, "copies": copies, "records": records(model)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
