#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# The CUDA checks for a lent NVIDIA GPU (H100/H200: SM90, where the b12x kernel
# itself never runs), from the repository root with nothing installed beyond
# torch (no vLLM, no FlashInfer, no network):
#
#   PYTHONPATH=. bash benchmarks/run_gpu_checks.sh
#
# Runs benchmarks/kernels/benchmark_nvfp4_moe_prep_cuda.py on cuda: each PR's
# transform of the Qwen3.6-35B-A3B layer, the branch's (read from this
# repository's vllm/ fragments) against v0.34.0's algorithm: peak allocated,
# median time, bytes equality, exit status 1 on a difference. Not yet run on
# a GPU; with --device cpu it takes about 40 s on a 2-core machine, so the
# timeout (240 s) is generous and keeps the 15-minute device session, machine
# start included, well inside its budget. Results land in
# ${OUT:-gpu_out}/: device.txt, prep_cuda.txt, prep_cuda.json, status.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
py=${PYTHON:-python3}

$py - > "$out/device.txt" 2>&1 <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device"
print(torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(),
      "SM%d%d" % torch.cuda.get_device_capability())
EOF
rc=$?
cat "$out/device.txt"
if [ "$rc" -eq 0 ]; then
  timeout 240 $py benchmarks/kernels/benchmark_nvfp4_moe_prep_cuda.py \
    --device cuda --repeats 5 --json "$out/prep_cuda.json" > "$out/prep_cuda.txt" 2>&1
  rc=$?
  cat "$out/prep_cuda.txt"
fi
echo "prep_cuda rc=$rc" | tee "$out/status.txt"
exit "$rc"
