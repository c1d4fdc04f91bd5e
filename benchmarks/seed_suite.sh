#!/usr/bin/env bash
# Every seed-preset measurement of the benchmark pages in one go (about 8 minutes on one H200, most of it
# compilation): the head-loss kernel's configurations, the six arms side by side with a kernel profile and a
# breakdown of the native memory peak, and what one compiled forward keeps.
#   bash benchmarks/seed_suite.sh OUT_DIR
set -uo pipefail
out=${1:?output folder}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 "$here/softcap_ce.py" --out "$out/softcap_ce" 2>&1 | tail -15
python3 "$here/arms.py" --out "$out/arms" --arms native,native_plain,zero,learned,learned_materialized,teacher \
  --profile native --memory native 2>&1 | grep -v "^update" | tail -20
python3 "$here/kept.py" --out "$out/kept" 2>&1 | head -16
