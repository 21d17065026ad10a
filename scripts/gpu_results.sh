#!/usr/bin/env bash
# Every measurement the repository commits, in one device call (the H200 of this workplace):
#   OUT=/some/dir bash scripts/gpu_results.sh
# 1. the one-layer attention table (paged 16/64/128 vs arena vs FlashInfer fa2) -> $OUT/table
# 2. `bench decode` with its defaults                                            -> $OUT/bench
# 3. `tuner sweep default`                                                       -> $OUT/sm90.db
# Each stage has a time limit so a slow stage cannot starve the others.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
db=/tmp/sm90.db
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout ${T_TABLE:-200} python3 -m drafter_attn.bench.attention_table --reps 50 --out "$OUT/table" | grep -v "^{"
  timeout ${T_BENCH:-200} python3 -m drafter_attn.bench.cli decode --impl cupy --db "$db" --out "$OUT/bench" --reps 50
  timeout ${T_SWEEP:-150} python3 -m drafter_attn.tuner sweep default --db "$db" --no-progress
  python3 -m drafter_attn.tuner show --db "$db" --limit 60
} > "$OUT/run.log" 2>&1
python3 -c "import sqlite3, sys; sqlite3.connect('$db').execute(\"VACUUM INTO '$OUT/sm90.db'\")"
tail -n 80 "$OUT/run.log"
