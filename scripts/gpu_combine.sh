#!/usr/bin/env bash
# The split combine with a CTA a row (`cupy:combine=2`) on an H200, in about 2 minutes: its GPU
# tests (the cupy matrix for `cupy:combine=2`: forced splits, every mask, pages, GQA, graph
# replays), the split call's parts (scripts/diag_split_parts.py: whole, attention alone, combine
# alone) for both combines, then one layer at the split shapes beside the default, 2 rounds.
#   OUT=/some/dir bash scripts/gpu_combine.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
IM="cupy;cupy:combine=2"
timeout 60 python3 scripts/precompile_gpu_matrix.py cupy:combine=2 --table "$IM" --page 64 \
  > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log"
python3 -m pytest --collect-only -q -m gpu tests/test_backends_gpu.py 2>/dev/null \
  | grep -E "cupy:combine=2\]" > /tmp/combine_ids.txt
mapfile -t ids < /tmp/combine_ids.txt
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=10 -rf "${ids[@]}" \
  > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tail -n 8
for impl in cupy cupy:combine=2; do
  timeout 40 python3 scripts/diag_split_parts.py --impl "$impl" --reps 100 2>&1 | grep -v Warn \
    | tee -a "$OUT/split_parts.txt"
done
timeout 60 python3 -m drafter_attn.bench.attention_table --shapes 1x2k,1x8k,1x32k,8x8k --page 64 \
  --impl "$IM" --baseline none --rounds 2 --db /tmp/combine.db --out "$OUT/table" > "$OUT/table.log" 2>&1
rm -f "$OUT/table/attention.json"
grep -E "^\| cupy" "$OUT/table/attention_rounds.md" | cut -c1-140
