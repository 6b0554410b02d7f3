# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""tests/vllm_loader: NVFP4 MoE checkpoints loaded and prepared by vLLM 0.34.0's
own loader with the series, ``moe_backend="flashinfer_b12x"``, on CPU.

Helpers, each named for its job: ``cpu_loading`` (engine config, gloo world,
``load_model``), ``model_tensors`` (every reachable tensor's bytes and
address), ``upstream_b12x_test`` (upstream's b12x test module, imported
from the tree), ``tiny_qwen3_moe`` (a tiny model quantized for real),
``w4a16_checkpoints``, ``preparation_peaks`` (each MoE layer's preparation
measured in the loader) and ``tensor_parallel_rank`` (one rank of a TP
world, a script).

Every stand-in is ``benchmarks/vllm_cpu_stand_ins.py``'s. The helpers import
each other by bare name, as ``benchmarks/``'s scripts do,
so that a worker process (``tensor_parallel_rank.py``) runs them unchanged:
this directory goes on ``sys.path`` (never the repository root, whose
``vllm/`` holds fragments).

Fixture ``vllm_cpu`` (per module): vLLM's parallel state, one rank on gloo,
with the loading stand-ins held, for the module's loads in this process.
"""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE))

from cpu_loading import vllm_world  # noqa: E402


@pytest.fixture(scope="module")
def vllm_cpu(tmp_path_factory: pytest.TempPathFactory):
    with vllm_world(tmp_path_factory.mktemp("gloo") / "init"):
        yield
