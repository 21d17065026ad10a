#!/usr/bin/env bash
# The warp-specialised kernel (`cupy:ws=2` / `=3`, kernels/cuda/warp_specialized.cuh) on one H200,
# in one device call of at most 9 minutes: its GPU tests, then one layer beside the default kernel,
# the read floor and FlashInfer's per-shape and graph-mode plans, at the rows issues 11 and 12 miss.
#   OUT=/some/dir bash scripts/gpu_ws.sh        (repository root; carry .whl)
# 1. pytest -m gpu tests/test_backends_gpu.py -k "ws and not cutlass"        -> tests.log
# 2. main preset, page 64: B=1 2k/8k/32k, B=4 8k, B=8 8k, 2 rounds             -> small.md
#    and B=1 128k, also at 16 splits                                          -> long.md
# 3. main preset, page 16: B=32 8k/32k against the arena                       -> page16.md
# 4. laguna-dflash page 64, B=8 and B=32 ctx 8k                                -> laguna.md
# IMPL (default below) names the variants of table 2, IMPL2 those of tables 3 and 4; TABLES (default
# "small long page16 laguna") the tables to run, SMALL_S the seconds of table 2 (150),
# LAGUNA_SHAPES / LAGUNA_S / LAGUNA_ROUNDS table 4's shapes, seconds and rounds; TEST_K the tests'
# -k expression (default "ws and not cutlass"), or TEST_GREP a regex of their node ids, and
# TEST_SPECS the specs they compile first;
# SKIP_TESTS=1 skips step 1.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_ws
IMPL=${IMPL:-"cupy;cupy:ws=2;cupy:ws=2,skip_compute=1"}
IMPL2=${IMPL2:-"cupy;cupy:ws=2"}
{
  timeout 120 python3 scripts/precompile_gpu_matrix.py ${TEST_SPECS:-cupy:ws=2 cupy:ws=3}
  timeout 100 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL;$IMPL2" --page 16,64
  timeout 60 python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPL2" --preset laguna-dflash --page 64
} > "$OUT/precompile.log" 2>&1
tail -n 1 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  if [ -n "${TEST_GREP:-}" ]; then  # node ids (pytest's -k takes no "=", as in cupy:ws=4)
    mapfile -t sel < <(python3 -m pytest --collect-only -q tests/test_backends_gpu.py 2>/dev/null \
      | grep -E "$TEST_GREP")
  else
    sel=(tests/test_backends_gpu.py -k "${TEST_K:-ws and not cutlass}")
  fi
  timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -m gpu "${sel[@]}" \
    -x -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=30
TABLES=${TABLES:-"small long page16 laguna"}
want() { [[ " $TABLES " == *" $1 "* ]]; }
want small && budgeted_table small "${SMALL_S:-150}" --shapes ${SHAPES:-1x2k,1x8k,1x32k,4x8k,8x8k} --page 64 --rounds 2 --impl "$IMPL" \
  --baseline flashinfer-fa2,flashinfer-fa2-graph
want long && budgeted_table long 60 --shapes 1x128k --page 64 --impl "cupy;cupy:ws=2;cupy:ws=2,num_splits=16" --baseline none
want page16 && budgeted_table page16 80 --shapes 32x8k,32x32k --page 16 --impl "$IMPL2" --baseline none
want laguna && budgeted_table laguna "${LAGUNA_S:-60}" --preset laguna-dflash --shapes "${LAGUNA_SHAPES:-8x8k,32x8k}" \
  --page 64 --impl "$IMPL2" --baseline none --rounds "${LAGUNA_ROUNDS:-1}"
for name in small long page16 laguna; do
  f="$OUT/$name/attention_rounds.md"; [ -f "$f" ] || f="$OUT/$name/attention.md"
  [ -f "$f" ] && cp "$f" "$OUT/$name.md"
done
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log small long page16 laguna 2>/dev/null
rm -rf "$OUT/small" "$OUT/long" "$OUT/page16" "$OUT/laguna" "$OUT/precompile.log"
for name in small long page16 laguna; do
  echo "== $name"; [ -f "$OUT/$name.md" ] && grep -E "^\| " "$OUT/$name.md" | cut -c1-170 | head -40
done
