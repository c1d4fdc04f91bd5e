#!/usr/bin/env bash
# The verdict at the small shape (experiments/verdict_small.toml) on any CUDA machine, in pieces of at most
# SECONDS each (benchmarks/study.sh: each call runs or resumes the folders in order, stops the running one with
# SIGINT when its time is up, and packs what there is).
#
#   benchmarks/verdict_small/run.sh STATE DATA OUT SECONDS
#
# Folders, one process each: seed1 holds seed 1 run twice (--repeat 2: the run-to-run noise), seed2 and seed3
# one run each. `creditlab compare --merge STATE/seed1 STATE/seed2 STATE/seed3 --out DIR` joins them.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec bash "$here/../study.sh" "${EXPERIMENT:-experiments/verdict_small.toml}" "$@" \
  "seed1:--seeds 1 --repeat 2" "seed2:--seeds 2" "seed3:--seeds 3"
