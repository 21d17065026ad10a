#!/usr/bin/env bash
# The CUTLASS backend's evidence on the GPU at hand (the H200 of this workplace), in stages that
# each fit one device call (10 minutes); the cubin cache under /tmp stays warm between calls:
#   OUT=/some/dir bash scripts/gpu_cutlass.sh tests   # compile in parallel, then the shared GPU
#                                                     # test matrix for cutlass and cutlass:wgmma=1
#   OUT=/some/dir bash scripts/gpu_cutlass.sh table   # the main table (B 1/8/32 x ctx 2k/8k/32k x
#                                                     # pages 16/64/128 + arena) for cupy, cutlass
#                                                     # and cutlass:wgmma=1, FlashInfer fa2 beside
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
IMPLS=${IMPLS:-"cupy;cutlass;cutlass:wgmma=1"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
case ${1:-tests} in
  tests)
    python3 scripts/precompile_gpu_matrix.py cutlass cutlass:wgmma=1 --table "$IMPLS" 2>&1 | tail -n 3
    python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf -k "cutlass" \
      tests/test_backends_gpu.py > "$OUT/gpu_tests.log" 2>&1 || rc=$?
    tail -n 30 "$OUT/gpu_tests.log" ;;
  table)
    python3 scripts/precompile_gpu_matrix.py --no-tests --table "$IMPLS" 2>&1 | tail -n 3
    timeout ${T_TABLE:-540} python3 -m drafter_attn.bench.attention_table --reps ${REPS:-50} --impl "$IMPLS" \
      --out "$OUT/table" > "$OUT/table.log" 2>&1 || rc=$?
    grep -v "^{" "$OUT/table.log" | tail -n 150 ;;
  *) echo "usage: gpu_cutlass.sh tests|table" >&2; exit 2 ;;
esac
exit $rc
