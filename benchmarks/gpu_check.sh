#!/usr/bin/env bash
# The one GPU check (issue 8): run through the device tool on a lent GPU machine, in well under 8 minutes.
#   device run: bash benchmarks/gpu_check.sh      (carry .whl if packages are missing there)
# Prints the device, runs the GPU-marked tests (Triton kernels vs the torch reference, greedy equality with
# speculation on the GPU), then benchmarks/gpu_check.py (decode tok/s vs the HBM roofline for the demo model
# and a random ~1B Llama; ngram speculation off/on at batch 1 and 32; batch-1 decode with graphs vs
# --enforce-eager); with more than one GPU, tensor parallel at 2 ranks. JSON goes to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || rocm-smi 2>/dev/null || true
$PY -m specserve.cli env
mkdir -p "${OUT:-/tmp/gpu_check}"
timeout 240 $PY -m pytest -q -m gpu tests/ 2>&1 | tee "${OUT:-/tmp/gpu_check}/gpu_tests.log" | tail -25
timeout 300 $PY benchmarks/gpu_check.py --out "${OUT:-/tmp/gpu_check}"
# Tensor parallel: only where more than one GPU is visible (TP=1 vs TP=2 on the demo model).
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -gt 1 ]; then
  timeout 240 $PY -m pytest -q -m gpu tests/test_gpu.py -k tensor_parallel 2>&1 | tail -5
  timeout 300 $PY benchmarks/tensor_parallel.py --device cuda --repeats 2 --out "${OUT:-/tmp/gpu_check}"
fi
