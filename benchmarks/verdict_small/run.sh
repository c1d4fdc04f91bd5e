#!/usr/bin/env bash
# The verdict at the small shape (experiments/verdict_small.toml) on any CUDA machine, in pieces of at most
# SECONDS each: every call runs or resumes the comparison's folders in order until its time is up, then stops
# the running one (SIGINT: every arm saved where it stands) and packs what there is.
#
#   benchmarks/verdict_small/run.sh STATE DATA OUT SECONDS
#
# STATE: where the comparisons live between calls (kept on the machine; checkpoints are 0.6 GB an arm).
# DATA:  pack:docs prepared there (made first if missing; set CREDITLAB_CACHE to the extracted-text cache).
# OUT:   what comes back: each folder's records without model states (tar.xz), its report if finished, the log.
#
# Folders, one process each (the runs of a folder share it): seed1 holds seed 1 run twice (--repeat 2: the
# run-to-run noise), seed2 and seed3 one run each. `creditlab compare --merge STATE/seed1 STATE/seed2
# STATE/seed3 --out DIR` joins them once all have finished.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
state=$1 data=$2 out=$3 seconds=$4
experiment=${EXPERIMENT:-experiments/verdict_small.toml}  # another file tries the script at a small size
start=$(date +%s)
mkdir -p "$state" "$out"
log="$state/log.txt"
left() { echo $((seconds - ($(date +%s) - start))); }
if [ ! -f "$data/manifest.json" ]; then
  python3 -m creditlab.cli data prepare --source pack:docs --out "$data" --no-progress 2>&1 | tail -n 12 | tee -a "$log"
fi
for spec in "seed1:--seeds 1 --repeat 2" "seed2:--seeds 2" "seed3:--seeds 3"; do
  folder=$state/${spec%%:*}
  [ -f "$folder/compare.json" ] && continue
  budget=$(( $(left) - 45 ))  # room to save every arm and pack
  [ "$budget" -lt 60 ] && break
  if [ -f "$folder/experiment.toml" ]; then
    what=(--resume "$folder")
  else
    # shellcheck disable=SC2206
    what=("$experiment" ${spec#*:} --set "data.dir=$data" --out "$folder")
  fi
  echo "== $(date -u +%H:%M:%S) ${what[*]} (for at most ${budget} s)" | tee -a "$log"
  timeout -s INT -k 60 "$budget" python3 -m creditlab.cli compare "${what[@]}" --no-progress >>"$log" 2>&1
  echo "== exit $?" | tee -a "$log"
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/device.txt" 2>&1
for folder in "$state"/seed*; do
  [ -d "$folder" ] || continue
  name=$(basename "$folder")
  tar -C "$state" -cJf "$out/$name.tar.xz" --exclude='*.pt' "$name"
done
grep -v '^eval after\|^round ' "$log" | tail -n 400 >"$out/log.txt"
ls -la "$out"
