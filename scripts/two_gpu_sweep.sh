#!/usr/bin/env bash
# The local sweep path on a machine with two GPUs (issue 16): one sweep with one worker per GPU,
# then two sweeps at once over one fresh database, one GPU each; prints rows per worker and any
# candidate measured twice (must be none). Writes the databases under $OUT.
#   OUT=/some/dir bash scripts/two_gpu_sweep.sh [SPEC]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
spec=${1:-results/two-h200/tiny.toml}
nvidia-smi --query-gpu=index,name --format=csv,noheader
python3 -m drafter_attn.tuner sweep "$spec" --db "$OUT/one.db" --devices 0,1 --no-progress
python3 -m drafter_attn.tuner sweep "$spec" --db "$OUT/concurrent.db" --devices 0 --no-progress &
python3 -m drafter_attn.tuner sweep "$spec" --db "$OUT/concurrent.db" --devices 1 --no-progress
wait
for f in "$OUT/one.db" "$OUT/concurrent.db"; do
  python3 - "$f" <<'PY'
import sqlite3, sys
c = sqlite3.connect(sys.argv[1])
print(sys.argv[1].rsplit("/", 1)[-1], "rows per (sweep, worker):",
      c.execute("SELECT sweep_id, worker, status, COUNT(*) FROM results GROUP BY sweep_id, worker, status").fetchall())
print("  measured more than once:", c.execute(
    "SELECT candidate_key, COUNT(*) n FROM results GROUP BY env_id, candidate_key HAVING n > 1").fetchall())
PY
done
