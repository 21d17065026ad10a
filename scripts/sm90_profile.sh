#!/usr/bin/env bash
# The shipped sm90 profile (issue 14): tuner/specs/sm90.toml measured into one database over as
# many runs as it takes (a sweep skips what its database holds for the same environment).
#
#   OUT=/some/dir bash scripts/sm90_profile.sh [DB]
#
# DB (optional) is copied to $OUT/sm90.db first: scripts/repeatability.sh's a.db (its spec is a
# subset of this one), or this script's previous $OUT/sm90.db. Without it the run starts from
# an empty database (never from an older profile: rows of other parameter sets would compete).
# The sweep runs for at most $SWEEP_S seconds (default 520; SIGINT keeps every finished row);
# then $OUT/sm90.json is exported (a preview: export again in a git checkout for the commits) and
# the candidates still to measure are counted. 3640 candidates (3192 cupy, 448 cutlass), about
# 40 minutes on one H200:
# bring $OUT/sm90.db back, run again with it until none are left, then commit it as
# profiles/sm90.db with `tuner export --sm 90 --db profiles/sm90.db --out profiles/sm90.json`.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
spec=tuner/specs/sm90.toml
db="$OUT/sm90.db"
if [ -n "${1:-}" ]; then
  [ "$(realpath "$1")" = "$(realpath -m "$db")" ] || cp "$1" "$db"
fi
python3 scripts/precompile_gpu_matrix.py --no-tests --sweep "$spec" --db "$db"
start=$SECONDS
timeout -s INT -k 30 "${SWEEP_S:-520}" python3 -m drafter_attn.tuner sweep "$spec" --db "$db" --no-progress
echo "sweep: exit $?, $((SECONDS - start)) s"
python3 - "$db" "$spec" <<'PY'
import sqlite3, sys
from drafter_attn.kernels.nvrtc import sources_digest
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import load_spec
with ProfileDB(sys.argv[1], readonly=True) as db:  # rows of older kernel sources are stale
    done = db.done_candidates(None, sources_hash=sources_digest())
c = sqlite3.connect(sys.argv[1])
want = {x.key() for x in load_spec(sys.argv[2]).candidates()}
print(f"{len(want & done)} of {len(want)} candidates measured, {len(want - done)} left")
for status, n in c.execute("SELECT status, COUNT(*) FROM results GROUP BY status"):
    print(f"  {n} {status}")
c.execute("PRAGMA journal_mode = DELETE")  # one file to bring back
c.close()
PY
python3 -m drafter_attn.tuner export --sm 90 --db "$db" --out "$OUT/sm90.json" --no-commits
