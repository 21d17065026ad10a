#!/usr/bin/env bash
# The performance targets of the suite (results/perf-notes.md), on the GPU at hand:
#   OUT=/some/dir bash scripts/perf_targets.sh [main]
# main preset table (B 1/8/32 x ctx 2k/8k/32k x pages 16/64/128 + arena + FlashInfer fa2) only
# with "main" (it is also stage 1 of scripts/gpu_results.sh); always: the sliding preset at 2k vs
# 32k, and gpt-oss (head_dim 64, Qb 8) and laguna (GQA 9, sliding_causal) at B=32 ctx 8k.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t() { python3 -m bench.attention_table --reps 50 "$@" | grep -v "^{"; }
[[ ${1:-} == main ]] && t --out "$OUT/main"
t --preset dflash2-w2048 --batch 1,8,32 --ctx 2k,32k --page 64 --baseline none --out "$OUT/sliding"
t --preset gpt-oss-20b-dflash --batch 32 --ctx 8k --page 64,128 --out "$OUT/gpt-oss"
t --preset laguna-dflash --batch 32 --ctx 8k --page 64,128 --baseline none --out "$OUT/laguna"
