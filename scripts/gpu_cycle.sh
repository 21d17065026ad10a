#!/usr/bin/env bash
# One build-check-time cycle on a GPU machine (the H200 device of this workplace):
#   bash scripts/gpu_cycle.sh [tests|table|all] [extra args for the table]
# Installs the carried wheels (.whl/: nvidia-cutlass, flashinfer) into /tmp/site, runs the GPU
# tests and the attention table, and leaves logs and results under $OUT (or ./out).
set -uo pipefail
what=${1:-all}; shift || true
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf tests/ > "$OUT/gpu_tests.log" 2>&1 || rc=$?
  tail -n 40 "$OUT/gpu_tests.log"
fi
if [[ $what == table || $what == all ]]; then
  python3 -m drafter_attn.bench.attention_table --out "$OUT/table" "$@" > "$OUT/table.log" 2>&1 || rc=$?
  grep -v "^{" "$OUT/table.log" | tail -n 60
fi
exit $rc
