#!/usr/bin/env bash
# GQA 9 on the wgmma path (issue 12; SM 90 pads laguna's 9-warp CTAs to 3 warpgroups, `cupy:wgmma=0`
# keeps the 9-warp mma.sync variant; results/perf-notes.md, "GQA 9 on the wgmma path") on one H200, in one
# device call of at most 9 minutes:
#   OUT=/some/dir bash scripts/gpu_gqa9.sh        (repository root)
# 1. precompile the padded variants the tests and the table load (parallel NVRTC)
# 2. the padded path against the torch reference (tests/test_backends_gpu.py, test_padded_*:
#    laguna, GQA 12, GQA 9 at head_dim 64, Qb 12 x G 9; every mask, pages 8-128 and the arena,
#    ragged lengths, forced splits; three parameter sets)                  -> gpu_tests.log
# 3. the attention table, one laguna layer at B=8/32 x ctx 8k/32k, page 64 and the arena: the
#    mma.sync (9 warps), the padded wgmma path (the default, 32 x 8, and 64-key tiles), loads only
#    (skip_compute) for both, beside the read floor                         -> attention.*
# 4. with what time is left, the cupy GPU matrix (default and mma.sync) as a regression check of
#    the shared kernel source                                              -> gpu_tests.log
# Files in $OUT (8): summary.txt, precompile.log, gpu_tests.log, table.log,
# attention.csv/.md/.json, extras.tgz (the profile database of the table's rows). Budget TOTAL
# seconds (default 525): precompile <= 90 s, padded tests <= 150 s, the table <= 250 s, the
# matrix the rest. A stage cut short gets SIGINT (the table keeps every row measured so far).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_gqa9
PADDED=("cupy:wgmma=1" "cupy:wgmma=1,tile_n=64,stages=4" "cupy:wgmma=1,overlap=2")
IMPLS="cupy:wgmma=0;cupy;cupy:wgmma=1,tile_n=64,stages=4;cupy:wgmma=0,skip_compute=1;cupy:skip_compute=1"

timeout -s INT -k 10 90 python3 scripts/precompile_gpu_matrix.py "${PADDED[@]}" cupy cupy:wgmma=0 \
  --table "$IMPLS" --preset laguna-dflash --page 64 > "$OUT/precompile.log" 2>&1
tail -n 2 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"

timeout -s INT -k 10 150 python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf \
  -k "padded" tests/test_backends_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "padded gpu tests rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -n 20 | cut -c1-300 | tee -a "$OUT/summary.txt"
tail -n 1 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"

timeout -s INT -k 10 "$(clamp $(( $(left) - 60 )) 250 30)" \
  python3 -m drafter_attn.bench.attention_table --preset laguna-dflash --baseline none \
  --shapes 32x8k,8x8k,8x32k,32x32k --page 64 --impl "$IMPLS" \
  --db "$db" --out "$OUT" > "$OUT/table.log" 2>&1
echo "table rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
grep -v "^{" "$OUT/table.log" | cut -c1-160 | tail -n 50 | tee -a "$OUT/summary.txt"

if (( $(left) > 40 )); then
  timeout -s INT -k 10 "$(( $(left) - 15 ))" \
    python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf \
    -k "cupy and not padded and not overlap" tests/test_backends_gpu.py >> "$OUT/gpu_tests.log" 2>&1
  echo "cupy matrix rc=$? after ${SECONDS}s (cut short by the budget if rc 130/124)" | tee -a "$OUT/summary.txt"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -n 20 | cut -c1-300 | tee -a "$OUT/summary.txt"
  tail -n 1 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"
fi
