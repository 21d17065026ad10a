#!/usr/bin/env bash
# The performance targets of the suite (results/perf-notes.md), on the GPU at hand:
#   OUT=/some/dir bash scripts/perf_targets.sh [STAGE ...]        (default: presets)
#   small    the small-batch table of the kernels (and loads only) against FlashInfer in both
#            plans, TensorRT-LLM's XQA and the read floor, at the shapes a drafter serves
#   main     the main preset table (B 1/8/32 x ctx 2k/8k/32k x pages 16/64/128 + arena +
#            FlashInfer fa2; also stage 1 of scripts/gpu_results.sh)
#   presets  the sliding preset at 2k vs 32k; gpt-oss (head_dim 64, Qb 8) and laguna (GQA 9,
#            sliding_causal) at B=32 ctx 8k
#   b1       where batch 1 loses its time: the timing method's fixed cost (an empty graph, cold
#            and warm L2), then split counts, pipeline depth and loads only (skip_compute) beside
#            the default and FlashInfer
#   laguna   GQA 9 (144 rows, 9 warps, mma.sync): splits, occupancy, tiles and loads only
#   page16   page 16 against 64 and the arena: DRAM gathers of 4 KB page slices
#            (scripts/diag_gather.py), then tiles, the mma.sync path and loads only
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
t() { python3 -m drafter_attn.bench.attention_table "$@" | grep -v "^{"; }
for stage in "${@:-presets}"; do
  case $stage in
    small) t --shapes 1x2k,1x8k,1x32k,8x8k,32x8k,8x32k --page 64,128 --impl "cupy;cupy:skip_compute=1;cupy:skip_loads=1" \
             --db /tmp/small.db --out "$OUT/small" ;;
    main) t --out "$OUT/main" ;;
    presets)
      t --preset dflash2-w2048 --batch 1,8,32 --ctx 2k,32k --page 64 --baseline none --out "$OUT/sliding"
      t --preset gpt-oss-20b-dflash --batch 32 --ctx 8k --page 64,128 --out "$OUT/gpt-oss"
      t --preset laguna-dflash --batch 32 --ctx 8k --page 64,128 --baseline none --out "$OUT/laguna" ;;
    b1)
      python3 scripts/diag_timing.py
      t --batch 1 --ctx 2k,8k,32k --page 64 --out "$OUT/b1" --impl \
        "cupy;cupy:num_splits=1;cupy:num_splits=4;cupy:num_splits=8;cupy:num_splits=16;cupy:num_splits=32;cupy:num_splits=64;cupy:stages=4;cupy:tile_n=32,stages=6;cupy:skip_compute=1" ;;
    laguna)
      t --preset laguna-dflash --batch 32 --ctx 8k --page 64 --baseline none --out "$OUT/laguna-diag" --impl \
        "cupy;cupy:num_splits=2;cupy:num_splits=4;cupy:min_ctas=2;cupy:tile_n=32,stages=4;cupy:stages=2;cupy:skip_compute=1" ;;
    page16)
      python3 scripts/diag_gather.py
      t --batch 8,32 --ctx 8k,32k --page 16,64 --baseline none --out "$OUT/page16-diag" --impl \
        "cupy;cupy:tile_n=32;cupy:tile_n=128,stages=2;cupy:wgmma=0;cupy:skip_compute=1" ;;
    *) echo "unknown stage $stage (small, main, presets, b1, laguna, page16)" >&2; exit 2 ;;
  esac
done
