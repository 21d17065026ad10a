#!/usr/bin/env bash
# The burst table's picks against the sustained table's (profiles/sm90.json, sm90-sustained.json)
# side by side in one run: each point timed after a sustained load (--sustain, ROUNDS rounds),
# then in bursts (one round), so that both the gain under load and the cost in bursts show.
# SUSTAIN_LOAD=gemm holds the sustained state with a co-runner's matmuls (a target model's load)
# instead of each step's own.
#   OUT=/some/dir SHAPES=8x32k,8x128k,64x8k PAGES=64,128 ROUNDS=2 bash scripts/gpu_regimes.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
shapes=${SHAPES:-8x32k,8x128k,64x8k} pages=${PAGES:-64,128}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/summary.txt"
python3 scripts/precompile_gpu_matrix.py --no-tests --table "auto:burst;auto:sustained" --shapes "$shapes" \
  --page "$pages" 2>&1 | tail -n 1
for run in "sustained --sustain ${SUSTAIN:-0.75} --sustain-load ${SUSTAIN_LOAD:-self} --rounds ${ROUNDS:-2}" \
           "burst --rounds 1"; do
  read -r name rest <<< "$run"
  mkdir -p "$OUT/$name"
  # shellcheck disable=SC2086
  timeout -s INT -k 10 "${TABLE_S:-240}" python3 -m drafter_attn.bench.attention_table --shapes "$shapes" \
    --page "$pages" --impl "auto:burst;auto:sustained" --baseline none --db "/tmp/regimes.db" \
    --out "$OUT/$name" $rest > "$OUT/$name/table.log" 2>&1
  echo "$name: exit $?"
  tail -n 25 "$OUT/$name/table.log"
done
# a device run returns at most 8 files: the tables' folders as one archive
tar czf "$OUT/regimes.tgz" -C "$OUT" sustained burst && rm -rf "$OUT/sustained" "$OUT/burst"
