# Set-up, benchmark and test entry points; `make test` is what CI (.ci/run) runs on a fresh clone.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install test bench

# --system-site-packages: a GPU machine's own CUDA torch is reused instead of replaced.
# torch is pinned so pip takes the local CPU wheel on these machines; an unpinned torch
# would download GBs. It is installed only when no torch is importable at all.
install:
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[cu13,cutlass,test,ray]"

# pytest exits 5 when it collected nothing: a failure, said plainly.
test: install
	$(PY) -m pytest -q || { rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests (exit 5)" >&2; exit $$rc; }

# The main job: the drafter decode step, paged (pages 64, 128) against arena, on this machine's
# GPU, with `bench decode`'s defaults; more options with ARGS="--sm 90 --page 128 ...". Without a
# CUDA GPU, bench says so and exits 2.
bench: install
	$(VENV)/bin/bench decode $(ARGS)
