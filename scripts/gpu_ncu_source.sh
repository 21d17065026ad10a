#!/usr/bin/env bash
# Nsight Compute's per-instruction warp-stall sampling (the source page, SASS) of single attention
# kernels, cold L2, clocks as they run: where in the kernel the warps wait, instruction by
# instruction. One case per line of $NCU_CASES, "B ctx page impl preset" (scripts/ncu_case.py).
#   OUT=/some/dir [NCU_CASES=...] bash scripts/gpu_ncu_source.sh
# $OUT gets, per case N, case_N.txt (the sections: duration, stalls) and case_N_sass.csv (every
# SASS instruction with its samples); scripts/ncu_source_summary.py reads them.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
default="1 8192 64 cupy qwen3-8b-dflash-b16
1 8192 64 cupy:num_splits=4 qwen3-8b-dflash-b16"
n=0
while read -r b ctx page impl preset; do
  [ -n "$b" ] || continue
  n=$((n + 1))
  echo "B=$b ctx=$ctx page=$page $impl $preset" > "$OUT/case_$n.txt"
  timeout 150 ncu --clock-control none -k regex:attention --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --warp-sampling-interval 0 --import-source no -f -o "/tmp/case_$n" \
    python3 scripts/ncu_case.py "$b" "$ctx" "$page" "$impl" "$preset" > "/tmp/case_$n.log" 2>&1
  ncu -i "/tmp/case_$n.ncu-rep" --print-details all >> "$OUT/case_$n.txt" 2>&1
  ncu -i "/tmp/case_$n.ncu-rep" --page source --print-source sass --csv > "$OUT/case_${n}_sass.csv" 2>&1
  tail -3 "/tmp/case_$n.log" >> "$OUT/case_$n.txt"
  grep -E "^B=|Duration|Warp Cycles Per Issued" "$OUT/case_$n.txt"
done <<< "${NCU_CASES:-$default}"
tar czf "$OUT/ncu_source.tgz" -C "$OUT" $(cd "$OUT" && ls case_*) && rm -f "$OUT"/case_*
