#!/usr/bin/env bash
# The measured limiter of issue 12's missed rows on one H200, in one device call of at most 9
# minutes: each row's default beside its loads only (`skip_compute=1`) and its math only
# (`skip_loads=1`), the read floor of the same bytes, FlashInfer where it takes the geometry, and
# Nsight Compute on the laguna kernel.
#   OUT=/some/dir bash scripts/gpu_limiters.sh        (repository root; carry .whl)
# 1. laguna-dflash (GQA 9, 144 rows, sliding_causal 512) B=8 and B=32 ctx 8k, page 64 and the
#    arena, two interleaved rounds; also 1 and 2 splits             -> laguna/attention_rounds.md
# 2. the main preset at B=1 ctx 128k and 512k and B=4 128k, page 64 and the arena; also cp.async
#    loads (`tma=0`)                                                    -> long/attention.md
# 3. the main preset at page 16, B=32 ctx 8k and 32k, against the arena, two rounds; also
#    cp.async loads                                                 -> page16/attention_rounds.md
# 4. ncu of laguna B=32 ctx 8k page 64 (full, loads only, math only)      -> ncu.txt, ncu_full.txt
# Files in $OUT: summary.txt, the three tables, ncu.txt, logs.tgz, extras.tgz (the rows' database).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_limiters
LAGUNA="cupy;cupy:skip_loads=1;cupy:skip_compute=1;cupy:num_splits=1;cupy:num_splits=2"
LONG="cupy;cupy:skip_loads=1;cupy:skip_compute=1;cupy:tma=0"
PAGE16="cupy;cupy:skip_loads=1;cupy:skip_compute=1;cupy:tma=0"
{
  timeout 150 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$LAGUNA" --preset laguna-dflash --page 64
  timeout 150 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$LONG" --page 16,64
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"

budgeted_table laguna 150 --preset laguna-dflash --shapes 8x8k,32x8k --page 64 --rounds 2 --impl "$LAGUNA" \
  --baseline auto
budgeted_table long 130 --shapes 1x128k,1x512k,4x128k --page 64 --impl "$LONG" --baseline flashinfer-fa2
budgeted_table page16 100 --shapes 32x8k,32x32k --page 16 --rounds 2 --impl "$PAGE16" --baseline none

cases=""
for impl in cupy cupy:skip_compute=1 cupy:skip_loads=1; do cases+="32 8192 64 $impl laguna-dflash"$'\n'; done
NCU_CASES="$cases" timeout -s INT -k 10 "$(clamp $(( $(left) - 10 )) 150 20)" bash "$(dirname "$0")/gpu_ncu.sh"
echo "ncu rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log laguna long page16
for name in laguna long page16; do
  f="$OUT/$name/attention_rounds.md"; [ -f "$f" ] || f="$OUT/$name/attention.md"
  [ -f "$f" ] && cp "$f" "$OUT/$name.md"
done
rm -rf "$OUT/laguna" "$OUT/long" "$OUT/page16" "$OUT/precompile.log"
for name in laguna long page16; do
  echo "== $name"; [ -f "$OUT/$name.md" ] && grep -E "^\| (cupy|flash|trt)" "$OUT/$name.md" | cut -c1-150
done
