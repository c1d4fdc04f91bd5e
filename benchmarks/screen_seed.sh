#!/usr/bin/env bash
# The seed resource screen under an admission, then the seed's situation replayed under a per-process memory cap
# emulating a 24 GB card (24,111 MiB free at prelaunch). (A materialized synthetic arm under the same cap ran here
# until credit.materialized was deleted: benchmarks/LOG.md.)
#   bash benchmarks/screen_seed.sh OUT_DIR [DATA_DIR]
# With SCREENS=admitted only the screen under the admission runs; PRESET names another preset (e.g. seed-w1536:
# the screen at another width), `seed` by default.
set -uo pipefail
out=${1:?output folder}; data=${2:-data/prose}
mkdir -p "$out"
runs=$(mktemp -d)
cli="python3 -m creditlab.cli"
common=(--preset "${PRESET:-seed}" --set data.source=shards --set "data.dir=$data" --set "train.out_dir=$runs")
admitted=$($cli admit "${common[@]}" --json) || { echo "no admission made (see above); nothing screened" >&2; exit 2; }
adm=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["admission"])' "$admitted")
echo "admission $adm"
$cli screen --admission "$adm" --out-dir "$runs" 2>&1 | tee "$out/screen_admitted.log" | grep -vE "^ *(native|synthetic) \| update"
if [ "${SCREENS:-all}" != admitted ]; then
  $cli screen "${common[@]}" --set screen.memory_cap_mib=24111 2>&1 | tee "$out/screen_24gb_streaming.log" | tail -4
fi
# The records without the copies of the package a screen keeps beside them (frozen/, source/): the admission's
# hashes and git commit name the sources.
tar czf "$out/screen_records.tgz" --exclude='*/frozen' --exclude='*/source' -C "$runs" .
