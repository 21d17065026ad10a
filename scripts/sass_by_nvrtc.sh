#!/usr/bin/env bash
# The machine code of every shipped pick under this machine's NVRTC, to compare two NVRTC
# versions without timing them: each winner of profiles/sm90.json and sm90-sustained.json gets
# the digest of its kernels' SASS and resources (tuner/kernel_digests.py, as `tuner rekey`
# compares commits). Equal digests mean the same instructions, so the same timing.
#   OUT=/some/dir bash scripts/sass_by_nvrtc.sh   -> $OUT/sass-<NVRTC version>.json
# (repository root; no GPU needed; on the H200 source scripts/gpu_env.sh first for its layout)
set -euo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
PY=${PY:-python3}
rows=$(mktemp)
$PY - > "$rows" <<'PY'
import json
rows = []
for name in ("profiles/sm90.json", "profiles/sm90-sustained.json"):
    for i, e in enumerate(json.load(open(name))["entries"]):
        rows.append(dict(e, id=f"{name.split('/')[-1]}#{i}", num_layers=1))
print(json.dumps(rows))
PY
version=$($PY -c 'from drafter_attn.kernels import nvrtc; print("%d.%d" % nvrtc.nvrtc_version())')
$PY tuner/kernel_digests.py --jobs "${JOBS:-$(nproc)}" < "$rows" > "$OUT/sass-$version.json"
echo "NVRTC $version: $($PY -c "import json,sys; d=json.load(open(sys.argv[1])); print(len(d), 'picks,', sum(v.startswith('error') for v in d.values()), 'errors,', len(set(d.values())), 'distinct')" "$OUT/sass-$version.json")"
