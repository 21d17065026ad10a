#!/usr/bin/env bash
# Issue #19, part 1 on the H200: the GPU matrix for both CuTe variants, `cutlass` (mma.sync atoms)
# and `cutlass:wgmma=1` (warpgroup MMAs), after the fix of the wgmma path at head_dim 64 (Q
# re-read from shared memory per KV tile instead of held in registers across the KV loop, where
# ptxas 13.0 gave its registers to P). One device call, under 9 minutes:
#   OUT=/some/dir bash scripts/gpu_cute_check.sh
# 1. precompiles the matrix's cutlass and cutlass:wgmma=1 variants in parallel (NVRTC, all cores);
# 2. runs the GPU matrix (tests/test_backends_gpu.py, plus tests/test_ops.py's cutlass cases)
#    restricted to those two backends by -k, into $OUT/junit_cutlass.xml and $OUT/gpu_matrix.log;
# 3. beside it, on the CPU: the SASS check of the wgmma kernels built by this machine's NVRTC
#    (Q's registers must survive the KV loop), into $OUT/sass_check.log.
# Prints a short summary last. Time limits keep the whole call under 9 minutes: 270 s for the
# precompile (123 variants, about 3 minutes on 16 cores), then the matrix gets what is left of
# 500 s (T_MATRIX overrides), after which pytest is interrupted with SIGINT (the junit file and
# its summary are still written).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
start=$SECONDS
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "from drafter_attn.kernels import nvrtc; print('nvrtc', nvrtc.nvrtc_version())"
  python3 -c "import importlib.metadata as m; print('nvidia-cutlass', m.version('nvidia-cutlass'))"
} > "$OUT/env.txt" 2>&1

timeout 270 python3 scripts/precompile_gpu_matrix.py cutlass cutlass:wgmma=1 \
  > "$OUT/precompile.log" 2>&1
pre_rc=$?
pre_s=$((SECONDS - start))
T_MATRIX=${T_MATRIX:-$((500 - pre_s))}

# CPU-side SASS check with this machine's compiler, while the GPU runs the matrix
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_cutlass_compile.py \
  -k "q_fragment or q_operand_check" > "$OUT/sass_check.log" 2>&1 &
sass_pid=$!

timeout -s INT -k 20 "$T_MATRIX" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
  --junitxml="$OUT/junit_cutlass.xml" -k "cutlass" \
  tests/test_backends_gpu.py tests/test_ops.py > "$OUT/gpu_matrix.log" 2>&1
rc=$?
wait "$sass_pid"
sass_rc=$?

echo "=== gpu_cute_check: $((SECONDS - start)) s (precompile ${pre_s} s, rc $pre_rc)"
cat "$OUT/env.txt"
tail -n 1 "$OUT/precompile.log"
python3 - "$OUT/junit_cutlass.xml" <<'EOF'
import collections, re, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    sys.exit(f"no junit results ({exc})")
counts = collections.Counter()
failed = collections.defaultdict(list)
for case in root.iter("testcase"):
    m = re.search(r"[-\[](cutlass(?::wgmma=1)?)(?=[-\]])", case.get("name", ""))
    variant = m.group(1) if m else "other cutlass"
    outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
               else "skipped" if case.find("skipped") is not None else "passed")
    counts[variant, outcome] += 1
    if outcome == "failed":
        failed[variant].append(case.get("name"))
for variant in sorted({v for v, _ in counts}):
    line = "  ".join(f"{o} {counts[variant, o]}" for o in ("passed", "failed", "skipped"))
    print(f"{variant:16s} {line}")
    for name in failed[variant][:5]:
        print(f"   FAILED {name}")
EOF
grep -E "passed|failed|skipped|error|Interrupted" "$OUT/gpu_matrix.log" | tail -n 2
echo "sass check (rc $sass_rc): $(tail -n 1 "$OUT/sass_check.log")"
echo "matrix rc $rc (124: stopped at T_MATRIX=$T_MATRIX s)"
exit $(( rc != 0 || sass_rc != 0 ))
