#!/usr/bin/env bash
# Host time per eager call (issue 13) after a change to the per-call path, on an H200, in about
# 5 minutes: the GPU tests that run every call path (the default cupy matrix, eager and
# graph-replayed; the custom ops, torch.compile and Runtime; host syncs), then scripts/host_profile.py and the
# pytest-benchmark host-time benchmarks.
#   OUT=/some/dir bash scripts/gpu_host_time.sh
# $OUT gets gpu_tests_tail.txt, host_profile.txt and host_overhead.json (and the logs behind them).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 120 python3 scripts/precompile_gpu_matrix.py cupy > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log"
# the default cupy spec's matrix (every call goes through the plan lookup and launch path)
mapfile -t matrix < <(python3 -m pytest --collect-only -q tests/test_backends_gpu.py 2>/dev/null \
  | grep -E '[-[]cupy\]')
{ timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=10 -rf "${matrix[@]}"
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=10 -rf \
    tests/test_launch.py tests/test_ops.py tests/test_syncs_gpu.py tests/test_dispatch.py; } > "$OUT/gpu_tests.log" 2>&1
grep -E "^[0-9]+ (passed|failed)|^FAILED|^ERROR" "$OUT/gpu_tests.log" | tee "$OUT/gpu_tests_tail.txt"
timeout 150 python3 scripts/host_profile.py > "$OUT/host_profile.txt" 2>&1
cat "$OUT/host_profile.txt"
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_host_overhead_gpu.py \
  --benchmark-json="$OUT/host_overhead.json" --benchmark-columns=median,min,rounds 2>&1 | tail -n 12
