#!/usr/bin/env bash
# The fit study of benchmarks/fit/: the seed model on pack:docs at the competence shape (32,768 tokens per
# update), the predictor families trained side by side, their fit ceilings at three model states, and the
# teacher's cost per family at the seed shape.
#
#   benchmarks/fit.sh smoke OUT                 a few compiled tiny updates of every new source (catches a
#                                               compiler failure before the long run)
#   benchmarks/fit.sh run DATA OUT SEED         experiments/fit.toml, one seed; the fitted arms' states every
#                                               150 updates (all kept: the ceilings read each)
#   benchmarks/fit.sh ceilings OUT SEED         the fit ceiling at each checkpoint of the fitted arms
#   benchmarks/fit.sh cost OUT                  teacher and synthetic updates per family, arms interleaved
#
# DATA: a folder prepared by `benchmarks/competence.sh prepare DATA`. Any CUDA machine.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
EXPERIMENT=${EXPERIMENT:-experiments/fit.toml}  # the comparison; rivals.sh runs its own through this script
case "$1" in
  smoke)
    python3 -m creditlab.cli compare --preset tiny --set train.updates=6 --set credit.teacher_every=2 \
      --set train.eval_every=0 --set train.eval_tokens=4096 --no-progress \
      --arms "typed@credit.fit=lstsq,fitted_feedback@credit.fit=lstsq,fitted_feedback,dfa" --out "$2/smoke" ;;
  run)
    python3 -m creditlab.cli compare "$EXPERIMENT" --set "data.dir=$2" --seeds "$4" --no-progress \
      --out "$3/seed$4" ;;
  ceilings)
    for arm in "$2/seed$3"/*-seed"$3"; do
      for ck in "$arm"/checkpoint_*.pt; do
        [ -e "$ck" ] || continue
        name=$(basename "$arm")_$(basename "$ck" .pt)
        python3 -m creditlab.cli ceiling --run "$ck" --batches 4 --out "$2/ceilings/$name"
      done
    done ;;
  cost)
    python3 benchmarks/arms.py --out "$2/cost" --updates 12 \
      --arms native,zero,learned@credit.schedule=never,typed@credit.schedule=never,fitted_feedback@credit.schedule=never,learned@credit.teacher_every=1,learned@credit.teacher_every=1@credit.fit=lstsq,typed@credit.teacher_every=1@credit.fit=lstsq,fitted_feedback@credit.teacher_every=1@credit.fit=lstsq ;;
  *) echo "usage: $0 smoke OUT | run DATA OUT SEED | ceilings OUT SEED | cost OUT" >&2; exit 2 ;;
esac
