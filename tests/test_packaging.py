"""The suite installs under its own import namespace (`drafter_attn`), so that it can share an
environment with PyPI's `kernels` (and `tuner`, `bench`) without overwriting them."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPI_KERNELS = "kernels==0.17.2"  # PyPI's "Download compute kernels", often installed beside vLLM


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)


@pytest.fixture(scope="module")
def venv_with_pypi_kernels(tmp_path_factory):
    venv = tmp_path_factory.mktemp("venv") / "v"
    proc = _run([sys.executable, "-m", "venv", str(venv)])
    assert proc.returncode == 0, proc.stderr
    py = venv / "bin" / "python"
    proc = _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", PYPI_KERNELS])
    if proc.returncode != 0:
        if "Could not find a version" in proc.stderr or "connection" in proc.stderr.lower():
            pytest.skip(f"the package index cannot be reached for {PYPI_KERNELS}: {proc.stderr.strip()[-300:]}")
        raise AssertionError(proc.stderr)
    return py


def test_suite_installs_beside_pypi_kernels(venv_with_pypi_kernels):
    py = venv_with_pypi_kernels
    proc = _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", str(REPO)])
    assert proc.returncode == 0, proc.stderr
    # torch is not in this venv: import only what needs no torch, and look at what was installed.
    probe = (
        "import importlib.metadata as md, pathlib, kernels, drafter_attn, drafter_attn.kernels, drafter_attn.tuner, "
        "drafter_attn.bench\n"
        "assert md.distribution('kernels').version == '0.17.2'\n"
        "assert hasattr(kernels, 'get_kernel'), 'PyPI kernels was replaced'\n"
        "here = pathlib.Path(drafter_attn.kernels.__file__).parent\n"
        "assert here.parent.name == 'drafter_attn' and here != pathlib.Path(kernels.__file__).parent\n"
        "assert (here / 'cuda' / 'drafter_attention.cu').is_file(), 'CUDA sources not shipped'\n"
        "assert (here / 'host' / 'graph_runner.c').is_file(), 'the C runner source not shipped'\n"
        "tuner = pathlib.Path(drafter_attn.tuner.__file__).parent\n"
        "assert (tuner / 'specs' / 'default.toml').is_file() and (tuner / 'datasheets.toml').is_file()\n"
        "files = [str(f) for f in md.distribution('drafter-attn-suite').files]\n"
        "top = {f.split('/')[0] for f in files if not f.startswith(('..', 'drafter_attn_suite-'))}\n"
        "print(sorted(top))\n"
    )
    proc = _run([str(py), "-c", probe], cwd=py.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['drafter_attn']"  # nothing at the top level but the namespace
    # Run from a checkout, the checkout must not shadow the installed namespace either.
    proc = _run([str(py), "-c", "import drafter_attn.kernels as k; print(k.__file__)"], cwd=REPO)
    assert proc.returncode == 0 and "site-packages" in proc.stdout, proc.stderr
    for script in ("bench", "tuner"):
        assert (py.parent / script).is_file()
