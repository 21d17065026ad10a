#!/usr/bin/env bash
# The split combine by programmatic dependent launch (`cupy:pdl=1`) on an H200, in about 4
# minutes: its GPU tests (the cupy matrix for `cupy:pdl=1`, tests/test_pdl.py), then one layer of
# the main preset at the split shapes (B=1 ctx 2k-32k, B=8 ctx 8k, page 64 and the arena) beside
# the default, 2 interleaved rounds.
#   OUT=/some/dir bash scripts/gpu_pdl.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
IM="cupy;cupy:pdl=1"
timeout 90 python3 scripts/precompile_gpu_matrix.py cupy:pdl=1 --table "$IM" --page 64 > $OUT/precompile.log 2>&1
tail -n 1 $OUT/precompile.log
python3 -m pytest --collect-only -q -m gpu tests/test_backends_gpu.py 2>/dev/null | grep -E "cupy:pdl=1\]" > /tmp/pdl_ids.txt
mapfile -t ids < /tmp/pdl_ids.txt
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=10 -rf "${ids[@]}" tests/test_pdl.py > $OUT/gpu_tests.log 2>&1
grep -E "^[0-9]+ (passed|failed)|passed|^FAILED|^ERROR" $OUT/gpu_tests.log | tail -n 12
timeout 130 python3 -m drafter_attn.bench.attention_table --shapes 1x2k,1x8k,1x32k,8x8k --page 64 \
  --impl "$IM" --baseline none --rounds 2 --db /tmp/pdl.db --out $OUT/pdl > $OUT/table.log 2>&1
echo "table rc=$?"
rm -f $OUT/pdl/attention.json
grep -E "^\| cupy" $OUT/pdl/attention_rounds.md | cut -c1-140
