#!/usr/bin/env bash
# Where a small-batch split call's time goes, on one H200, in one device call of about 4 minutes
# (issue 11):
#   OUT=/some/dir bash scripts/gpu_timeline.sh        (repository root; carry .whl)
# 1. GPU tests: the trace (tests/test_trace.py), the launch path and the ops    -> tests.log
# 2. with CARVEOUT=1, scripts/diag_carveout.py: the table's picks ($CASES: B=1 2k/8k/32k, B=8
#    8k, page 64) with the kernels' default shared-memory carveout and with the largest,
#    alternating (measured level on 2026-12-03)                                  -> carveout.txt
# 3. scripts/diag_timeline.py: the same calls CTA by CTA (TRACE=1 builds, and PROBES),
#    and laguna's B=8 and B=32 8k             -> timeline_main.txt, timeline_laguna.txt, *.json.gz
# TESTS names the test files; PROBES="--probe NAME ..." adds
# traced builds with a probe's define (docs/experiments/trace-probes.patch: two, both level).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  git log -1 --format='commit %h %s' 2>/dev/null
} > "$OUT/summary.txt"
# The shipped table's picks on the H200 (results/sm90-2026-12-04/session24/final/), named
# outright: until a kernel-source edit is re-keyed the table misses and `auto` takes the defaults
CASES=${CASES:-"1x2k combine=2,early_ids=1,lean=1,one_trip=1,q_step=1,stages=9,tile_n=32,ws=3
1x8k combine=2,lean=1,one_trip=1,stages=9,tile_n=32,ws=3
1x32k combine=2,early_ids=1,lean=1,one_trip=1,q_step=1,stages=6,tile_n=32,ws=3
8x8k combine=1,early_ids=1,lean=1,one_trip=1,stages=6,tile_n=32,ws=3"}
PROBES=${PROBES-}
LAGUNA=${LAGUNA:-"8x8k,32x8k early_ids=1,lean=1,stages=6,tile_n=32,ws=3,ws_overlap=1,ws_rows=1"}
TESTS=${TESTS:-tests/test_trace.py tests/test_launch.py tests/test_ops.py}
timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu $TESTS -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
mkdir -p "$OUT/main" "$OUT/laguna"
while read -r shape spec; do
  [ -n "${CARVEOUT:-}" ] && timeout 60 python3 scripts/diag_carveout.py --shapes "$shape" \
    --impl "cupy:$spec" >> "$OUT/carveout.txt" 2>&1
  timeout 60 python3 scripts/diag_timeline.py --shapes "$shape" --impl "cupy:$spec" $PROBES \
    --out "$OUT/main/$shape" >> "$OUT/timeline_main.txt" 2>&1
  echo "$shape rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
done <<< "$CASES"
read -r shapes spec <<< "$LAGUNA"
timeout 100 python3 scripts/diag_timeline.py --preset laguna-dflash --shapes "$shapes" $PROBES \
  --impl "cupy:$spec" --out "$OUT/laguna" > "$OUT/timeline_laguna.txt" 2>&1
echo "laguna timeline rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
python3 - "$OUT" <<'PY'  # the main preset's per-shape JSON as one file
import gzip, json, sys, pathlib
out = pathlib.Path(sys.argv[1])
merged = {}
for f in sorted((out / "main").glob("*/timeline.json.gz")):
    merged.update(json.loads(gzip.open(f, "rt").read()))
with gzip.open(out / "timeline_main.json.gz", "wt") as f:
    json.dump(merged, f)
PY
mv "$OUT/laguna/timeline.json.gz" "$OUT/timeline_laguna.json.gz" 2>/dev/null
rm -rf "$OUT/main" "$OUT/laguna"
tail -n 25 "$OUT/tests.log" | grep -E "passed|failed|Error" | tail -n 5
cat "$OUT/carveout.txt" "$OUT/timeline_main.txt" 2>/dev/null "$OUT/timeline_laguna.txt" | grep -v Warning | tail -n 40
