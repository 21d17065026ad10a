#!/usr/bin/env bash
# Host syncs under Nsight Systems on a GPU machine: real captures of the suite's decode step with
# its own store (cupy) and with the deliberately syncing reference (reference-syncing), every
# sync layer side by side, and `bench decode --syncs all` end to end.
#
#   bash scripts/nsys_capture.sh [capture] [bench] [tests]      (default: capture bench)
#
# nsys: $NSYS, else the Nsight Compute install's copy ($NSYS_DIR, default below), which imports
# its captures only with libdw.so.1 / libelf.so.1: when .deb/ holds the Debian packages libdw1 and
# libelf1, they are unpacked under /tmp/dw and put on LD_LIBRARY_PATH first.
#
# Writes into $OUT (default ./out; 7 files, no folders):
#   env.txt       which nsys the suite finds, before and after the libraries are on the path
#                 (the "missing library" note), the importer and ldd of both
#   layers.json   capture: `python -m drafter_attn.tuner.syncs compare`, every layer for both stores
#   cupy.sqlite, reference-syncing.sqlite   capture: the exports (xz-compressed when over 2 MB);
#                 the capture range holds the timed steps alone (cudaProfilerStart/Stop)
#   stats.txt     capture: `nsys stats` (cuda_api_sum, nvtx_sum, cuda_gpu_mem_time_sum) and
#                 `nsys analyze` (cuda_api_sync, cuda_memcpy_sync) of both exports
#   decode.json   bench: `bench decode --impl cupy,reference-syncing --syncs all` (tiny problem)
#   log.txt       everything the stages printed, the GPU tests' output with `tests`
set -uo pipefail
stages=${*:-capture bench}
source "$(dirname "$0")/gpu_env.sh"
LOG=$OUT/log.txt
: > "$LOG"
NSYS_DIR=${NSYS_DIR:-/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64}
export NSYS=${NSYS:-$NSYS_DIR/nsys}
SHAPE=(--batch 2 --ctx 1024 --page 64)  # the main preset (5 layers), one small problem
RUNS=3

find_nsys() {
  python3 -c 'import json; from drafter_attn.tuner.nsys import find_nsys; print(json.dumps(find_nsys().as_dict(), indent=1))'
}

{  # a group, not a subshell: the LD_LIBRARY_PATH set here holds for the stages below
  echo "== find_nsys() with the image's libraries only"
  find_nsys
  if ls .deb/*.deb >/dev/null 2>&1; then
    mkdir -p /tmp/dw && for f in .deb/*.deb; do dpkg -x "$f" /tmp/dw; done
    export LD_LIBRARY_PATH=/tmp/dw/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    echo "== find_nsys() with .deb unpacked on LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    find_nsys
  else
    echo "== no .deb/*.deb here: LD_LIBRARY_PATH left as it is (${LD_LIBRARY_PATH:-unset})"
  fi
  importer=$(python3 -c 'from drafter_attn.tuner.nsys import find_nsys; print(find_nsys().importer or "")')
  for bin in "$NSYS" $importer; do echo "== ldd $bin"; ldd "$bin" | grep -E "not found|libdw|libelf" || echo "(all resolved)"; done
  "$NSYS" --version
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

rc=0
if [[ " $stages " == *" capture "* ]]; then
  keep=/tmp/nsys-keep; rm -rf "$keep"; mkdir -p "$keep"
  echo "== capture: tuner.syncs compare (${SHAPE[*]}, $RUNS steps in the capture)" | tee -a "$LOG"
  python3 -m drafter_attn.tuner.syncs compare --impl cupy,reference-syncing "${SHAPE[@]}" --runs $RUNS \
    --keep "$keep" > "$OUT/layers.json" 2>> "$LOG" || rc=$?
  cat "$OUT/layers.json"
  : > "$OUT/stats.txt"
  for f in "$keep"/*.sqlite; do
    [ -e "$f" ] || { echo "no export was kept" | tee -a "$LOG"; rc=1; break; }
    { echo "#### nsys stats $(basename "$f")"
      "$NSYS" stats --report cuda_api_sum,nvtx_sum,cuda_gpu_mem_time_sum --format csv "$f"
      echo "#### nsys analyze $(basename "$f")"
      "$NSYS" analyze -r cuda_api_sync,cuda_memcpy_sync "$f"; } >> "$OUT/stats.txt" 2>&1
    if [ "$(stat -c %s "$f")" -gt 2000000 ]; then xz -9 -c "$f" > "$OUT/$(basename "$f").xz"; else cp "$f" "$OUT/"; fi
  done
  grep -A3 -E "^#### |Num Calls|Instances" "$OUT/stats.txt" | grep -E "^#### |Synchronize|drafter_step" | head -n 40
fi
if [[ " $stages " == *" bench "* ]]; then
  echo "== bench decode --impl cupy,reference-syncing --syncs all" | tee -a "$LOG"
  rm -rf /tmp/nsys-bench /tmp/nsys-bench.db
  python3 -m drafter_attn.bench.cli decode --impl cupy,reference-syncing --syncs all "${SHAPE[@]}" \
    --baseline none --db /tmp/nsys-bench.db --out /tmp/nsys-bench >> "$LOG" 2>&1 || rc=$?
  cp /tmp/nsys-bench/decode.json "$OUT/" 2>/dev/null || true
  grep -E "syncs per step|nsys layer|reference-syncing:|rows? with blocking|failed" "$LOG" | tail -n 20
fi
if [[ " $stages " == *" tests "* ]]; then
  echo "== GPU tests of the sync layers" | tee -a "$LOG"
  python3 -m pytest -m gpu -q -p no:cacheprovider -rfs tests/test_syncs_gpu.py \
    tests/test_tuner_gpu.py -k "sync or nsys" >> "$LOG" 2>&1 || rc=$?
  tail -n 15 "$LOG"
fi
exit $rc
