#!/usr/bin/env bash
# Where a small-batch split call's time goes, on one H200, in one device call of about 4 minutes
# (issue 11):
#   OUT=/some/dir bash scripts/gpu_timeline.sh        (repository root; carry .whl)
# 1. GPU tests: the trace (tests/test_trace.py), the launch path and the ops    -> tests.log
# 2. scripts/diag_carveout.py: the table's picks at B=1 2k/8k/32k and B=8 8k, page 64, with the
#    kernels' default shared-memory carveout and with the largest, alternating    -> carveout.txt
# 3. scripts/diag_timeline.py: the same calls CTA by CTA (TRACE=1 builds), and laguna's B=8 and
#    B=32 8k                                     -> timeline_main.txt, timeline_laguna.txt, *.json
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  git log -1 --format='commit %h %s' 2>/dev/null
} > "$OUT/summary.txt"
SHAPES=${SHAPES:-1x2k,1x8k,1x32k,8x8k}
timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu tests/test_trace.py \
  tests/test_launch.py tests/test_ops.py -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
timeout 120 python3 scripts/diag_carveout.py --shapes "$SHAPES" > "$OUT/carveout.txt" 2>&1
echo "carveout rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
timeout 150 python3 scripts/diag_timeline.py --shapes "$SHAPES" --out "$OUT/main" \
  > "$OUT/timeline_main.txt" 2>&1
echo "timeline rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
timeout 100 python3 scripts/diag_timeline.py --preset laguna-dflash --shapes 8x8k,32x8k \
  --out "$OUT/laguna" > "$OUT/timeline_laguna.txt" 2>&1
echo "laguna timeline rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
mv "$OUT/main/timeline.json" "$OUT/timeline_main.json" 2>/dev/null
mv "$OUT/laguna/timeline.json" "$OUT/timeline_laguna.json" 2>/dev/null
rmdir "$OUT/main" "$OUT/laguna" 2>/dev/null
tail -n 25 "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -n 5
cat "$OUT/carveout.txt" "$OUT/timeline_main.txt" "$OUT/timeline_laguna.txt" | grep -v Warning | tail -n 40
