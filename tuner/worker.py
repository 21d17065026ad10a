"""The sweep worker: a long-lived process pinned to one GPU that measures candidates it is sent.

Protocol over a multiprocessing pipe (the sweep in tuner.sweep owns the other end):
  worker -> ("ready", fingerprint) once started, or ("error", message) if it cannot start
  sweep  -> (index, candidate wire dict), or None to stop
  worker -> ("result", index, result dict)

A candidate that fails at run time may leave the CUDA context unusable (an illegal address is
sticky), so after a `failed_runtime` result the worker exits and the sweep starts a fresh one. A
candidate that kills the process or hangs is recorded by the sweep, which restarts the worker.

This module imports nothing heavy: the measure and fingerprint functions are named by import
path ("module:attr") and resolved in the child, after CUDA_VISIBLE_DEVICES is set.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

MEASURE = "drafter_attn.tuner.measure:measure_candidate"
FINGERPRINT = "drafter_attn.tuner.env:fingerprint"


def resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the sweep process dies (even by SIGKILL), so
    a killed sweep leaves no orphan holding the GPU or writing late."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def worker_main(conn, device: str | None, measure: str = MEASURE, fingerprint: str = FINGERPRINT,
                options: dict | None = None) -> None:
    """Entry point of a worker process; `device` is a CUDA_VISIBLE_DEVICES entry (None: keep)."""
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    _die_with_parent()
    # Ctrl-C reaches the whole process group: the sweep decides (it kills workers it abandons).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fp = resolve(fingerprint)()
        measure_fn = resolve(measure)
    except Exception as exc:
        conn.send(("error", f"worker on device {device} could not start: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", fp))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, wire = msg
        try:
            result = measure_fn(wire, **(options or {}))
        except Exception as exc:  # measure functions should not raise; be safe anyway
            result = dict(status="failed_runtime", reason=f"{type(exc).__name__}: {exc}")
        conn.send(("result", index, result))
        if result.get("status") == "failed_runtime":
            return
