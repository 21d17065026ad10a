#!/usr/bin/env bash
# What the runtime runs (the shipped tuned table's pick, `--impl auto`) beside the default kernel,
# FlashInfer's per-shape and graph-mode plans and the read floor, at the rows of issues 11 and 12,
# in one device call of at most 9.5 minutes (an H200):
#   OUT=/some/dir bash scripts/gpu_tuned.sh        (repository root; carry .whl)
# 1. GPU tests of the call paths and of the attention table (tests/test_launch.py, test_ops.py,
#    test_syncs_gpu.py, test_dispatch.py, test_bench_gpu.py -k attention_table)  -> tests.log
# 2. main preset, page 64: B=1 2k/8k/32k and B=8 8k, 2 interleaved rounds         -> small.csv
# 3. main preset, page 128: B=32 8k and B=8 32k                                   -> large.csv
# 4. laguna-dflash, page 64: B=8 and B=32 ctx 8k                                  -> laguna.csv
# 5. main preset, page 64: B=1 and B=4 ctx 128k (LONG: other shapes), FlashInfer's
#    per-shape plan, LONG_ROUNDS interleaved rounds (1)                            -> long.csv
# 6. bench decode --impl auto,cupy, B=1 and 8 at ctx 8k (the 5-layer step)        -> decode.txt
# TABLES (default "small large laguna long decode") picks the steps after the tests; SKIP_TESTS=1
# leaves the tests out.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TOTAL=${TOTAL:-560}
budgeted_run gpu_tuned
FI=flashinfer-fa2,flashinfer-fa2-graph
SMALL="1x2k,1x8k,1x32k,8x8k" LARGE="32x8k,8x32k" LAGUNA="8x8k,32x8k" LONG=${LONG:-1x128k,4x128k}
{
  pre() { timeout 120 python3 scripts/precompile_gpu_matrix.py --no-tests --table "auto;cupy" "$@"; }
  pre --page 64 --shapes "$SMALL,$LONG,1x1k,8x1k,1x2k" & pre --page 128 --shapes "$LARGE" &
  pre --page 64 --shapes "$LAGUNA" --preset laguna-dflash & wait
} > "$OUT/precompile.log" 2>&1
grep variants "$OUT/precompile.log" | tee -a "$OUT/summary.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout -s INT -k 10 "${TEST_S:-120}" python3 -m pytest -q -m gpu tests/test_launch.py tests/test_ops.py \
    tests/test_syncs_gpu.py tests/test_dispatch.py tests/test_bench_gpu.py::test_attention_table_small \
    tests/test_bench_gpu.py::test_attention_table_auto_runs_the_runtime_pick -p no:cacheprovider > "$OUT/tests.log" 2>&1
  echo "tests rc=$? after ${SECONDS}s: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
RESERVE=25
TABLES=${TABLES:-"small large laguna long decode"}
want() { [[ " $TABLES " == *" $1 "* ]]; }
want small && budgeted_table small 170 --shapes "$SMALL" --page 64 --rounds 2 --impl "auto;cupy" --baseline "$FI"
want large && budgeted_table large 90 --shapes "$LARGE" --page 128 --impl "auto;cupy" --baseline "$FI"
want laguna && budgeted_table laguna 45 --preset laguna-dflash --shapes "$LAGUNA" --page 64 --impl auto --baseline none
want long && budgeted_table long "${LONG_S:-90}" --shapes "$LONG" --page 64 --impl "auto;cupy" \
  --baseline flashinfer-fa2 --rounds "${LONG_ROUNDS:-1}"
if want decode; then
  # no --db: auto reads the shipped table, as `make bench` does (rows go to profiles/profile.db there)
  timeout -s INT -k 10 "$(clamp 60 $(( $(left) - 15 )) 15)" python3 -m drafter_attn.bench.cli decode --sm 90 \
    --impl auto,cupy --batch 1,8 --ctx 8k --page 64 --baseline none --out "$OUT/decode" > "$OUT/decode.txt" 2>&1
  echo "decode rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
fi
# What comes back (at most 8 files): summary.txt (with the tests' and the decode's picks), the four
# tables' CSVs, decode.txt and logs.tgz (every markdown table, the logs, the run's database)
[ -f "$OUT/tests.log" ] && tail -n 5 "$OUT/tests.log" >> "$OUT/summary.txt"
grep -h "impl picked" "$OUT/decode.txt" >> "$OUT/summary.txt" 2>/dev/null
finish_tables small large laguna long decode
grep -E "^\s*(│|\|)|^ (step|decode) " "$OUT/decode.txt" 2>/dev/null | head -30
