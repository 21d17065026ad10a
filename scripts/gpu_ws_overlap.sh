#!/usr/bin/env bash
# `cupy:ws=...,ws_overlap=1` on one H200, in one device call of about 5 minutes: each ws consumer's
# P V of one tile issued with the next tile's S = Q K^T, under that tile's softmax (issues 11, 12).
#   OUT=/some/dir bash scripts/gpu_ws_overlap.sh        (repository root; carry .whl)
# 1. the GPU matrix of the ws_overlap specs (tests/test_backends_gpu.py: BACKENDS and
#    WS_ROWS_SPECS)                                                     -> summary.txt, logs.tgz
# 2. laguna, page 64 and the arena, 2 interleaved rounds, B=8/32 ctx 8k: the default, ws_rows
#    with early_ids, and with ws_overlap in 6 and 9 stages and its math alone  -> laguna.csv
# 3. the main preset, page 64 and the arena, B=1 2k/8k/32k and B=8 8k: the table's ws pick below
#    batch 8 (ws=3, 32-key tiles, 6 stages, early_ids) and ws=2 in 4 stages, each with and
#    without ws_overlap, and the runtime's pick (auto)                  -> main.csv
# Prediction (results/perf-notes.md, "A ws consumer's P V under its next S"): laguna B=32 8k from
# 46.9 us to 38-42 (its math alone from 45 to 35-38); the main preset level to 3% faster.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-450}
budgeted_run gpu_ws_overlap
R="cupy:ws=3,ws_rows=1,early_ids=1"
LAGUNA=${LAGUNA:-"cupy;$R;$R,ws_overlap=1;$R,ws_overlap=1,stages=9;$R,ws_overlap=1,skip_loads=1"}
P="cupy:ws=3,tile_n=32,lean=1,stages=6,early_ids=1"
MAIN=${MAIN:-"auto;$P;$P,ws_overlap=1;$P,ws_overlap=1,stages=9;cupy:ws=2,stages=4;cupy:ws=2,stages=4,ws_overlap=1"}
{
  timeout 150 python3 scripts/precompile_gpu_matrix.py "cupy:ws=2,ws_overlap=1" \
    "cupy:ws=3,tile_n=32,early_ids=1,ws_overlap=1" "cupy:ws=3,ws_rows=1,early_ids=1,ws_overlap=1" \
    "cupy:ws=3,ws_rows=1,stages=2,ws_overlap=1"
  timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$LAGUNA" --page 64 \
    --preset laguna-dflash
  timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$MAIN" --page 64 \
    --shapes 1x2k,1x8k,1x32k,8x8k
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu tests/test_backends_gpu.py \
    -k "ws_overlap" -x -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=120
budgeted_table laguna 100 --preset laguna-dflash --shapes 8x8k,32x8k --page 64 --rounds 2 \
  --impl "$LAGUNA" --baseline none
RESERVE=15
budgeted_table main 150 --shapes 1x2k,1x8k,1x32k,8x8k --page 64 --rounds 2 --impl "$MAIN" \
  --baseline none
finish_tables laguna main
