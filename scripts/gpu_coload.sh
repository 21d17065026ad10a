#!/usr/bin/env bash
# The sustained regime under a target model's load, in one device call (an H200):
#  1. the GPU tests of the co-load path and of every shipped pick (tests/test_shipped_picks_gpu.py),
#     and of the thirty-second session's measurement changes (baselines over every layer in one
#     call, peak_bytes without what was live before the step);
#  2. `tuner refine --with-winners --with-default --again` under the gemm co-runner at the keys
#     KEYS selects (default: the main preset's B=1 128k warp-specialised picks, whose runners-up
#     left out the default TMA kernel that scripts/diag_coload.py timed 6.6% faster there): every
#     candidate of those keys timed in one run, the L2 now flushed after the co-runner (the rows
#     of the thirty-first session were not: --again keeps the two methods from meeting in a key),
#     into a copy of profiles/sm90.db, and the sustained table exported from it beside the
#     shipped one (`tuner diff`);
#  3. both shipped tables' picks side by side under that load (scripts/gpu_regimes.sh, SUSTAIN_LOAD=gemm).
#   OUT=/some/dir bash scripts/gpu_coload.sh            (repository root; carry .whl; REGIMES=0
#                                                        leaves out step 3)
# then, in a checkout: cp OUT/sm90.db profiles/sm90.db and export the sustained table (profiles/README.md).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
KEYS=${KEYS:-"--where ws --preset qwen3-8b-dflash-b16 --max-batch 1 --min-ctx 128k"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader > "$OUT/summary.txt"
python3 scripts/precompile_gpu_matrix.py --shipped --no-tests 2>&1 | tail -n 1
timeout -s INT -k 10 "${TEST_S:-200}" python3 -m pytest -q -m gpu -n "${XDIST:-8}" -p no:cacheprovider \
  tests/test_shipped_picks_gpu.py tests/test_bench_gpu.py tests/test_tuner_gpu.py \
  -k "shipped or co_runner or every_baseline or peak_bytes or fills_a_whole_row" > "$OUT/tests.log" 2>&1
echo "tests rc=$?: $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
SKIP_LEASE_CHECK=1 SWEEP_S=${SWEEP_S:-120} REFINE="$KEYS --with-winners --with-default --again --sustain ${SUSTAIN:-0.75} --sustain-load gemm" \
  bash scripts/gpu_profile_specs.sh > "$OUT/refine.log" 2>&1
tail -n 3 "$OUT/refine.log" | tee -a "$OUT/summary.txt"
python3 -m drafter_attn.tuner export --sm 90 --db "$OUT/sm90.db" --current-sources --regime sustained \
  --out "$OUT/sm90-sustained.json" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
python3 -m drafter_attn.tuner diff profiles/sm90-sustained.json "$OUT/sm90-sustained.json" > "$OUT/diff.txt" 2>&1
head -n 1 "$OUT/diff.txt" | tee -a "$OUT/summary.txt"
if [[ ${REGIMES:-1} != 0 ]]; then  # REGIMES=0: steps 1 and 2 only
  OUT="$OUT/regimes" SUSTAIN_LOAD=gemm SHAPES=${SHAPES:-8x32k,8x128k,1x128k} PAGES=${PAGES:-64,128} \
    TABLE_S=${TABLE_S:-200} bash scripts/gpu_regimes.sh > "$OUT/regimes.log" 2>&1
  tail -n 30 "$OUT/regimes.log"
fi
# a device run returns at most 8 files: the database, the summary and one archive of the rest
gzip -f "$OUT/sm90.db"
(cd "$OUT" && tar czf coload.tgz --exclude=sm90.db.gz --exclude=summary.txt --exclude=coload.tgz ./* \
  && find . -mindepth 1 -maxdepth 1 ! -name sm90.db.gz ! -name summary.txt ! -name coload.tgz -exec rm -rf {} +)
