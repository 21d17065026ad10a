#!/usr/bin/env bash
# Long contexts (issue 12) on one H200, in one device call of about 5 minutes: the main preset's
# attention at B=1 and 4, ctx 128k and 512k, page 64 and the arena, each kernel beside its read
# floor, with the warp-specialised kernels the tuned table runs at shorter contexts, the default
# and the ws kernel's loads alone:
#   OUT=/some/dir bash scripts/gpu_long.sh        (repository root; carry .whl)
# IMPL and SHAPES override the kernels and the shapes; -> long.csv, logs.tgz, and the summary last.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-420}
budgeted_run gpu_long
WS="cupy:ws=3,tile_n=32,lean=1"
IMPL=${IMPL:-"$WS,stages=6;$WS,stages=9;$WS,stages=6,early_ids=1;cupy:ws=2,stages=4;cupy;$WS,stages=6,skip_compute=1"}
SHAPES=${SHAPES:-1x128k,4x128k,1x512k,4x512k}
timeout 120 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64 > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
RESERVE=20
budgeted_table long 380 --shapes "$SHAPES" --page 64 --impl "$IMPL" --baseline none
finish_tables long
