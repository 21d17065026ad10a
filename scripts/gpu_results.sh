#!/usr/bin/env bash
# Every measurement the repository commits, in one device call (the H200 of this workplace):
#   OUT=/some/dir bash scripts/gpu_results.sh
# 1. the one-layer attention table (paged 16/64/128 vs arena vs FlashInfer fa2) -> $OUT/table
# 2. `bench decode` with its defaults                                            -> $OUT/bench
# 3. `tuner sweep default`                                                       -> $OUT/sm90.db
# Each stage has a time limit so a slow stage cannot starve the others.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export DRAFTER_CACHE_DIR=${DRAFTER_CACHE_DIR:-/tmp/drafter-cache} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer} MAX_JOBS=${MAX_JOBS:-16}
db=/tmp/sm90.db
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout ${T_TABLE:-200} python3 -m bench.attention_table --reps 50 --out "$OUT/table" | grep -v "^{"
  timeout ${T_BENCH:-200} python3 -m bench.cli decode --impl cupy --db "$db" --out "$OUT/bench" --reps 50
  timeout ${T_SWEEP:-150} python3 -m tuner sweep default --db "$db" --no-progress
  python3 -m tuner show --db "$db" --limit 60
} > "$OUT/run.log" 2>&1
python3 -c "import sqlite3, sys; sqlite3.connect('$db').execute(\"VACUUM INTO '$OUT/sm90.db'\")"
tail -n 80 "$OUT/run.log"
