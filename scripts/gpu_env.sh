# Sourced by the scripts/gpu_*.sh entry points: $OUT, the carried wheels (.whl/: nvidia-cutlass,
# flashinfer) installed into /tmp/site, and the cache folders of the kernels and of FlashInfer.
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
# The suite imports as `drafter_attn.{kernels,tuner,bench}` (pyproject's package-dir mapping);
# without a pip install, a folder of links gives the checkout that namespace.
mkdir -p /tmp/da/drafter_attn
for pkg in kernels tuner bench profiles; do ln -sfn "$PWD/$pkg" "/tmp/da/drafter_attn/$pkg"; done
export PYTHONPATH=/tmp/da
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export DRAFTER_CACHE_DIR=${DRAFTER_CACHE_DIR:-/tmp/drafter-cache} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer} MAX_JOBS=${MAX_JOBS:-16}

# A budgeted run (scripts/gpu_overlap.sh, gpu_gqa9.sh): `budgeted_run NAME` starts the clock of
# TOTAL seconds (default 525) and a fresh profile database /tmp/NAME.db (tarred into
# $OUT/extras.tgz on exit), and writes the GPU and the commit to $OUT/summary.txt. Then `left`
# says the seconds remaining and `clamp VALUE MAX MIN` bounds a step's timeout.
left() { echo $(( TOTAL - SECONDS )); }
clamp() { local t=$1; (( t > $2 )) && t=$2; (( t < $3 )) && t=$3; echo "$t"; }
budgeted_run() {
  TOTAL=${TOTAL:-525}
  db=/tmp/$1.db
  rm -f "$db" "$db-wal" "$db-shm"
  trap "tar czf \"$OUT/extras.tgz\" -C /tmp $1.db 2>/dev/null" EXIT
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
    git log -1 --format='commit %h %s' 2>/dev/null
  } > "$OUT/summary.txt"
}
# `budgeted_table NAME SECONDS ARGS...` (inside a budgeted run): one bench.attention_table run into
# $OUT/NAME recorded in the run's database, at most SECONDS and never past the budget less
# $RESERVE seconds (default 60: what the script still does after its tables)
budgeted_table() {
  local name=$1 t=$2; shift 2
  mkdir -p "$OUT/$name"
  timeout -s INT -k 10 "$(clamp "$t" $(( $(left) - ${RESERVE:-60} )) 20)" \
    python3 -m drafter_attn.bench.attention_table --db "$db" --out "$OUT/$name" "$@" \
    > "$OUT/$name/table.log" 2>&1
  echo "$name rc=$? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
}
# `finish_tables NAME...` (the end of a budgeted run): each table's CSV as $OUT/NAME.csv, and the
# rest (precompile.log, tests.log, the NAME folders with their markdown, the run's database) in
# $OUT/logs.tgz, since at most 8 files come back from a device call; then the summary and
# scripts/table_summary.py's digest of the CSVs, last in the output. A NAME without a table (a
# `bench decode` folder) is only packed.
finish_tables() {
  local name csvs=()
  for name in "$@"; do
    [ -f "$OUT/$name/attention.csv" ] && cp "$OUT/$name/attention.csv" "$OUT/$name.csv" \
      && csvs+=("$OUT/$name.csv")
  done
  trap - EXIT
  tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls -d precompile.log tests.log "$@" 2>/dev/null) \
    -C /tmp "$(basename "$db")" 2>/dev/null
  (cd "$OUT" && rm -rf "$@" precompile.log tests.log extras.tgz)
  cat "$OUT/summary.txt"
  (( ${#csvs[@]} )) && python3 scripts/table_summary.py "${csvs[@]}"
}
