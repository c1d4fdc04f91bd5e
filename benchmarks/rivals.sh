#!/usr/bin/env bash
# The rivals study of benchmarks/rivals/: FDFA, calibrated DFA, the sketched product at three ranks, and the
# learned predictor under the warmup and adaptive schedules, at the fit study's settings (benchmarks/fit.sh: the
# seed model on pack:docs, 32,768 tokens per update, 450 updates), so that their seeds merge with the fit
# study's arms (native, zero, learned, ...) into one comparison; and each new arm's update time at the seed
# shape, arms interleaved.
#
#   benchmarks/rivals.sh run DATA OUT SEED       the new arms, one seed, into OUT/seed<SEED>
#   benchmarks/rivals.sh merge OUT FIT SEED...   OUT/merged: the new arms' seeds with FIT/seed* (benchmarks/fit)
#   benchmarks/rivals.sh cost OUT                s/update of every new arm at the seed shape (benchmarks/arms.py)
#
# DATA: a folder prepared by `benchmarks/competence.sh prepare DATA`. Any CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
case "$1" in
  run)
    EXPERIMENT=experiments/rivals.toml bash benchmarks/fit.sh run "$2" "$3" "$4" ;;
  merge)
    out=$2 fit=$3; shift 3
    folders=()
    for s in "$@"; do folders+=("$out/seed$s"); done
    python3 -m creditlab.cli compare --merge "$fit"/seed1 "$fit"/seed2 "$fit"/seed2b "$fit"/seed3 "${folders[@]}" \
      --out "$out/merged" ;;
  cost)
    python3 benchmarks/arms.py --out "$2/cost" --updates 12 \
      --arms native,zero,learned@credit.schedule=never,learned,dfa,dfa@credit.dfa_scale=calibrated@credit.schedule=never,dfa@credit.dfa_scale=calibrated@credit.teacher_every=1,fdfa@credit.schedule=never,fdfa@credit.teacher_every=1,sketch@credit.sketch_rank=16,sketch@credit.sketch_rank=32,sketch@credit.sketch_rank=64 ;;
  *) echo "usage: $0 run DATA OUT SEED | merge OUT FIT SEED... | cost OUT" >&2; exit 2 ;;
esac
