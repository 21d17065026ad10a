#!/usr/bin/env bash
# Named variants side by side at a few points, interleaved rounds, in one device call (an H200):
#   CASES="PRESET SHAPES PAGES IMPLS" (a line a table) OUT=/some/dir bash scripts/gpu_variants.sh
# (repository root; carry .whl). IMPLS is bench.attention_table's --impl ("auto" is the shipped
# table's pick), PAGES its --page (0 alone: the arena only is not a choice there; a page size
# always brings the arena row beside it). Each table takes at most TABLE_S seconds (120) and
# ROUNDS interleaved rounds (3); the read floor is measured in the same run. Every variant is
# compiled first, in parallel. No tests unless MATRIX names specs (space-separated, as in
# tests/test_backends_gpu.py's BACKENDS): then first the GPU matrix's cases of exactly those specs,
# with xdist (-n ${XDIST:-6}), at most TEST_S seconds (170). Without it, use this where no kernel
# source changed (a parameter the registry already takes), or after gpu_knob_ab.sh's matrix.
#                                                                           -> NAME.csv each
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
: "${CASES:?CASES lines: PRESET SHAPES PAGES IMPLS}"
TOTAL=${TOTAL:-540}
budgeted_run gpu_variants
{
  [ -n "${MATRIX:-}" ] && timeout 150 python3 scripts/precompile_gpu_matrix.py $MATRIX &
  while read -r preset shapes pages impls; do
    timeout 150 python3 scripts/precompile_gpu_matrix.py --no-tests --preset "$preset" \
      --page "$pages" --table "$impls" --shapes "$shapes" &
  done <<< "$CASES"
  wait
} > "$OUT/precompile.log" 2>&1
grep variants "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -n "${MATRIX:-}" ]; then  # the node ids with one of the specs as a whole parameter
  mapfile -t ids < <(python3 scripts/matrix_ids.py $MATRIX)
  echo "matrix: ${#ids[@]} cases of $MATRIX" | tee -a "$OUT/summary.txt"
  (( ${#ids[@]} )) || { echo "no test runs those specs: not in BACKENDS?" | tee -a "$OUT/summary.txt"; exit 2; }
  timeout -s INT -k 10 "${TEST_S:-170}" python3 -m pytest -q -m gpu -n "${XDIST:-6}" \
    -p no:cacheprovider "${ids[@]}" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=20
names=()
while read -r preset shapes pages impls; do
  name="v_${preset%%-*}_${shapes//,/_}_p${pages//,/_}"
  names+=("$name")
  budgeted_table "$name" "${TABLE_S:-120}" --preset "$preset" --shapes "$shapes" --page "$pages" \
    --rounds "${ROUNDS:-3}" --impl "$impls" --baseline "${BASELINE:-none}"
done <<< "$CASES"
finish_tables "${names[@]}"
