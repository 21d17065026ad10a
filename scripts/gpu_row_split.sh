#!/usr/bin/env bash
# A (request, KV head)'s rows dealt over several CTAs (`cupy:row_split=N`, issue 12: laguna's 144
# rows as 3 one-warpgroup CTAs on the pipelined path instead of one 3-warpgroup CTA;
# results/perf-notes.md, "GQA 9 as three one-warpgroup CTAs") on one H200, in one device call of
# at most 9 minutes:
#   OUT=/some/dir bash scripts/gpu_row_split.sh        (repository root)
# 1. precompile the variants the tests and the table load (parallel NVRTC)
# 2. the row-split variants against the torch reference (tests/test_backends_gpu.py,
#    test_row_split_*: laguna, GQA 12, GQA 9 at head_dim 64, Qb 12 x G 9, the main preset; every
#    mask, pages 8-128 and the arena, ragged lengths, forced splits; 4 parameter sets), then the
#    padded path's tests (the default for laguna today)                     -> gpu_tests.log
# 3. the attention table, one laguna layer at B=1/8/32 x ctx 8k/32k, page 64 and the arena, two
#    interleaved rounds: today's default (the padded path), its 64-key variant, row_split=3 (TMA
#    from batch 8, as the main preset), row_split=3 by cp.async, row_split=3 loads only; the
#    read floor and FlashInfer fa2 (per-shape plan) in the same run          -> attention*
# Files in $OUT: summary.txt, precompile.log, gpu_tests.log, table.log, attention*.csv/.md/.json,
# extras.tgz (the profile database of the table's rows). Budget TOTAL seconds (default 525).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_row_split
SPECS=("cupy:row_split=3" "cupy:row_split=3,tma=1" "cupy:row_split=3,wgmma=0" "cupy:row_split=2")
IMPLS="cupy;cupy:wgmma=1,tile_n=64,stages=4;cupy:row_split=3;cupy:row_split=3,tma=0;cupy:row_split=3,skip_compute=1"

timeout -s INT -k 10 90 python3 scripts/precompile_gpu_matrix.py "${SPECS[@]}" cupy:wgmma=1 \
  --table "$IMPLS" --preset laguna-dflash --page 64 > "$OUT/precompile.log" 2>&1
tail -n 2 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"

timeout -s INT -k 10 170 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf \
  -k "row_split or padded_wgmma_forced" tests/test_backends_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "row-split gpu tests rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -n 20 | cut -c1-300 | tee -a "$OUT/summary.txt"
tail -n 1 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"

timeout -s INT -k 10 "$(clamp $(( $(left) - 20 )) 300 30)" \
  python3 -m drafter_attn.bench.attention_table --preset laguna-dflash --baseline flashinfer-fa2 \
  --shapes 32x8k,8x8k,32x32k,1x8k --page 64 --rounds 2 --impl "$IMPLS" \
  --db "$db" --out "$OUT" > "$OUT/table.log" 2>&1
echo "table rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
grep -v "^{" "$OUT/table.log" | cut -c1-200 | tail -n 40 | tee -a "$OUT/summary.txt"
[ -f "$OUT/attention_rounds.md" ] && cat "$OUT/attention_rounds.md" | cut -c1-250 | tail -n 30
