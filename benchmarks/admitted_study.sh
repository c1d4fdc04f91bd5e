#!/usr/bin/env bash
# An admitted study on any CUDA machine: a new admission at the experiment's preset and data, the seed's resource
# screen under it (its verdict recorded in the admission's ledger), the experiment's comparison with all its seeds
# in one folder, then FINAL_HELDOUT under the admission for every final model of that comparison in its one read.
# In pieces of at most SECONDS each, like benchmarks/study.sh: every call goes on from where the last stopped.
#
#   benchmarks/admitted_study.sh EXPERIMENT STATE DATA OUT SECONDS
#
# STATE: kept on the machine between calls: the admission (STATE/runs/admissions/), the screen's record, the
#        comparison (STATE/study/all, with its model states, which the held-out read needs).
# DATA:  pack:docs prepared there (made first if missing; set CREDITLAB_CACHE to the extracted-text cache).
# OUT:   what comes back: admit.json, screen.log, screen.tar.xz (the screen's record and the admission, without
#        the package copies they keep), all.tar.xz (the comparison's records without model states, with
#        heldout-<admission>.json once read), heldout.json, log.txt, device.txt.
set -uo pipefail
if [ $# -ne 5 ]; then
  echo "usage: benchmarks/admitted_study.sh EXPERIMENT STATE DATA OUT SECONDS" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
experiment=$1 state=$2 data=$3 out=$4 seconds=$5
start=$(date +%s)
left() { echo $((seconds - ($(date +%s) - start))); }
mkdir -p "$state/runs" "$out"
log="$state/log.txt"
cli=(python3 -m creditlab.cli)
# The experiment's preset and its model (the screen's protocol sets the rest: updates, seed, batch).
mapfile -t admitted < <(python3 -c '
import sys, tomllib
exp = tomllib.load(open(sys.argv[1], "rb"))
print("--preset"); print(exp.get("preset", "tiny"))
for key, value in exp.get("model", {}).items():
    print("--set"); print(f"model.{key}={value}")' "$experiment") && [ ${#admitted[@]} -ge 2 ] \
  || { echo "cannot read the experiment file $experiment" >&2; exit 2; }
if [ ! -f "$data/manifest.json" ]; then
  "${cli[@]}" data prepare --source pack:docs --out "$data" --no-progress 2>&1 | tail -n 3 | tee -a "$log"
fi
# The admission: the experiment's model on the data, the run records beside it (the same files give the same id).
if [ ! -f "$state/admit.json" ]; then
  "${cli[@]}" admit "${admitted[@]}" --set data.source=shards --set "data.dir=$data" \
    --set "train.out_dir=$state/runs" --out-dir "$state/runs" --json >"$state/admit.json.part" 2>>"$log" \
    && mv "$state/admit.json.part" "$state/admit.json" || { echo "no admission made: $log" >&2; exit 2; }
fi
admission=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["admission"])' "$state/admit.json")
echo "== admission $admission (${admitted[*]})" | tee -a "$log"
# The screen, once per admission (an admission that already holds a verdict keeps it: admit.json names it).
if [ ! -f "$state/screen.log" ] && [ "$(left)" -gt 90 ]; then
  timeout -s INT -k 30 $(( $(left) - 45 )) "${cli[@]}" screen --admission "$admission" --out-dir "$state/runs" \
    >"$state/screen.log.part" 2>&1
  status=$?
  echo "== screen exit $status" | tee -a "$log"
  tail -n 3 "$state/screen.log.part" | tee -a "$log"
  # a screen stopped before its verdict runs again next time; one that ended (any verdict, or refused) is kept
  [ "$status" -ne 124 ] && [ "$status" -ne 130 ] && mv "$state/screen.log.part" "$state/screen.log"
fi
# The comparison: every seed in one folder, so that one held-out read covers all its final models.
bash benchmarks/study.sh "$experiment" "$state/study" "$data" "$state/pack" "$(left)" "all:" >>"$log" 2>&1
folder=$state/study/all
if [ -f "$folder/compare.json" ] && [ ! -f "$state/heldout.json" ]; then
  "${cli[@]}" heldout --admission "$admission" --out-dir "$state/runs" "$folder" --json \
    >"$state/heldout.json.part" 2>>"$log" && mv "$state/heldout.json.part" "$state/heldout.json"
  echo "== heldout exit $?" | tee -a "$log"
fi
# What comes back.
cp "$state/admit.json" "$out/"
for f in screen.log heldout.json; do [ -f "$state/$f" ] && cp "$state/$f" "$out/"; done
tar -C "$state" -cJf "$out/screen.tar.xz" --exclude='*/frozen' --exclude='*/source' --exclude='*.pt' runs
[ -f "$folder/experiment.toml" ] && tar -C "$state/study" -cJf "$out/all.tar.xz" --exclude='*.pt' all
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/device.txt" 2>&1
grep -v '^eval after\|^round ' "$log" | tail -n 400 >"$out/log.txt"
ls -la "$out"
