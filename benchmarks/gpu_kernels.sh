#!/usr/bin/env bash
# Every kernel the training step runs on CUDA, at the seed model's shapes in bf16, against float64
# (tests/test_gpu_kernels.py: the Triton kernels, on compute capability 9 the Gluon ones too, and the FP8 head's).
#
#   benchmarks/gpu_kernels.sh OUT
#
# Writes OUT/gpu_kernels.jsonl (one line of measured errors, bounds and wrong-variant errors a test) and
# OUT/gpu_kernels.log (the tests' log). Exits non-zero when a test fails. Any CUDA machine.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: benchmarks/gpu_kernels.sh OUT" >&2
  exit 2
fi
mkdir -p "$1"
out=$(cd "$1" && pwd)
cd "$(dirname "$0")/.."
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "no CUDA device: the GPU tests would only skip" >&2
  exit 2
fi
rm -f "$out/gpu_kernels.jsonl"  # this run's lines only
CREDITLAB_GPU_RESULTS="$out" python3 -m pytest -m gpu tests/test_gpu_kernels.py -v -rs 2>&1 | tee "$out/gpu_kernels.log"
