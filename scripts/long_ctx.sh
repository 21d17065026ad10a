#!/usr/bin/env bash
# Issue 12 on the GPU at hand (an H200; about 4 minutes): engine-sized block tables and long
# contexts, measured by `bench decode` (the main preset's 5-layer step: store + attention):
#   OUT=/some/dir bash scripts/long_ctx.sh
# 1. table  B=8,32 at ctx 8k, page 64: the block table fitted to the context, and sized for 128k
#           tokens (2048 columns, as an engine sizes it for the model's longest context) without
#           and with the host-side max_ctx hint; arena beside      -> $OUT/table/decode.{csv,json,png}
# 2. long   B=1,4 at ctx 128k and 512k: paged (page 64) against the dense arena, with the read
#           floor of each step's bytes (x floor), and FlashInfer fa2 in both plans (its per-shape
#           and its CUDA-graph plan) when installed                 -> $OUT/long/decode.{csv,json,png}
# 3. `tuner auto` for a 512k deployment at concurrency 4 over the long rows, in $OUT/run.log
# Files: the six above, $OUT/run.log and $OUT/long_ctx.db (the recorded rows; the wide-table rows
# are not recorded) for `tuner auto --with`: 8 in all. Each stage has a time limit (SIGINT: the
# rows measured so far are still written).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
db=/tmp/long_ctx.db
rm -f "$db" "$db-wal" "$db-shm"
base=none
python3 -c "import flashinfer" 2>/dev/null && base=flashinfer
decode() { local t=$1; shift; timeout -s INT -k 15 "$t" python3 -m drafter_attn.bench.cli decode --impl cupy --db "$db" "$@"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "baselines: $base"
  decode "${T_TABLE:-90}" --page 64 --batch 8,32 --ctx 8k --table-capacity 128k --max-ctx-hint both \
    --baseline none --out "$OUT/table"
  decode "${T_LONG:-150}" --page 64 --batch 1,4 --ctx 128k,512k --baseline "$base" --out "$OUT/long"
  python3 -m drafter_attn.tuner auto --preset qwen3-8b-dflash-b16 --page 64 --max-ctx 524288 \
    --concurrency 4 --db "$db"
} > "$OUT/run.log" 2>&1
python3 -c "import sqlite3; sqlite3.connect('$db').execute(\"VACUUM INTO '$OUT/long_ctx.db'\")"
tail -n 70 "$OUT/run.log"
