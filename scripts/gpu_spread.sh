#!/usr/bin/env bash
# `ws_spread` on one H200, in one device call of about 5 minutes (issues 11 and 12): the ws
# kernel's end (the consumers' merge and the stores) spread over every consumer thread, a warp
# storing a whole row an instruction, beside the shipped table's ws picks.
#   OUT=/some/dir bash scripts/gpu_spread.sh        (repository root; carry .whl)
# 1. the GPU matrix of the ws_spread specs (tests/test_backends_gpu.py -k spread)
#                                                                      -> summary.txt, logs.tgz
# 2. each pick beside itself with ws_spread, page 64 and the arena, 3 interleaved rounds: the main
#    preset at B=1 2k/8k/32k and B=8 8k, laguna at B=8/32 8k               -> ab_*.csv
# 3. scripts/diag_timeline.py on the spread picks at B=1 2k and B=8 8k      -> timeline.txt
# Prediction (results/perf-notes.md, "Where a split call's time goes"): about 1 us off each
# CTA's end: B=1 2k 14.4 -> 13.3 us, 8k 19.9 -> 18.8, 32k 42.1 -> 41, B=8 8k 72.6 -> 71.5;
# laguna B=32 45 -> 43.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-420}
budgeted_run gpu_spread
CASES=${CASES:-"main 1x2k combine=2,early_ids=1,lean=1,stages=9,tile_n=32,ws=3
main 1x8k combine=2,lean=1,stages=9,tile_n=32,ws=3
main 1x32k combine=2,early_ids=1,lean=1,stages=6,tile_n=32,ws=3
main 8x8k early_ids=1,lean=1,stages=6,tile_n=32,ws=3
laguna 8x8k,32x8k early_ids=1,lean=1,stages=6,tile_n=32,ws=3,ws_overlap=1,ws_rows=1"}
preset() { [ "$1" = laguna ] && echo laguna-dflash || echo qwen3-8b-dflash-b16; }
{
  specs=$(python3 -c "from tests.test_backends_gpu import BACKENDS, WS_ROWS_SPECS
print(*[s for s in BACKENDS + WS_ROWS_SPECS if 'ws_spread' in s])")
  timeout 150 python3 scripts/precompile_gpu_matrix.py $specs &
  while read -r p shapes spec; do
    timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --page 64 --preset "$(preset "$p")" \
      --table "cupy:$spec;cupy:$spec,ws_spread=1" --shapes "$shapes" &
  done <<< "$CASES"
  wait
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-170}" python3 -m pytest -q -m gpu tests/test_backends_gpu.py \
    -k "spread" -x -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=40
names=()
while read -r p shapes spec; do
  name="ab_${p}_${shapes//,/_}"
  names+=("$name")
  budgeted_table "$name" 60 --preset "$(preset "$p")" --shapes "$shapes" --page 64 --rounds 3 \
    --impl "cupy:$spec;cupy:$spec,ws_spread=1" --baseline none
done <<< "$CASES"
mkdir -p "$OUT/timeline"
while read -r p shapes spec; do
  [ "$p" = main ] && [ "$shapes" = 1x2k -o "$shapes" = 8x8k ] || continue
  timeout 40 python3 scripts/diag_timeline.py --shapes "$shapes" --impl "cupy:$spec,ws_spread=1" \
    --samples 20 --out "$OUT/timeline/$shapes" >> "$OUT/timeline.txt" 2>&1
done <<< "$CASES"
mv "$OUT/timeline" "$OUT/timeline_json"
finish_tables "${names[@]}" timeline_json
grep -E "^[0-9]+ \| " "$OUT/timeline.txt"
