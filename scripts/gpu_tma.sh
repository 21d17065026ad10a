#!/usr/bin/env bash
# The TMA variant of the cupy kernel (`cupy:tma=1`; issues 11 and 12) on an H200, in about
# 6 minutes: its GPU tests (the cupy matrix for that variant and for the default `cupy`, which
# takes TMA from batch 8: every mask, pages 8-256 and the arena, GQA 1-16, head_dim 64/128,
# forced splits, graph replays; NaN past the context and new cache addresses for every cupy
# variant), then the attention table of TMA
# beside cp.async (`tma=1` / `tma=0`, the rest SM 90's defaults), each with its loads only
# (`skip_compute=1`), at the small-batch rows of issue 11 (page 64), at pages 16 / 128 and, for
# head_dim 64, gpt-oss at pages 16 / 64; 2 interleaved rounds.
#   OUT=/some/dir bash scripts/gpu_tma.sh
# $OUT gets summary.txt, gpu_tests_tail.txt and tables.tgz (per table: its log and attention_rounds.md/.csv).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run tma
IMPLS="cupy:tma=0;cupy:tma=1;cupy:tma=0,skip_compute=1;cupy:tma=1,skip_compute=1"
timeout 150 python3 scripts/precompile_gpu_matrix.py cupy:tma=1 cupy cupy:wgmma=0 cupy:overlap=1 \
  cupy:overlap=2 --table "$IMPLS" --page 16,64,128 \
  > "$OUT/precompile.log" 2>&1
timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPLS" --page 16,64 \
  --preset gpt-oss-20b-dflash >> "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"; rm -f "$OUT/precompile.log"
# node ids, not -k: a -k keyword such as "tma" matches far more than the tma=1 cases
python3 -m pytest --collect-only -q -m gpu tests/test_backends_gpu.py 2>/dev/null \
  | grep -E "cupy(:tma=1)?\]|(nan_past|new_cache_addresses).*cupy" > /tmp/tma_tests.txt
mapfile -t ids < /tmp/tma_tests.txt  # ids hold spaces: "[0, 1086, 33]"
timeout "$(clamp $(( $(left) - 300 )) 150 60)" python3 -m pytest -m gpu -q -p no:cacheprovider \
  --maxfail=10 -rf "${ids[@]}" > "$OUT/gpu_tests.log" 2>&1
grep -E "^[0-9]+ (passed|failed)|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tee "$OUT/gpu_tests_tail.txt" \
  | tee -a "$OUT/summary.txt"
tail -n 60 "$OUT/gpu_tests.log" > "$OUT/gpu_tests_log_tail.txt"; rm -f "$OUT/gpu_tests.log"
t() {  # t NAME ARGS...: the attention table under the time left
  local name=$1; shift
  timeout "$(clamp $(( $(left) - 20 )) 240 30)" python3 -m drafter_attn.bench.attention_table \
    --rounds 2 --baseline none --db "$db" --out "$OUT/$name" --impl "$IMPLS" "$@" 2>&1 \
    | grep -v "^{" > "$OUT/$name.log"
  rm -f "$OUT/$name/attention.json" "$OUT/$name/attention.csv"
  echo "== $name" >> "$OUT/summary.txt"
  grep -E "^\| cupy" "$OUT/$name/attention_rounds.md" 2>/dev/null | cut -c1-118 >> "$OUT/summary.txt"
}
t small --shapes 1x2k,1x8k,1x32k,8x8k,32x8k,8x32k --page 64
t pages --shapes 8x8k,32x8k --page 16,128
t gptoss --preset gpt-oss-20b-dflash --shapes 8x8k,32x8k --page 16,64
# one archive of the tables (a device call brings back at most 8 files)
(cd "$OUT" && tar czf tables.tgz small pages gptoss small.log pages.log gptoss.log \
  && rm -rf small pages gptoss small.log pages.log gptoss.log)
cat "$OUT/summary.txt"
