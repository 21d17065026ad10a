#!/usr/bin/env bash
# The split combine inside the attention launch (`cupy:cluster=1`, issues 11 and 13;
# results/perf-notes.md, "The splits as one cluster") on one H200, in one device call of at
# most 9 minutes:
#   OUT=/some/dir bash scripts/gpu_cluster.sh        (repository root; carry .whl)
# 1. precompile the variants the tests and the table load (parallel NVRTC)
# 2. how many clusters of 8 and 16 of the main preset's CTA the GPU places at once
# 3. "cupy:cluster=1" against the torch reference (tests/test_backends_gpu.py: every mask, pages
#    8-256 and the arena, GQA 1-16, head_dim 64/128, ragged lengths, bf16/fp16, forced splits,
#    graph replay; test_cluster_merges_in_one_launch)                     -> gpu_tests.log
# 4. the attention table, one main-preset layer at B=1 2k/8k/32k, B=2 8k, B=4 8k, page 64 and
#    the arena, two interleaved rounds: the default, cluster=1, and lean at one CTA an SM (the
#    16 splits cluster=1 plans, merged by the combine kernel); the read floor and FlashInfer
#    fa2's per-shape and CUDA-graph plans in the same run                   -> attention*
# 5. host time per eager call, default and cluster=1 (scripts/host_profile.py) -> host_profile*.txt
# Files in $OUT: summary.txt, gpu_tests.log, attention_rounds.md, host_profile*.txt, logs.tgz,
# extras.tgz (the profile database of the rows).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
budgeted_run gpu_cluster
IMPLS="cupy;cupy:cluster=1;cupy:lean=1,ctas_per_sm=1"

timeout -s INT -k 10 120 python3 scripts/precompile_gpu_matrix.py cupy:cluster=1 \
  --table "$IMPLS" --page 64 > "$OUT/precompile.log" 2>&1
tail -n 2 "$OUT/precompile.log" | tee -a "$OUT/summary.txt"

timeout 60 python3 - <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import torch
from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem
g = get_preset(MAIN_PRESET)
prob = Problem(g, "paged", 64, 1, 8192)
p = cb.default_params(prob, 90, cluster=True)
mod = cb.CUPY.module_for(0, g.torch_dtype, g.head_dim, 64, g.block_size, g.group, p)
for size in (8, 16):
    print(f"cluster of {size} x {mod.smem} B smem, {mod.threads} threads, {mod.regs} regs: fits",
          cb.cluster_fits(mod.attention, (size, 8, 1), mod.threads, mod.smem, size))
PY

timeout -s INT -k 10 "${TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=20 -rf \
  -k "cluster" tests/test_backends_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "cluster gpu tests rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -n 20 | cut -c1-300 | tee -a "$OUT/summary.txt"
tail -n 1 "$OUT/gpu_tests.log" | tee -a "$OUT/summary.txt"

timeout -s INT -k 10 "$(clamp $(( $(left) - 70 )) 240 30)" \
  python3 -m drafter_attn.bench.attention_table --baseline flashinfer-fa2,flashinfer-fa2-graph \
  --shapes 1x2k,1x8k,1x32k,2x8k,4x8k --page 64 --rounds 2 --impl "$IMPLS" \
  --db "$db" --out "$OUT" > "$OUT/table.log" 2>&1
echo "table rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
for spec in cupy cupy:cluster=1; do
  timeout -s INT -k 5 "$(clamp $(( $(left) / 2 )) 40 10)" python3 scripts/host_profile.py 200 "$spec" \
    > "$OUT/host_profile_${spec//[:=]/_}.txt" 2>&1
done
tar czf "$OUT/logs.tgz" -C "$OUT" precompile.log table.log attention.csv attention.json \
  attention.md attention_rounds.csv
rm -f "$OUT"/table.log "$OUT/precompile.log" "$OUT"/attention.* "$OUT/attention_rounds.csv"
[ -f "$OUT/attention_rounds.md" ] && cut -c1-250 "$OUT/attention_rounds.md" | tail -n 30
head -n 12 "$OUT"/host_profile_*.txt | cut -c1-160
