#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The CUDA checks of the generic paths, for a lent GPU (any CUDA device; the
# b12x kernel itself needs SM120/121). Sized for a few minutes (each part has a
# timeout: 150 s, 60 s, 60 s); not yet timed on a GPU:
#   1. the CUDA-parametrized tests (reorder, meter, NVFP4 reference, the whole
#      preparation) — skipped on CPU;
#   2. the reorder benchmark on cuda (Qwen3.6-35B-A3B and DeepSeek-V3 shapes);
#   3. the main job on cuda, with --memory-limit enforced for real.
# Results land in ${OUT:-gpu_out}/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
# The tree from its root: no install step (the GPU machine has no index).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee "$out/device.txt"

timeout 150 python -m pytest tests -q -k cuda -p no:cacheprovider 2>&1 | tee "$out/pytest_cuda.txt" | tail -n 5

timeout 60 python benchmarks/kernels/benchmark_reorder_w1w3.py --devices cuda \
  --models qwen3.6-35b-a3b deepseek-v3 --json "$out/reorder_cuda.json" | tee "$out/reorder_cuda.txt"

timeout 60 python -m vllm.entrypoints.cli.main bench moe-weight-prep --model qwen3.6-35b-a3b --device cuda --num-layers 4 \
  --memory-limit 128MiB --no-progress --json "$out/prep_cuda.json" --plot "$out/prep_cuda.png" \
  | tee "$out/prep_cuda.txt"
