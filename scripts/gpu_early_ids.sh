#!/usr/bin/env bash
# The ws producer's first page ids copied before the context length lands (issue 11), on one
# H200 in one device call of at most 9 minutes:
#   OUT=/some/dir bash scripts/gpu_early_ids.sh        (repository root; carry .whl)
# 1. the ws backends' GPU tests (every ws spec of the matrix, and the wide-table test of
#    them and of the default cupy kernel)                                                           -> tests.log
# 2. one layer, main preset page 64 and the arena, B=1 2k/8k/32k and B=8 8k, 2 interleaved
#    rounds, the ws kernels the tuned table picks, with this tree's header      -> after.md
# 3. the same with the header before the change ($BEFORE, a copy of the previous
#    warp_specialized.cuh; the cubin cache is keyed by the headers' bytes)      -> before.md
# 4. this tree's again, as time allows                                       -> after2.md
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_early_ids
BEFORE=${BEFORE:-scripts/ab/warp_specialized.cuh.before}
HDR=kernels/cuda/warp_specialized.cuh
IMPL=${IMPL:-"cupy:ws=3,tile_n=32,stages=9;cupy:ws=3,tile_n=32"}
SPECS="cupy cupy:ws=2 cupy:ws=3 cupy:ws=4 cupy:ws=3,tile_n=32 cupy:ws=3,tile_n=32,stages=9 cupy:ws=2,lean=0
  cupy:ws=3,tile_n=32,stages=9,lean=0 cupy:ws=4,lean=0"
{
  timeout 150 python3 scripts/precompile_gpu_matrix.py $SPECS
  timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
mapfile -t sel < <(python3 -m pytest --collect-only -q tests/test_backends_gpu.py 2>/dev/null \
  | grep -E '[-[]cupy:ws=|test_tables_wider_than_the_context\[.*-cupy\]')
timeout -s INT -k 10 "${TEST_S:-170}" python3 -m pytest -q -m gpu "${sel[@]}" -p no:cacheprovider \
  --maxfail=10 -rf > "$OUT/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
grep -E "^FAILED" "$OUT/tests.log" | head -n 10 | cut -c1-250 | tee -a "$OUT/summary.txt"
RESERVE=15
table() { budgeted_table "$1" 90 --shapes 1x2k,1x8k,1x32k,8x8k --page 64 --impl "$IMPL" \
  --baseline none --rounds 2; }
table after
cp "$HDR" /tmp/ws_after.cuh && cp "$BEFORE" "$HDR"
python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64 >> "$OUT/precompile.log" 2>&1
table before
cp /tmp/ws_after.cuh "$HDR"
(( $(left) > 80 )) && table after2
for name in after before after2; do
  f="$OUT/$name/attention_rounds.md"; [ -f "$f" ] && cp "$f" "$OUT/$name.md"
done
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log after before after2 2>/dev/null
rm -rf "$OUT/after" "$OUT/before" "$OUT/after2" "$OUT/precompile.log"
for name in after before after2; do
  echo "== $name"; [ -f "$OUT/$name.md" ] && grep -E "^\| cupy" "$OUT/$name.md" | cut -c1-140
done
