#!/usr/bin/env bash
# The two split combines side by side on an H200, in about 2.5 minutes: a warp a row
# (`cupy:combine=1`) and a CTA a row (`cupy:combine=2`, the default up to 512 packed rows a call,
# kernels/cupy_backend.py COMBINE_CTA_MAX_ROWS). Their GPU tests (the cupy matrix of `cupy`, whose
# test shapes mostly take the CTA-a-row default, and of `cupy:combine=1`: forced splits, every
# mask, pages, GQA, graph replays), a split call's parts (scripts/diag_split_parts.py: whole,
# attention alone, combine alone) for both combines, then one layer at the split shapes, B=2 and
# B=4 included (the rows between the measured 512 and 4096), 2 rounds.
#   OUT=/some/dir bash scripts/gpu_combine.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
IM="cupy:combine=1;cupy:combine=2"
SHAPES=1x2k,1x8k,1x32k,2x8k,4x8k,8x8k
timeout 60 python3 scripts/precompile_gpu_matrix.py cupy cupy:combine=1 --table "$IM" --page 64 \
  > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log"
python3 -m pytest --collect-only -q -m gpu tests/test_backends_gpu.py 2>/dev/null \
  | grep -E "(cupy|cupy:combine=1)\]" > /tmp/combine_ids.txt
mapfile -t ids < /tmp/combine_ids.txt
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=10 -rf "${ids[@]}" \
  > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 8
for impl in cupy:combine=1 cupy:combine=2; do
  timeout 50 python3 scripts/diag_split_parts.py --impl "$impl" --shapes "$SHAPES" --reps 100 \
    2>&1 | grep -v Warn | tee -a "$OUT/split_parts.txt"
done
timeout 80 python3 -m drafter_attn.bench.attention_table --shapes "$SHAPES" --page 64 \
  --impl "$IM" --baseline none --rounds 2 --db /tmp/combine.db --out "$OUT/table" > "$OUT/table.log" 2>&1
rm -f "$OUT/table/attention.json"
grep -E "^\| cupy" "$OUT/table/attention_rounds.md" | cut -c1-140
