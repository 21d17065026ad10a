#!/usr/bin/env bash
# One device call of at most 9.5 minutes (2026-12-01): a slice of the sm90 profile sweep on the
# database the session carries (profiles/sm90.db, re-keyed by `tuner rekey`: only candidates it
# lacks are measured), then, with time left, Nsight Compute on the limiters issues 12 and 19 ask
# about (the CuTe wgmma kernel beside the cupy kernel it ports; laguna's padded path).
#   OUT=dir SWEEP_S=420 NCU=1 bash scripts/gpu_profile_slice.sh
# NCU_CASES (lines of "B ctx page impl preset") replaces the default cases below. TESTS=1 first
# runs every GPU test but the CuTe ones (after a cupy kernel edit: its default and every
# variant, the ops, Runtime, host syncs, benches; gpu_tests_tail.txt), under TESTS_S seconds.
# Files in $OUT: sm90.db, sm90.json (from sm90_profile.sh), profile.log, ncu.txt (the lines that
# name limiters) and ncu_full.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 150 python3 scripts/precompile_gpu_matrix.py cupy cupy:wgmma=0 cupy:overlap=1 cupy:overlap=2 \
    cupy:tma=1 cupy:combine=1 > /dev/null 2>&1
  timeout "${TESTS_S:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf \
    -k "not cutlass" tests/ > "$OUT/gpu_tests.log" 2>&1
  grep -E "^[0-9]+ (passed|failed)|^FAILED|^ERROR| passed| failed" "$OUT/gpu_tests.log" | tail -n 25 \
    | tee "$OUT/gpu_tests_tail.txt"
  rm -f "$OUT/gpu_tests.log"
fi
bash scripts/sm90_profile.sh profiles/sm90.db > "$OUT/profile.log" 2>&1
tail -n 8 "$OUT/profile.log"
[ "${NCU:-0}" = 1 ] || exit 0
NCU_CASES=${NCU_CASES:-"32 8192 128 cupy:overlap=0 qwen3-8b-dflash-b16
32 8192 128 cutlass:wgmma=1 qwen3-8b-dflash-b16
32 8192 128 cupy qwen3-8b-dflash-b16
32 8192 64 cupy laguna-dflash
32 8192 64 cupy:wgmma=0 laguna-dflash"} bash scripts/gpu_ncu.sh
cat "$OUT/ncu.txt"
