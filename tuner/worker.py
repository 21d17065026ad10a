"""The sweep worker: a long-lived process pinned to one GPU that measures candidates it is sent.

Protocol over a multiprocessing pipe (the sweep in tuner.sweep owns the other end):
  worker -> ("ready", fingerprint) once started, or ("error", message) if it cannot start
  sweep  -> (index, candidate wire dict), or None to stop
  worker -> ("result", index, result dict)

A candidate that fails at run time may leave the CUDA context unusable (an illegal address is
sticky), so after a `failed_runtime` result the worker exits and the sweep starts a fresh one. A
candidate that kills the process or hangs is recorded by the sweep, which restarts the worker.

`Slot` is the parent's end: one worker process pinned to one device, restarted when it dies. The
local sweep drives several slots from one loop; a Ray actor (tuner.ray_sweep) drives one with
`measure_one`.

This module imports nothing heavy (a Ray actor imports it, and never torch): the measure and
fingerprint functions are named by import path ("module:attr") and resolved in the child, after
CUDA_VISIBLE_DEVICES is set.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from multiprocessing.connection import wait

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


class WorkerError(RuntimeError):
    """A worker that cannot start (no GPU, an import error, repeated deaths while starting)."""


def signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def died_result(code: int | None) -> dict:
    return dict(status="failed_runtime", reason=f"worker died ({signal_name(code)}) while measuring this candidate")


def timeout_result(timeout_s: float) -> dict:
    return dict(status="failed_timeout", reason=f"no result within {timeout_s:g} s; worker killed")


class Slot:
    """One worker process pinned to one device (a CUDA_VISIBLE_DEVICES entry; None: inherit)."""

    def __init__(self, ctx, device: str | None, label: str, measure: str = MEASURE,
                 fingerprint: str = FINGERPRINT, options: dict | None = None):
        self.ctx, self.device, self.label = ctx, device, label
        self.args = (measure, fingerprint, options or {})
        self.proc = self.conn = None
        self.env_id: str | None = None  # set by the sweep once the worker said ready
        self.task: tuple[int, float] | None = None  # (candidate index, deadline)
        self.start_failures = 0
        self.started_at = 0.0

    def start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=worker_main, args=(child, self.device, *self.args),
                                     name=f"tuner-worker-{self.label}", daemon=True)
        self.proc.start()
        child.close()
        self.conn, self.env_id, self.task = parent, None, None
        self.started_at = time.monotonic()

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if not kill and self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()
        self.proc = None

    def restart(self) -> None:
        self.stop(kill=True)
        self.start()

    @property
    def ready(self) -> bool:
        return self.env_id is not None

    # -- one candidate at a time (a Ray actor's use) ------------------------------------------
    def wait_ready(self, timeout_s: float, max_failures: int = 3) -> dict:
        """Start the worker (again, after up to `max_failures` deaths) and return its fingerprint."""
        for _ in range(max_failures):
            self.start()
            if not wait([self.conn, self.proc.sentinel], timeout_s):
                self.stop(kill=True)
                raise WorkerError(f"worker for device {self.label} did not start within {timeout_s:g} s")
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.stop(kill=True)
                continue
            if msg[0] == "error":
                self.stop(kill=True)
                raise WorkerError(msg[1])
            return msg[1]
        raise WorkerError(f"worker for device {self.label} died {max_failures} times while starting")

    def measure_one(self, index: int, wire: dict, timeout_s: float, start_timeout_s: float) -> dict:
        """Measure one candidate; a death or a hang becomes a failed result, and the worker is
        restarted before the next candidate (see the protocol above)."""
        if self.proc is None:
            self.wait_ready(start_timeout_s)
        try:
            self.conn.send((index, wire))
        except OSError:  # died while idle: start afresh and send again
            self.stop(kill=True)
            return self.measure_one(index, wire, timeout_s, start_timeout_s)
        if not wait([self.conn, self.proc.sentinel], timeout_s):
            self.stop(kill=True)
            return timeout_result(timeout_s)
        try:
            result = self.conn.recv()[2] if self.conn.poll() else None
        except (EOFError, OSError):
            result = None
        if result is None or result.get("status") == "failed_runtime":
            self.proc.join(10)
            code = self.proc.exitcode
            self.stop(kill=True)
            return result or died_result(code)
        return result
