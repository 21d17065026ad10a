"""The C part of the per-call path (kernels/host/graph_runner.c), built on first use.

A planned eager call ends with a few pointer reads, a compare, maybe a node update and one
`cuGraphLaunch` (kernels.launch). In Python with ctypes that tail costs 4-7 us of host time on
the H200's host; `graph_runner.c` does it in one call. It needs only Python's headers and a C
compiler (`$CC`, else `cc`), and is built once per interpreter and source into the kernel
cache (`$DRAFTER_CACHE_DIR`, kernels.nvrtc.cache_dir). Where it cannot be built or loaded
(no compiler, no headers, `DRAFTER_NATIVE=0`), `graph_runner()` returns None, `unavailable()`
says why, and the Python path runs: nothing else changes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).parent / "host" / "graph_runner.c"
_why: list[str] = []


def unavailable() -> str | None:
    """Why the C runner is not in use, or None when it is (after `graph_runner()` ran)."""
    return _why[0] if _why else None


@functools.cache
def graph_runner():
    """The `_graph_runner` extension module, built if needed; None where it cannot be."""
    if os.environ.get("DRAFTER_NATIVE") == "0":
        _why.append("DRAFTER_NATIVE=0")
        return None
    try:
        return _load(_build())
    except Exception as err:  # noqa: BLE001 - any failure: the Python path runs
        _why.append(f"{type(err).__name__}: {err}")
        return None


def _build() -> Path:
    """The compiled module's path in the cache, compiling it when absent (written under a
    temporary name, then renamed: concurrent builders never load a partial file)."""
    from drafter_attn.kernels.nvrtc import cache_dir

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise FileNotFoundError(f"no Python.h in {include}")
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256(SOURCE.read_bytes() + f"{sys.version}|{suffix}|{cc}".encode()).hexdigest()
    out = cache_dir().parent / "native" / tag[:16] / f"_graph_runner{suffix}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        cmd = [cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    return out


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("_graph_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
