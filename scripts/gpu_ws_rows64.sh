#!/usr/bin/env bash
# laguna's ws_rows kernel on 64-key tiles, on one H200, in one device call of about 5 minutes
# (issue 12). The twentieth session measured ws_rows on 32-key tiles only, where each consumer's
# chain (S, softmax, P V) runs 17 times a window and its math alone is 1.7x the read floor.
#   OUT=/some/dir bash scripts/gpu_ws_rows64.sh        (repository root; carry .whl)
# 1. the GPU matrix of tests/test_backends_gpu.py's WS_ROWS_SPECS (with the two 64-key specs),
#    and tests/test_launch.py and test_ops.py (the call paths)     -> summary.txt, logs.tgz
# 2. one laguna layer, page 64 and the arena, 2 interleaved rounds, B=8/32/64 ctx 8k: the table's
#    pick on 32-key tiles (R32), 64-key tiles in 3 and 4 stages with and without ws_overlap, and
#    the 4-stage one's math alone, each beside its read floor              -> ab.csv
# Prediction (results/perf-notes.md, "laguna's ws_rows on 64-key tiles"): B=32 8k from 46.5 us
# (2.0x the floor) to 38-41; the math alone from 39.8 to 30-33.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-420}
budgeted_run gpu_ws_rows64
R="cupy:ws=3,ws_rows=1,early_ids=1"
W="$R,tile_n=64,stages=4"
IMPL=${IMPL:-"$R,ws_overlap=1;$W;$W,ws_overlap=1;$R,tile_n=64,stages=3;$R,tile_n=64,stages=3,ws_overlap=1;$W,ws_overlap=1,skip_loads=1;$R,ws_overlap=1,skip_loads=1"}
SHAPES=${SHAPES:-8x8k,32x8k,64x8k}
{
  timeout 150 python3 scripts/precompile_gpu_matrix.py "$W,ws_overlap=1" "$R,tile_n=64,stages=3" &
  timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64 \
    --preset laguna-dflash --shapes "$SHAPES" &
  wait
} > "$OUT/precompile.log" 2>&1
grep variants "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu tests/test_backends_gpu.py \
    tests/test_launch.py tests/test_ops.py -k "ws_rows or test_launch or test_ops" -p no:cacheprovider \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -5 >> "$OUT/summary.txt"
fi
RESERVE=15
budgeted_table ab 200 --preset laguna-dflash --shapes "$SHAPES" --page 64 --rounds 2 \
  --impl "$IMPL" --baseline none
finish_tables ab
