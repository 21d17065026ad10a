#!/usr/bin/env bash
# Does another NVRTC's code time the same? On the H200 (its NVRTC 13.0), the shipped table's
# picks (--impl auto) at SHAPES, page 64 and the arena, timed as compiled here (A) and loaded from
# CUBINS, a folder scripts/cubins_by_nvrtc.py dump wrote with another NVRTC (B: 13.5, what a pip
# install resolves), in A B A B order, ROUNDS interleaved rounds each.
#   CUBINS=.cubins135 OUT=/some/dir bash scripts/gpu_cubins_ab.sh   (repository root; carry CUBINS)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
CUBINS=${CUBINS:-.cubins135}; SHAPES=${SHAPES:-1x2k,1x8k,8x8k}; ROUNDS=${ROUNDS:-2}
args=(-m drafter_attn.bench.attention_table --preset qwen3-8b-dflash-b16 --shapes "$SHAPES" --page 64
      --impl auto --baseline none --rounds "$ROUNDS")
timeout 150 python3 scripts/precompile_gpu_matrix.py --no-tests --preset qwen3-8b-dflash-b16 --page 64 \
  --table auto --shapes "$SHAPES" 2>&1 | tail -n 1
for run in a1 b1 a2 b2; do
  mkdir -p "$OUT/$run"
  if [[ $run == b* ]]; then pre=(python3 scripts/with_cubins.py "$CUBINS"); else pre=(python3); fi
  timeout -s INT "${TABLE_S:-110}" "${pre[@]}" "${args[@]}" --out "$OUT/$run" > "$OUT/$run/log" 2>&1
  echo "$run rc=$? $(grep -h with_cubins "$OUT/$run/log")"
done
python3 - "$OUT" <<'PY'
import sys, pandas as pd
out = sys.argv[1]
med = {}
for run in ("a1", "b1", "a2", "b2"):
    df = pd.read_csv(f"{out}/{run}/attention.csv").dropna(subset=["attn_us"])
    med[run] = df.groupby(["layout", "batch", "ctx"])["attn_us"].median()
t = pd.DataFrame({"A_13.0_us": (med["a1"] + med["a2"]) / 2, "B_13.5_us": (med["b1"] + med["b2"]) / 2,
                  "A_apart": (med["a1"] / med["a2"] - 1).abs(), "B_apart": (med["b1"] / med["b2"] - 1).abs()})
t["B_over_A"] = t["B_13.5_us"] / t["A_13.0_us"]
print(t.to_string(float_format=lambda x: f"{x:.4f}"))
PY
