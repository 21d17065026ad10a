#!/usr/bin/env bash
# Side specs of the shipped sm90 profile (tuner/specs/sm90-*.toml) measured into a copy of
# profiles/sm90.db in one device call: only the candidates it lacks for today's kernel sources
# (so `tuner rekey` the database after a kernel edit first), each spec's variants compiled ahead.
#   OUT=/some/dir SWEEP_S=300 bash scripts/gpu_profile_specs.sh tuner/specs/sm90-rows.toml ...
# REFINE="--set q_step=1 --where ws" (or "--set one_trip=1 --max-batch 8") also measures the
# shipped table's winners with a knob changed
# (`tuner refine profiles/sm90.json $REFINE`), after the specs, within the same SWEEP_S; add
# --with-winners to REFINE to measure each winner, its runners-up and its refined candidate in
# this sweep. Several refines, one after another, separated by ';':
#   REFINE="--with-winners --min-ctx 128k --max-batch 4 --preset qwen3-8b-dflash-b16; --set stages=9 --where ws --min-ctx 128k --max-batch 4 --preset qwen3-8b-dflash-b16"
# $OUT/sm90.db and $OUT/lease_check.txt come back (the database's journal folded in); then, in a
# checkout:
#   cp OUT/sm90.db profiles/sm90.db
#   tuner export --sm 90 --db profiles/sm90.db --current-sources --out profiles/sm90.json
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
db="$OUT/sm90.db"
cp profiles/sm90.db "$db"
args=()
for spec in "$@"; do args+=(--sweep "$spec"); done
IFS=';' read -ra refines <<< "${REFINE:-}"
python3 scripts/precompile_gpu_matrix.py --no-tests "${args[@]}" --db "$db" 2>&1 | tail -n 1
for one in "${refines[@]}"; do
  read -ra refine <<< "$one"
  python3 scripts/precompile_gpu_matrix.py --no-tests --refine profiles/sm90.json "${refine[@]}" \
    --db "$db" 2>&1 | tail -n 1
done
# The lease first (about 15 s; SKIP_LEASE_CHECK=1 leaves it out): some H200 leases run paged
# calls over a gigabyte 4-12% slower in some timing rounds than in others, which flips keys on
# noise (results/perf-notes.md, "Paged calls at page 128 and 128k"). Rows from a lease that shows
# slow rounds here are compared before they are merged.
if [ -z "${SKIP_LEASE_CHECK:-}" ]; then
  ROUNDS=20 REPS=10 timeout 90 python3 scripts/diag_slow_rounds.py \
    "cupy:ws=3,tile_n=32,stages=6,early_ids=1,one_trip=1,pair=1" 8 32768 128 > "$OUT/lease_check.txt" 2>&1
  case $? in
    0) echo "lease check: steady (no slow round in 20)" ;;
    3) echo "lease check: SLOW ROUNDS on this lease ($OUT/lease_check.txt): read this run's rows before merging them" ;;
    *) echo "lease check: did not finish ($OUT/lease_check.txt)" ;;
  esac
fi
deadline=$(( SECONDS + ${SWEEP_S:-300} ))
for spec in "$@"; do
  left=$(( deadline - SECONDS )); (( left < 10 )) && { echo "$spec: no time left"; continue; }
  timeout -s INT -k 20 "$left" python3 -m drafter_attn.tuner sweep "$spec" --db "$db" --no-progress \
    > "$OUT/$(basename "$spec" .toml).log" 2>&1
  echo "$spec: exit $?, $(tail -n 1 "$OUT/$(basename "$spec" .toml).log")"
done
n=0
for one in "${refines[@]}"; do
  read -ra refine <<< "$one"
  n=$(( n + 1 )); left=$(( deadline - SECONDS ))
  (( left < 10 )) && { echo "refine $one: no time left"; continue; }
  timeout -s INT -k 20 "$left" python3 -m drafter_attn.tuner refine \
    profiles/sm90.json "${refine[@]}" --db "$db" --no-progress > "$OUT/refine$n.log" 2>&1
  echo "refine $one: exit $?, $(tail -n 1 "$OUT/refine$n.log")"
done
python3 - "$db" "$@" <<'PY'
import sqlite3, sys
from drafter_attn.kernels.nvrtc import sources_digest
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import load_spec
with ProfileDB(sys.argv[1], readonly=True) as db:
    done = db.done_candidates(None, sources_hash=sources_digest())
for path in sys.argv[2:]:
    want = {x.key() for x in load_spec(path).candidates()}
    print(f"{path}: {len(want & done)} of {len(want)} candidates measured, {len(want - done)} left")
c = sqlite3.connect(sys.argv[1])
for status, n in c.execute("SELECT status, COUNT(*) FROM results GROUP BY status"):
    print(f"  {n} {status}")
c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
c.execute("PRAGMA journal_mode = DELETE")  # one file to bring back
c.close()
PY
