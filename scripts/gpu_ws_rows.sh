#!/usr/bin/env bash
# `cupy:ws=3,ws_rows=1` on one H200, in one device call of about 5 minutes: laguna's 144 rows as
# the three consumers of one warp-specialised CTA, each tile read once for all of them (issue 12).
#   OUT=/some/dir bash scripts/gpu_ws_rows.sh        (repository root; carry .whl)
# IMPL and SHAPES override step 2's kernels and shapes. The twenty-first session's 64-key run
# (results/perf-notes.md, "laguna's ws_rows on 64-key tiles"), for one:
#   R=cupy:ws=3,ws_rows=1,early_ids=1; W=$R,tile_n=64,stages=4
#   IMPL="$R,ws_overlap=1;$W;$W,ws_overlap=1;$R,tile_n=64,stages=3;$W,ws_overlap=1,skip_loads=1" \
#     SHAPES=8x8k,32x8k,64x8k OUT=... bash scripts/gpu_ws_rows.sh
# 1. the GPU matrix of tests/test_backends_gpu.py's WS_ROWS_SPECS (test_ws_rows_*)
#                                                                       -> summary.txt, logs.tgz
# 2. one laguna layer, page 64 and the arena, 2 interleaved rounds: the shipped table's pick
#    (auto), the default, ws_rows in 4/6/9 stages and with early_ids, and its loads alone and math
#    alone, at B=1/8/32 ctx 8k and B=32 ctx 32k, each beside its read floor  -> ab.csv
# Prediction (results/perf-notes.md, "laguna's rows as the consumers of one ws CTA"): B=32 8k
# from 60.7 us (2.55x its floor) to 40-45 us; its loads alone from 1.45x the floor to 1.15x.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-420}
budgeted_run gpu_ws_rows
W="cupy:ws=3,ws_rows=1"
IMPL=${IMPL:-"auto;cupy;$W,stages=4;$W;$W,stages=9;$W,early_ids=1;$W,skip_compute=1;$W,skip_loads=1"}
SHAPES=${SHAPES:-1x8k,8x8k,32x8k,32x32k}
{
  # every spec of tests/test_backends_gpu.py's WS_ROWS_SPECS, beside the table's kernels
  timeout 150 python3 scripts/precompile_gpu_matrix.py $(python3 -c \
    "from tests.test_backends_gpu import WS_ROWS_SPECS; print(*WS_ROWS_SPECS)") &
  timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64 \
    --preset laguna-dflash --shapes "$SHAPES" &
  wait
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu tests/test_backends_gpu.py \
    -k "ws_rows" -x -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=15
budgeted_table ab 240 --preset laguna-dflash --shapes "$SHAPES" --page 64 --rounds 2 \
  --impl "$IMPL" --baseline none
finish_tables ab
