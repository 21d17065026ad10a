#!/usr/bin/env bash
# Does code from another NVRTC minor version time the same? (The runtime uses a tuned entry
# measured with NVRTC 13.0 under 13.5, the version a pip install resolves, with a warning.)
# One device call (an H200): the device's own NVRTC (13.0) against the nvidia-cuda-nvrtc wheel
# carried in .whl135/ (13.5), the shipped table's picks (--impl auto) at SHAPES on page PAGES
# and the arena, in A B A B order, ROUNDS interleaved rounds each, the read floor in every table.
#   OUT=/some/dir bash scripts/gpu_nvrtc_ab.sh        (repository root; carry .whl135; .whl optional)
# -> $OUT/{a1,b1,a2,b2}/attention.csv and summary.txt (which NVRTC each run loaded).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
SHAPES=${SHAPES:-1x2k,1x8k,1x32k,8x8k}; PAGES=${PAGES:-64}; ROUNDS=${ROUNDS:-2}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site135 .whl135/*.whl
lib=/tmp/site135/nvidia/cu13/lib
version='from drafter_attn.kernels import nvrtc; print("%d.%d" % nvrtc.nvrtc_version())'
base=$(python3 -c "$version")
# how the wheel's library is found: cuda-pathfinder may search site-packages only, so the
# loader's path and a preload are tried too; the first that reports another version is used
for how in "PYTHONPATH=/tmp/site135:$PYTHONPATH" "LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}" \
           "LD_PRELOAD=$lib/libnvrtc.so.13"; do
  other=$(env "$how" python3 -c "$version" 2>/dev/null)
  [[ -n $other && $other != "$base" ]] && break
done
echo "A: NVRTC $base (device); B: NVRTC $other via ${how%%=*}" | tee -a "$OUT/summary.txt"
[[ $other == "$base" || -z $other ]] && { echo "the wheel's NVRTC did not load" | tee -a "$OUT/summary.txt"; exit 2; }
table() {  # NAME [env assignment]
  mkdir -p "$OUT/$1"
  env ${2:+"$2"} timeout -s INT 170 python3 -m drafter_attn.bench.attention_table --preset qwen3-8b-dflash-b16 \
    --shapes "$SHAPES" --page "$PAGES" --impl auto --baseline none --rounds "$ROUNDS" \
    --out "$OUT/$1" > "$OUT/$1/table.log" 2>&1
  echo "$1 rc=$?" | tee -a "$OUT/summary.txt"
}
table a1; table b1 "$how"; table a2; table b2 "$how"
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import sys, pandas as pd
out = sys.argv[1]
runs = {n: pd.read_csv(f"{out}/{n}/attention.csv") for n in ("a1", "b1", "a2", "b2")}
key = ["layout", "page", "batch", "ctx"]
med = {n: df.dropna(subset=["attn_us"]).groupby(key)["attn_us"].median() for n, df in runs.items()}
t = pd.DataFrame({"A_us": (med["a1"] + med["a2"]) / 2, "B_us": (med["b1"] + med["b2"]) / 2,
                  "A_runs_apart": (med["a1"] / med["a2"] - 1).abs(), "B_runs_apart": (med["b1"] / med["b2"] - 1).abs()})
t["B_over_A"] = t.B_us / t.A_us
print(t.to_string(float_format=lambda x: f"{x:.4f}"))
PY
