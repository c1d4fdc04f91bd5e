#!/usr/bin/env bash
# The competence comparison of benchmarks/competence/: the seed model on pack:docs, 32,768 tokens per update
# (micro-batch 16 x 2,048, no accumulation), 1,000 updates, DEV loss every 100 updates on a fixed subset.
#
#   benchmarks/competence.sh prepare DATA          prepare pack:docs into DATA (from the artifact/text cache)
#   benchmarks/competence.sh admit DATA RUNS       admit the comparison's config (admissions under RUNS)
#   benchmarks/competence.sh warm DATA OUT         3 updates of every arm: fills the compiler's on-disk cache
#   benchmarks/competence.sh run DATA OUT SEED     one seed of the comparison into OUT/seed<SEED>
#   benchmarks/competence.sh merge OUT SEED...     one report from the seeds' folders into OUT/merged
#   benchmarks/competence.sh heldout OUT RUNS ID   FINAL_HELDOUT of every model of OUT/merged, in one read
#
# Each seed runs in its own process; within a seed all arms run interleaved in one process (compare.py). Any
# CUDA machine; set CREDITLAB_CACHE to the folder holding the pack's cached artifacts or extracted text.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
# The comparison itself is experiments/competence.toml; the settings below are its, for `admit`.
settings() {
  echo --preset seed --set data.source=shards --set "data.dir=$1" \
    --set train.micro_batch=16 --set train.grad_accum=1 --set train.eval_every=100 \
    --set train.eval_tokens=262144 --set compare.align_every=50
}
case "$1" in
  prepare)
    python3 -m creditlab.cli data prepare --source pack:docs --out "$2" --no-progress
    python3 -m creditlab.cli data info "$2" ;;
  admit)
    # shellcheck disable=SC2046
    python3 -m creditlab.cli admit $(settings "$2") --set train.updates=1000 --set "train.out_dir=$3" ;;
  heldout)
    python3 -m creditlab.cli heldout "$2/merged" --out-dir "$3" --admission "$4" ;;
  warm)
    python3 -m creditlab.cli compare experiments/competence.toml --set "data.dir=$2" --set train.updates=3 \
      --set train.eval_tokens=32768 --seeds 1 --no-progress --out "$3/warm" ;;
  run)
    python3 -m creditlab.cli compare experiments/competence.toml --set "data.dir=$2" --seeds "$4" --no-progress \
      --out "$3/seed$4" ;;
  merge)
    out=$2; shift 2
    python3 -m creditlab.cli compare --merge $(for s in "$@"; do echo "$out/seed$s"; done) --out "$out/merged" ;;
  *) echo "usage: $0 prepare DATA | admit DATA RUNS | warm DATA OUT | run DATA OUT SEED | merge OUT SEED... |" \
          "heldout OUT RUNS ID" >&2; exit 2 ;;
esac
