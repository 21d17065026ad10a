#!/usr/bin/env bash
# One knob beside the shipped table's picks, on one H200, in one device call of about 5 minutes:
#   KNOB=q_step=1 PROBE=Q_STEP TEST_K=q_step OUT=/some/dir bash scripts/gpu_knob_ab.sh
# (repository root; carry .whl)
# 1. the GPU matrix of the specs that set the knob (tests/test_backends_gpu.py -k "$TEST_K") and
#    $TESTS (default tests/test_trace.py)                           -> summary.txt, logs.tgz
# 2. each pick of $CASES beside itself with $KNOB (and with $KNOB2 where set), page 64 and the
#    arena, $ROUNDS (3) interleaved rounds                             -> ab_*.csv
# 3. with PROBE (a define), scripts/diag_timeline.py on the main preset's cases: the traced build
#    of the pick (with $TIMELINE_KNOB where set: a knob the launch itself needs, as pdl) beside
#    its traced build with the define, in one process                -> timeline.txt
# CASES lines are "PRESET SHAPES PARAMS": the picks of the shipped sm90 table (profiles/sm90.json,
# page 64), named outright because a kernel-source edit makes the table miss until it is re-keyed.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
: "${KNOB:?KNOB=name=value, e.g. q_step=1}"
TOTAL=${TOTAL:-420}
budgeted_run gpu_knob_ab
CASES=${CASES:-"qwen3-8b-dflash-b16 1x2k combine=2,early_ids=1,lean=1,one_trip=1,q_step=1,stages=9,tile_n=32,ws=3
qwen3-8b-dflash-b16 1x8k combine=2,lean=1,one_trip=1,stages=9,tile_n=32,ws=3
qwen3-8b-dflash-b16 1x32k combine=2,early_ids=1,lean=1,one_trip=1,q_step=1,stages=6,tile_n=32,ws=3
qwen3-8b-dflash-b16 8x8k combine=1,early_ids=1,lean=1,one_trip=1,stages=6,tile_n=32,ws=3
laguna-dflash 32x8k early_ids=1,lean=1,stages=6,tile_n=32,ws=3,ws_overlap=1,ws_rows=1"}
TESTS=${TESTS:-tests/test_trace.py}
echo "knob $KNOB${KNOB2:+, knob2 $KNOB2}" >> "$OUT/summary.txt"
{
  if [ -n "${TEST_K:-}" ]; then
    specs=$(python3 -c "from tests.test_backends_gpu import BACKENDS, WS_ROWS_SPECS
print(*[s for s in BACKENDS + WS_ROWS_SPECS if '${TEST_K}' in s])")
    timeout 150 python3 scripts/precompile_gpu_matrix.py $specs &
  fi
  while read -r preset shapes spec; do
    timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --page 64 --preset "$preset" \
      --table "cupy:$spec;cupy:$spec,$KNOB${KNOB2:+;cupy:$spec,$KNOB2}" --shapes "$shapes" &
  done <<< "$CASES"
  wait
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-170}" python3 -m pytest -q -m gpu $TESTS \
    ${TEST_K:+tests/test_backends_gpu.py -k "$TEST_K"} -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=$(( ${PROBE:+60} + 20 ))
names=()
while read -r preset shapes spec; do
  name="ab_${preset%%-*}_${shapes//,/_}"
  names+=("$name")
  budgeted_table "$name" 60 --preset "$preset" --shapes "$shapes" --page 64 --rounds "${ROUNDS:-3}" \
    --impl "cupy:$spec;cupy:$spec,$KNOB${KNOB2:+;cupy:$spec,$KNOB2}" --baseline none
done <<< "$CASES"
if [ -n "${PROBE:-}" ]; then
  mkdir -p "$OUT/timeline_json"
  while read -r preset shapes spec; do
    t=$(clamp 40 $(( $(left) - 15 )) 5)
    timeout "$t" python3 scripts/diag_timeline.py --preset "$preset" --shapes "$shapes" --samples 20 \
      --impl "cupy:$spec${TIMELINE_KNOB:+,$TIMELINE_KNOB}" --probe "$PROBE" --out "$OUT/timeline_json/${shapes//,/_}" >> "$OUT/timeline.txt" 2>&1
    echo "timeline $shapes rc=$? after ${SECONDS}s" >> "$OUT/summary.txt"
  done <<< "$(grep -v '^laguna' <<< "$CASES")"
fi
finish_tables "${names[@]}" timeline_json
grep -E "^[0-9]+ \| " "$OUT/timeline.txt" 2>/dev/null
