#!/usr/bin/env bash
# Three CTAs an SM on the 4-warp wgmma path (issues 11 and 12): 32-key tiles, not pipelined,
# registers capped at 168 by `min_ctas=3` (compiles without spills at 64 KB of shared memory a
# CTA), beside the tuned picks, on one H200 in about 4 minutes:
#   OUT=/some/dir bash scripts/gpu_occupancy.sh        (repository root; carry .whl)
# 1. laguna-dflash page 64, B=8 and B=32 ctx 8k, 2 interleaved rounds: `trim=1` (the tuned pick),
#    the 3-CTA variants in 4 and 3 stages, and math only (`skip_loads=1`) of both   -> laguna.md
# 2. the main preset page 64, B=1 and B=8 ctx 8k: the default, ws=3 on 32-key tiles (the tuned
#    pick below batch 8) and the 3-CTA variant                                      -> main.md
# IMPL_L / IMPL_M override the variants of tables 1 and 2.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_occupancy
THREE="tile_n=32,stages=4,min_ctas=3,overlap=0"
IMPL_L=${IMPL_L:-"cupy:trim=1;cupy:$THREE;cupy:tile_n=32,stages=3,min_ctas=3,overlap=0;cupy:trim=1,skip_loads=1;cupy:$THREE,skip_loads=1"}
IMPL_M=${IMPL_M:-"cupy;cupy:ws=3,tile_n=32,stages=9;cupy:$THREE"}
{
  timeout 90 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL_L" --preset laguna-dflash --page 64
  timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL_M" --page 64
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
RESERVE=20
budgeted_table laguna 170 --preset laguna-dflash --shapes 8x8k,32x8k --page 64 --impl "$IMPL_L" \
  --baseline none --rounds 2
budgeted_table main 90 --shapes 1x8k,8x8k --page 64 --impl "$IMPL_M" --baseline none
for name in laguna main; do
  f="$OUT/$name/attention_rounds.md"; [ -f "$f" ] || f="$OUT/$name/attention.md"
  [ -f "$f" ] && cp "$f" "$OUT/$name.md"
done
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log laguna main 2>/dev/null
rm -rf "$OUT/laguna" "$OUT/main" "$OUT/precompile.log"
for name in laguna main; do
  echo "== $name"; [ -f "$OUT/$name.md" ] && grep -E "^\| " "$OUT/$name.md" | cut -c1-170 | head -40
done
