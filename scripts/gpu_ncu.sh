#!/usr/bin/env bash
# Nsight Compute on single attention kernels (cold L2, clocks as they run), one case per line of
# $NCU_CASES: "B ctx page impl preset" (scripts/ncu_case.py; impl a registry spec such as
# cupy:skip_loads=1). Default: the small-batch rows of issue 11, each as the full kernel, loads
# only (skip_compute=1) and math only (skip_loads=1).
#   OUT=/some/dir [NCU_CASES=...] bash scripts/gpu_ncu.sh
# $OUT gets ncu_full.txt (every section) and ncu.txt (the lines that name the limiter).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
small=""
for shape in "1 2048 64" "1 8192 64" "1 32768 64" "8 8192 64" "32 8192 128"; do
  for impl in cupy cupy:skip_compute=1 cupy:skip_loads=1; do
    small+="$shape $impl qwen3-8b-dflash-b16"$'\n'
  done
done
while read -r b ctx page impl preset; do
  [ -n "$b" ] || continue
  echo "== B=$b ctx=$ctx page=$page $impl $preset"
  timeout 90 ncu --clock-control none -k regex:attention --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --print-details all \
    python3 scripts/ncu_case.py "$b" "$ctx" "$page" "$impl" "$preset" 2>&1 | grep -v "^==PROF=="
done > "$OUT/ncu_full.txt" <<< "${NCU_CASES:-$small}"
grep -E "^== |Duration|DRAM Throughput|L2 Hit Rate|Mem Busy|Max Bandwidth|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Shared Memory.*%|stalled|This stall type" \
  "$OUT/ncu_full.txt" | cut -c1-200 > "$OUT/ncu.txt"
