#!/usr/bin/env bash
# Small-batch cycle on the H200 (issue 11): cupy GPU tests, per-kernel device time at B=1 (ncu:
# attention vs combine), then the small-batch table (kernels, loads only, math only, FlashInfer
# in both plans, XQA, read floor) and a split-count sweep at B=1.
#   OUT=/some/dir bash scripts/gpu_b1.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
FINAL=$OUT; OUT=$(mktemp -d)  # many files: packed into one archive at the end
trap 'tar czf "$FINAL/gpu_b1.tgz" -C "$OUT" . ; cp "$OUT"/*.txt "$FINAL"/ 2>/dev/null' EXIT
python3 scripts/precompile_gpu_matrix.py cupy cupy:wgmma=0 > "$OUT/precompile.log" 2>&1
python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=10 -rf -k "not cutlass" tests/ > "$OUT/gpu_tests.log" 2>&1
tail -n 3 "$OUT/gpu_tests.log"
for ctx in 2048 8192 32768; do
  for impl in cupy cupy:skip_loads=1; do
    ncu --clock-control none -k regex:drafter --launch-skip 4 --launch-count 2 \
        --metrics gpu__time_duration.sum --csv python3 scripts/ncu_case.py 1 $ctx 64 "$impl" 2>/dev/null \
      | grep '"gpu__time' | awk -F'","' -v c=$ctx -v i="$impl" '{gsub(/"/,"",$NF); print "ncu", c, i, $5, $NF " ns"}'
  done
done | tee "$OUT/b1_ncu.txt"
t() { python3 -m drafter_attn.bench.attention_table "$@" | grep -v "^{"; }
t --shapes 1x2k,1x8k,1x32k,8x8k,32x8k,8x32k --page 64,128 --impl "cupy;cupy:skip_compute=1;cupy:skip_loads=1" \
  --db "$OUT/small.db" --out "$OUT/small" > "$OUT/small.txt" 2>&1
t --shapes 1x8k,1x32k --page 64 --baseline none --db "$OUT/splits.db" --out "$OUT/splits" --impl \
  "cupy;cupy:num_splits=16;cupy:num_splits=32;cupy:num_splits=48;cupy:num_splits=64" > "$OUT/splits.txt" 2>&1
cat "$OUT/splits.txt" | cut -c1-150 | tail -n 16
cat "$OUT/small.txt" | cut -c1-150 | tail -n 40
python3 scripts/host_profile.py 2000 2>&1 | head -4 | tee "$OUT/host_time.txt"
