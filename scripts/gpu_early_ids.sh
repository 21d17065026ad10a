#!/usr/bin/env bash
# `cupy:ws=...,early_ids=1` (issue 11): the ws producer copies a split's first page ids before the
# context length lands. On one H200, in one device call of about 5 minutes:
#   OUT=/some/dir bash scripts/gpu_early_ids.sh        (repository root; carry .whl)
# 1. GPU tests: the early_ids specs' matrix (the wide-table test among it), and the wide-table
#    test of the default cupy kernel and every ws spec                                                  -> tests.log
# 2. one layer, main preset page 64 and the arena, B=1 2k/8k/32k and B=8 8k, 2 interleaved
#    rounds: the ws kernels the tuned table picks, without and with early_ids  -> ab.md
# IMPL overrides table 2's variants, SHAPES its shapes, ROUNDS its rounds.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_early_ids
IMPL=${IMPL:-"cupy:ws=3,tile_n=32,stages=9;cupy:ws=3,tile_n=32,stages=9,early_ids=1;cupy:ws=3,tile_n=32;cupy:ws=3,tile_n=32,early_ids=1"}
SPECS="cupy cupy:ws=2,early_ids=1 cupy:ws=3,tile_n=32,stages=9,early_ids=1 cupy:ws=4,early_ids=1
  cupy:ws=2 cupy:ws=3 cupy:ws=4 cupy:ws=3,tile_n=32 cupy:ws=3,tile_n=32,stages=9 cupy:ws=2,lean=0
  cupy:ws=3,tile_n=32,stages=9,lean=0 cupy:ws=4,lean=0"
{
  timeout 150 python3 scripts/precompile_gpu_matrix.py $SPECS
  timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
mapfile -t sel < <(python3 -m pytest --collect-only -q tests/test_backends_gpu.py 2>/dev/null \
  | grep -E 'early_ids=1\]|test_tables_wider_than_the_context\[.*-cupy(:ws=[^]]*)?\]')
timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu "${sel[@]}" -p no:cacheprovider \
  --maxfail=10 -rf > "$OUT/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
grep -E "^FAILED" "$OUT/tests.log" | head -n 10 | cut -c1-250 | tee -a "$OUT/summary.txt"
RESERVE=10
budgeted_table ab "${TABLE_S:-200}" --shapes "${SHAPES:-1x2k,1x8k,1x32k,8x8k}" --page 64 \
  --impl "$IMPL" --baseline none --rounds "${ROUNDS:-2}"
f="$OUT/ab/attention_rounds.md"; [ -f "$f" ] && cp "$f" "$OUT/ab.md"
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log ab 2>/dev/null
rm -rf "$OUT/ab" "$OUT/precompile.log"
echo "== ab"; [ -f "$OUT/ab.md" ] && grep -E "^\| cupy" "$OUT/ab.md" | cut -c1-150
echo "== summary"; cat "$OUT/summary.txt"
