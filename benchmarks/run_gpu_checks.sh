#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The CUDA checks of the generic paths, for a lent GPU (any CUDA device; the
# b12x kernel itself needs SM120/121). Sized for a few minutes (each part has a
# timeout: 150 s, 60 s, 60 s, 90 s); not yet timed on a GPU:
#   1. the CUDA-parametrized tests (reorder, meter, NVFP4 reference, the whole
#      preparation) — skipped on CPU;
#   2. the reorder benchmark on cuda (Qwen3.6-35B-A3B and DeepSeek-V3 shapes);
#   3. the main job on cuda, with --memory-limit enforced for real;
#   4. the per-step CPU benchmark on that machine's cores, quiet and with one
#      busy core (a second machine's figures for the thread decision).
# A failing part does not stop the others; each part's exit status is in
# status.txt. Results land in ${OUT:-gpu_out}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
# The tree from its root: no install step (the GPU machine has no index).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
: > "$out/status.txt"
part() {  # part NAME LOG COMMAND...: run, keep its output, record its status
  local name=$1 log=$2
  shift 2
  "$@" > "$out/$log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$out/status.txt"
  tail -n 12 "$out/$log"
}
part device device.txt python3 -c "import torch; assert torch.cuda.is_available(), \
'no CUDA device'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"

part pytest_cuda pytest_cuda.txt timeout 150 python3 -m pytest tests -q -k cuda -p no:cacheprovider

part reorder_cuda reorder_cuda.txt timeout 60 python3 benchmarks/kernels/benchmark_reorder_w1w3.py \
  --devices cuda --models qwen3.6-35b-a3b deepseek-v3 --json "$out/reorder_cuda.json"

part prep_cuda prep_cuda.txt timeout 60 python3 -m vllm.entrypoints.cli.main bench moe-weight-prep \
  --model qwen3.6-35b-a3b --device cuda --num-layers 4 --memory-limit 128MiB --no-progress \
  --json "$out/prep_cuda.json" --plot "$out/prep_cuda.png"

part steps_cpu steps_cpu.txt timeout 90 python3 benchmarks/kernels/benchmark_moe_weight_prep_steps.py \
  --busy-cores 1 --repeats 3 --json "$out/steps_cpu.json"

! grep -qv "rc=0" "$out/status.txt"
