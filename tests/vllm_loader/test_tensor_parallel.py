# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallelism on CPU: two worker processes (``tensor_parallel_rank.py``)
join vLLM's own parallel state on gloo (world size 2, TP=2), each loads its
shard of a synthetic ModelOpt NVFP4 checkpoint through vLLM's loader with the
series on the b12x backend and prepares it.

    checkpoint (tiny: E=8, H=256, I=256)
      |-- rank 0 (TP=2): experts' I in [0, 128)    --+
      |-- rank 1 (TP=2): experts' I in [128, 256)  --+-- records, peaks
      '-- shard r written as a checkpoint of its own (I=128), loaded in this
          process (TP=1): what a single process prepares for that shard

Exact check: each rank's MoE layers (every tensor reachable under
``model.layers.N.mlp.``, layouts and bytes) equal the single process's for
its shard. Memory: each rank's per-layer peak is one expert's w13 half and
its block-scale half of the shard.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_loading import load_model
from model_tensors import differences, records
from safetensors.torch import load_file, save_file

from nvfp4_checkpoint import PRESETS, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("vllm_cpu")]

TINY = PRESETS["tiny"]
TP, LAYERS = 2, 2
HERE = Path(__file__).resolve().parent
SHARD_I = TINY.intermediate_size // TP
# The reorder's buffer: one expert's gate (or up) codes of the shard and their
# block scales. Besides, float32 per-expert vectors the quant method makes
# meanwhile (a global-scale column, 1 / input scale, ...), a few at once.
W13_HALF = SHARD_I * TINY.hidden_size // 2
SCALE_HALF = SHARD_I * TINY.hidden_size // 16
PER_EXPERT = 8 * 4 * TINY.num_experts


def _shard(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of checkpoint tensor ``name``, as vLLM's MoE
    weight loader narrows it: gate/up rows, down columns (packed: 2 codes a
    byte, a block scale per 16)."""
    if ".mlp.experts." not in name or t.dim() == 0:
        return t
    if ".down_proj." in name:
        cols = t.shape[1] // TP
        return t[:, rank * cols : (rank + 1) * cols].contiguous()
    return t[rank * SHARD_I : (rank + 1) * SHARD_I].contiguous()


def _write_shard(checkpoint: Path, out: Path, rank: int) -> Path:
    """``checkpoint`` as rank ``rank`` of TP=2 sees its experts, written as a
    checkpoint of its own (moe_intermediate_size halved)."""
    out.mkdir()
    for path in checkpoint.iterdir():
        if path.suffix == ".safetensors":
            tensors = {n: _shard(n, t, rank) for n, t in load_file(path).items()}
            save_file(tensors, out / path.name, metadata={"format": "pt"})
        else:
            shutil.copy(path, out / path.name)
    config = json.loads((out / "config.json").read_text())
    config["moe_intermediate_size"] = SHARD_I
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The checkpoint and each rank's results (``tensor_parallel_rank.py``)."""
    tmp = tmp_path_factory.mktemp("tp")
    checkpoint = write_checkpoint(tmp / "checkpoint", TINY, LAYERS, "modelopt")
    benchmarks = HERE.parents[1] / "benchmarks"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, (HERE, benchmarks))),
        "VLLM_TARGET_DEVICE": "cpu",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-P", HERE / "tensor_parallel_rank.py", str(rank)]
            + [str(TP), checkpoint, tmp / "init", tmp / f"rank{rank}.json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(TP)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-3000:]
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(TP)]
    return checkpoint, results


def test_each_ranks_peak_is_one_expert_half_of_its_shard(ranks, record_property):
    _, results = ranks
    record_property("peaks", [r["peaks"] for r in results])
    record_property("bound", W13_HALF + SCALE_HALF + PER_EXPERT)
    for result in results:
        assert len(result["peaks"]) == LAYERS
        for name, peak in result["peaks"].items():
            assert peak <= W13_HALF + SCALE_HALF + PER_EXPERT, name
            # Negative control: the same measurement sees a whole copy of the
            # rank's w13 (E times a half, twice).
            assert result["copies"][name] > W13_HALF + SCALE_HALF + PER_EXPERT


def test_each_rank_prepares_what_one_process_prepares_for_its_shard(ranks, tmp_path):
    checkpoint, results = ranks
    for rank, result in enumerate(results):
        shard = _write_shard(checkpoint, tmp_path / f"shard{rank}", rank)
        single = records(load_model(shard)[0])
        moe = [p for p in single if ".mlp." in p]
        assert len(moe) > 4 * LAYERS
        got = {p: r for p, r in result["records"].items() if ".mlp." in p}
        assert differences(got, {p: single[p] for p in moe}) == []
    # Not vacuous: the two ranks hold different halves.
    a, b = (
        {p: r for p, r in res["records"].items() if ".mlp.experts" in p}
        for res in results
    )
    assert differences(a, b)
