#!/usr/bin/env bash
# `cupy:ws=3,ws_rows=1,persist=1` on one H200, in one device call of about 5 minutes (issue 12):
# one ws_rows CTA an SM walking the call's items, its pipeline running on from one item into the
# next, against one CTA an item (two waves of 256 at laguna B=32).
#   OUT=/some/dir bash scripts/gpu_persist.sh        (repository root; carry .whl)
# 1. GPU tests: the ws_rows random matrix (WS_ROWS_SPECS, the persist specs among them),
#    test_persist_* (48 ragged requests, every mask, pages 16/64 and the arena, forced splits,
#    graph replays) and tests/test_launch.py                      -> summary.txt, logs.tgz
# 2. one laguna layer, page 64 and the arena, 2 interleaved rounds, B=8/32/64 ctx 8k: the table's
#    pick (R: ws_rows, early_ids, ws_overlap), persist with and without ws_overlap, and persist's
#    loads alone and math alone                                            -> ab.csv
# Prediction (results/perf-notes.md, "Persistent ws_rows CTAs: `persist` refuted", its next step:
# running stage and phase counters, descriptors made once, 32-bit split tiles; the consumers' tile
# loop 477 SASS instructions against 464 without persist, 532 in the first version): B=32 8k from 46.5 us to 42-44
# (one start and one drain an SM instead of one a wave); B=8 level (one item a CTA there).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-400}
budgeted_run gpu_persist
P="cupy:ws=3,ws_rows=1,persist=1"
IMPL=${IMPL:-"cupy:ws=3,ws_rows=1,early_ids=1,ws_overlap=1;$P;$P,ws_overlap=1;$P,skip_compute=1;$P,skip_loads=1"}
SHAPES=${SHAPES:-8x8k,32x8k,64x8k}
{
  timeout 150 python3 scripts/precompile_gpu_matrix.py "$P" "$P,ws_overlap=1" &
  timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64 \
    --preset laguna-dflash --shapes "$SHAPES" &
  wait
} > "$OUT/precompile.log" 2>&1
grep variants "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-130}" python3 -m pytest -q -m gpu tests/test_backends_gpu.py \
    tests/test_launch.py -k "persist or test_launch" -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -5 >> "$OUT/summary.txt"
fi
RESERVE=15
budgeted_table ab 150 --preset laguna-dflash --shapes "$SHAPES" --page 64 --rounds 2 \
  --impl "$IMPL" --baseline none
finish_tables ab
