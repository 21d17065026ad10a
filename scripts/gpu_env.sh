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
