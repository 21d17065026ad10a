#!/usr/bin/env bash
# `cupy:stream_k=1` on one H200, in one device call of about 8 minutes: the trimmed TMA kernel
# with its tile steps shared out evenly over one CTA a resident slot, against the same kernel on
# the split plan (the shipped table's pick at issue 11's large rows), FlashInfer's two plans and
# the read floor.
#   OUT=/some/dir bash scripts/gpu_stream_k.sh        (repository root; carry .whl)
# 1. tests/test_backends_gpu.py -k stream_k (the random matrix, pieces, graph replay, NaN past
#    the context, running-max moves)                                     -> summary.txt, logs.tgz
# 2. main preset, page 128: B=32 8k, B=8 32k (issue 11) and B=6, 12 at 8k (grids that fill no
#    whole wave), 2 interleaved rounds: the split plan's kernel (T), T with stream_k, both loads
#    alone, FlashInfer per-shape and graph mode, the floor                  -> large.csv
# 3. main preset, page 64: B=8 8k and B=4 128k, the same rows            -> mid.csv
# 4. issue 11's large rows' limiter for T: its math alone (skip_loads=1) beside full and loads
#    alone, 2 rounds (-> limiter.csv), and Nsight Compute of the three    -> ncu.txt
# Prediction (results/perf-notes.md, "Tile steps shared out evenly"): B=32 8k and B=8 32k 2-3%
# faster than T (4 of 132 SMs idle there), B=6 and B=12 8k 5-10%.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-580}
budgeted_run gpu_stream_k
T="cupy:tma=1,trim=1,lean=0,tile_n=64,stages=3"
S="$T,stream_k=1"
IMPL=${IMPL:-"$T;$S;$T,skip_compute=1;$S,skip_compute=1"}
FI=flashinfer-fa2,flashinfer-fa2-graph
LARGE=${LARGE:-32x8k,8x32k,6x8k,12x8k} MID=${MID:-8x8k,4x128k}
{
  timeout 200 python3 scripts/precompile_gpu_matrix.py "cupy:stream_k=1,tma=1,trim=1" &
  timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 128 --shapes "$LARGE" &
  timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL" --page 64 --shapes "$MID" &
  wait
} > "$OUT/precompile.log" 2>&1
grep variants "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu tests/test_backends_gpu.py \
    -k "stream_k" -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -5 >> "$OUT/summary.txt"
fi
RESERVE=15
budgeted_table large 220 --shapes "$LARGE" --page 128 --rounds 2 --impl "$IMPL" --baseline "$FI"
budgeted_table mid 100 --shapes "$MID" --page 64 --impl "$IMPL" --baseline flashinfer-fa2
RESERVE=${NCU_S:-100}
budgeted_table limiter 90 --shapes 32x8k,8x32k --page 128 --rounds 2 --baseline none \
  --impl "$T;$T,skip_compute=1;$T,skip_loads=1"
cases=""
for shape in "32 8192 128" "8 32768 128"; do
  for impl in "$T" "$T,skip_compute=1" "$T,skip_loads=1"; do
    cases+="$shape $impl qwen3-8b-dflash-b16"$'\n'
  done
done
NCU_CASES="$cases" timeout -s INT -k 10 "$(clamp $(( $(left) - 15 )) 150 20)" bash "$(dirname "$0")/gpu_ncu.sh"
echo "ncu rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
mv "$OUT/ncu_full.txt" "$OUT/ncu-full" 2>/dev/null
finish_tables large mid limiter ncu-full
