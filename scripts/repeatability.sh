#!/usr/bin/env bash
# Repeatability of the tuner (issue 14): the same sweep spec run twice on this GPU into two fresh
# profile databases, then `tuner repeat` (winner flips, within noise or not; the spread B/A - 1
# of every candidate; the targets: the same winner for >= 95% of keys, median spread <= 2%).
#
#   OUT=/some/dir bash scripts/repeatability.sh [SPEC]      (default: tuner/specs/sm90-repeat.toml)
#
# $OUT afterwards (6 files):
#   a.db, b.db    the two runs. a.db is also the start of the shipped sm90 profile (the spec is a
#                 subset of tuner/specs/sm90.toml): `bash scripts/sm90_profile.sh a.db` goes on.
#   repeat.txt    tuner repeat's report (also printed), repeat.json the same per key,
#   repeat.png    the figure: histogram of B/A - 1 per candidate, and the flips
#   sweeps.log    both sweeps' output, seconds per run, rows and measuring seconds per status
#
# The default spec: 36 keys, 369 candidates (297 before the two lean sets, 279 before the row_split set, 243 before the combine sets, 207 before the TMA sets); about 3.5 minutes a run on one H200 (the kernels are
# precompiled in parallel first), 7-8 minutes in all. Each sweep is capped at $SWEEP_S seconds
# (default 255) by SIGINT, which keeps every finished row, so the script ends within 10 minutes;
# a capped second run is compared over the keys both runs reached (the report says how many).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
spec=${1:-tuner/specs/sm90-repeat.toml}
cap=${SWEEP_S:-255}
tuner() { python3 -m drafter_attn.tuner "$@"; }
log="$OUT/sweeps.log"
rm -f "$OUT"/a.db* "$OUT"/b.db* "$log"

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$log"
start=$SECONDS
python3 scripts/precompile_gpu_matrix.py --no-tests --sweep "$spec" 2>&1 | tee -a "$log"
echo "precompile: $((SECONDS - start)) s" | tee -a "$log"
for run in a b; do
  start=$SECONDS
  timeout -s INT -k 30 "$cap" python3 -m drafter_attn.tuner sweep "$spec" --db "$OUT/$run.db" \
    --no-progress >>"$log" 2>&1
  rc=$?
  tail -n 2 "$log"  # the sweep's summary
  echo "sweep $run: exit $rc, $((SECONDS - start)) s" | tee -a "$log"
done

# Rows and measuring time per status (what a candidate costs: plan the full sm90 spec by it);
# then each database out of WAL mode, so it is one file.
python3 - "$OUT/a.db" "$OUT/b.db" <<'PY' 2>&1 | tee -a "$log"
import sqlite3, sys
for path in sys.argv[1:]:
    c = sqlite3.connect(path)
    for status, n, s in c.execute("SELECT status, COUNT(*), SUM(elapsed_s) FROM results GROUP BY status"):
        print(f"{path.rsplit('/', 1)[-1]}: {n} {status}, {s or 0:.0f} s measuring ({(s or 0) / n:.2f} s each)")
    c.execute("PRAGMA journal_mode = DELETE")
    c.close()
PY

tuner repeat "$OUT/a.db" "$OUT/b.db" --figure "$OUT/repeat.png" | tee "$OUT/repeat.txt"
tuner repeat "$OUT/a.db" "$OUT/b.db" --format json > "$OUT/repeat.json"
ls -la "$OUT"
