#!/usr/bin/env bash
# Fewer instructions a tile (`cupy:lean=1`, issue 11; results/perf-notes.md, "Instructions a
# tile") on one H200, in one device call of at most 9 minutes:
#   OUT=/some/dir bash scripts/gpu_lean.sh        (repository root)
# 1. precompile the variants the tests and the table load (parallel NVRTC)
# 2. the lean variants against the torch reference (tests/test_backends_gpu.py, backends
#    "cupy:lean=1" and "cupy:lean=1,wgmma=0": every mask, pages 8-256 and the arena, GQA 1-16,
#    head_dim 64/128, ragged lengths, bf16/fp16, forced splits, graph replay)  -> gpu_tests.log
# 3. the attention table, one main-preset layer at B=1 2k/8k/32k, B=4 8k, B=8 8k, page 64 and
#    the arena, two interleaved rounds: without lean, the default (lean below batch 8), lean at
#    one CTA an SM, lean + TMA;
#    the read floor and FlashInfer fa2's per-shape and CUDA-graph plans in the same run
#                                                                           -> attention*
# 4. fewer splits (one CTA an SM, more tiles each, where lean pays most) at B=1 8k and 32k:
#    16 and 24 splits, without and with lean                                    -> splits/
# Files in $OUT: summary.txt, gpu_tests.log, attention_rounds.md, logs.tgz (the logs, the table's
# other files, splits/), extras.tgz (the profile database of the rows).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_lean
IMPLS="cupy:lean=0;cupy;cupy:lean=1,ctas_per_sm=1;cupy:lean=1,tma=1"
LONE="cupy:num_splits=16,lean=0;cupy:num_splits=16,lean=1;cupy:num_splits=24,lean=0;cupy:num_splits=24,lean=1"

timeout -s INT -k 10 120 python3 scripts/precompile_gpu_matrix.py cupy:lean=1 cupy:lean=1,wgmma=0 \
  --table "$IMPLS;$LONE" --page 64 > "$OUT/precompile.log" 2>&1
tail -n 2 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"

timeout -s INT -k 10 "${TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf \
  -k "lean" tests/test_backends_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "lean gpu tests rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -n 20 | cut -c1-300 | tee -a "$OUT/summary.txt"
tail -n 1 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"

mkdir -p "$OUT/splits"
timeout -s INT -k 10 "$(clamp $(( $(left) - 150 )) 240 30)" \
  python3 -m drafter_attn.bench.attention_table --baseline flashinfer-fa2,flashinfer-fa2-graph \
  --shapes 1x2k,1x8k,1x32k,4x8k,8x8k --page 64 --rounds 2 --impl "$IMPLS" \
  --db "$db" --out "$OUT" > "$OUT/table.log" 2>&1
echo "table rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
timeout -s INT -k 10 "$(clamp $(( $(left) - 10 )) 120 20)" \
  python3 -m drafter_attn.bench.attention_table --baseline none \
  --shapes 1x8k,1x32k --page 64 --rounds 2 --impl "$LONE" --db "$db" --out "$OUT/splits" > "$OUT/table_splits.log" 2>&1
echo "splits table rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log table.log table_splits.log splits \
  attention.csv attention.json attention.md attention_rounds.csv
rm -rf "$OUT/splits" "$OUT"/table*.log "$OUT/precompile.log" "$OUT"/attention.* "$OUT/attention_rounds.csv"
[ -f "$OUT/attention_rounds.md" ] && cut -c1-250 "$OUT/attention_rounds.md" | tail -n 30
tar xzf "$OUT/logs.tgz" -O splits/attention_rounds.md 2>/dev/null | cut -c1-200 | tail -n 10
