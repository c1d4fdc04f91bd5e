#!/usr/bin/env bash
# A comparison study (an experiment file) on any CUDA machine, in pieces of at most SECONDS each: every call runs
# or resumes the study's folders in order until its time is up, then stops the running one (SIGINT: every arm
# saved where it stands) and packs what there is.
#
#   benchmarks/study.sh EXPERIMENT STATE DATA OUT SECONDS [FOLDER:FLAGS ...]
#
# STATE: where the comparisons live between calls (kept on the machine; checkpoints are 0.6 GB an arm at the
#        seed model's size).
# DATA:  pack:docs prepared there (made first if missing; set CREDITLAB_CACHE to the extracted-text cache).
# OUT:   what comes back: each folder's records without model states (tar.xz), the device, the log.
# FOLDER:FLAGS: one process each, e.g. "seed1:--seeds 1 --repeat 2"; by default seed1, seed2 and seed3, one seed
#        each. `creditlab compare --merge STATE/seed1 STATE/seed2 STATE/seed3 --out DIR` joins them once all
#        have finished.
# STUDY_WHOLE=1: start a new folder only where the time left covers the longest that a finished folder took (its
#        pieces summed, from STATE/durations.txt): for a last call, after which STATE is gone with the machine
#        and a folder begun would be lost.
set -uo pipefail
if [ $# -lt 5 ]; then
  echo "usage: benchmarks/study.sh EXPERIMENT STATE DATA OUT SECONDS [FOLDER:FLAGS ...]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
experiment=$1 state=$2 data=$3 out=$4 seconds=$5
shift 5
specs=("$@")
[ ${#specs[@]} -eq 0 ] && specs=("seed1:--seeds 1" "seed2:--seeds 2" "seed3:--seeds 3")
start=$(date +%s)
mkdir -p "$state" "$out"
log="$state/log.txt"
left() { echo $((seconds - ($(date +%s) - start))); }
# the longest time a finished folder took, its pieces summed (empty if none has finished)
longest_finished() {
  [ -f "$state/durations.txt" ] || return 0
  awk '{s[$1] += $2} END {for (n in s) print n, s[n]}' "$state/durations.txt" |
    while read -r name total; do [ -f "$state/$name/compare.json" ] && echo "$total"; done | sort -n | tail -n 1
}
if [ ! -f "$data/manifest.json" ]; then
  python3 -m creditlab.cli data prepare --source pack:docs --out "$data" --no-progress 2>&1 | tail -n 12 | tee -a "$log"
fi
for spec in "${specs[@]}"; do
  folder=$state/${spec%%:*}
  [ -f "$folder/compare.json" ] && continue
  budget=$(( $(left) - 45 ))  # room to save every arm and pack
  [ "$budget" -lt 60 ] && break
  if [ -f "$folder/experiment.toml" ]; then
    what=(--resume "$folder")
  else
    longest=$(longest_finished)
    if [ "${STUDY_WHOLE:-0}" = 1 ] && [ -n "$longest" ] && [ "$budget" -lt "$longest" ]; then
      echo "== not started: ${spec%%:*} (a finished folder took ${longest} s; ${budget} s left)" | tee -a "$log"
      break
    fi
    # shellcheck disable=SC2206
    what=("$experiment" ${spec#*:} --set "data.dir=$data" --out "$folder")
  fi
  echo "== $(date -u +%H:%M:%S) ${what[*]} (for at most ${budget} s)" | tee -a "$log"
  began=$(date +%s)
  timeout -s INT -k 60 "$budget" python3 -m creditlab.cli compare "${what[@]}" --no-progress >>"$log" 2>&1
  echo "== exit $?" | tee -a "$log"
  echo "$(basename "$folder") $(( $(date +%s) - began ))" >>"$state/durations.txt"
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/device.txt" 2>&1
for folder in "$state"/*/; do
  name=$(basename "$folder")
  [ -f "$folder/experiment.toml" ] || continue
  tar -C "$state" -cJf "$out/$name.tar.xz" --exclude='*.pt' "$name"
done
grep -v '^eval after\|^round ' "$log" | tail -n 400 >"$out/log.txt"
ls -la "$out"
