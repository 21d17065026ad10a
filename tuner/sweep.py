"""Crash-isolated, resumable sweeps: every candidate runs in a worker process (one per visible
GPU), every finished result is written to the profile database at once, and a sweep that is
killed resumes by skipping what the database already holds for the same environment.

    outcome = run_sweep(spec.candidates(), "profiles/profile.db", timeout_s=600)

A candidate whose worker dies (illegal address, launch failure, abort) is recorded as
`failed_runtime` with the exit code; one that gives no result within `timeout_s` as
`failed_timeout`; either way the worker is restarted and the sweep goes on.
"""

from __future__ import annotations

import collections
import datetime as _dt
import multiprocessing as mp
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import Candidate
from drafter_attn.tuner.worker import FINGERPRINT, MEASURE, worker_main

START_TIMEOUT_S = 300  # a worker imports torch and CUDA before it says ready
MAX_START_FAILURES = 3  # consecutive deaths of one worker slot without any result


class SweepError(RuntimeError):
    """The sweep cannot run at all (no GPU, workers that cannot start)."""


def visible_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES entries to pin one worker each to (every GPU torch sees)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def result_row(c: Candidate, result: dict, env_id: str, sweep_id: str, worker: str) -> dict:
    """A database row: the candidate's identity plus the worker's result columns."""
    key = c.problem.key()
    row = dict(env_id=env_id, candidate_key=c.key(), problem_key=key, preset=c.preset, **key,
               accepted=c.accepted, impl=c.impl, params=c.params_dict, sweep_id=sweep_id,
               worker=worker, provenance="measured")
    row.update(result)
    return row


@dataclass
class SweepOutcome:
    sweep_id: str
    total: int
    skipped: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)

    @property
    def measured(self) -> int:
        return sum(self.by_status.values())

    @property
    def failed(self) -> int:
        return sum(n for s, n in self.by_status.items() if s.startswith("failed"))


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Slot:
    """One worker process pinned to one device, restarted when it dies."""

    def __init__(self, ctx, device: str | None, label: str, measure: str, fingerprint: str, options: dict):
        self.ctx, self.device, self.label = ctx, device, label
        self.args = (measure, fingerprint, options)
        self.proc = self.conn = None
        self.env_id: str | None = None
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

    @property
    def ready(self) -> bool:
        return self.env_id is not None


def run_sweep(candidates: list[Candidate], db_path, *, timeout_s: float = 600, options: dict | None = None,
              devices: list[str | None] | None = None, measure: str = MEASURE,
              fingerprint: str = FINGERPRINT, retry_failed: bool = False, progress: bool = True,
              sweep_id: str | None = None, name: str = "sweep") -> SweepOutcome:
    """Measure `candidates` in worker processes, one per entry of `devices` (CUDA_VISIBLE_DEVICES
    entries; default: one per visible GPU; None entries pin nothing), writing each result to
    `db_path` the moment it arrives. Candidates with a row for the worker's environment are
    skipped (with `retry_failed`, only rows that are ok or unsupported count as done).
    `measure` and `fingerprint` name the worker's functions ("module:attr")."""
    devices = visible_devices() if devices is None else list(devices)
    if not devices:
        raise SweepError("no CUDA GPU is visible: a sweep measures kernels on a GPU "
                         "(check CUDA_VISIBLE_DEVICES and nvidia-smi)")
    sweep_id = sweep_id or f"{name}-{_dt.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    ctx = mp.get_context("spawn")
    slots = [_Slot(ctx, d, d if d is not None else str(i), measure, fingerprint, options or {})
             for i, d in enumerate(devices)]
    sweep = _Sweep(candidates, ProfileDB(db_path), slots, timeout_s, retry_failed,
                   SweepOutcome(sweep_id, len(candidates)), _Progress(progress, name, len(candidates)))
    try:
        sweep.run()
    finally:
        sweep.close()
    return sweep.outcome


class _Sweep:
    """The parent's loop: dispatch, collect, record, restart."""

    def __init__(self, candidates, db, slots, timeout_s, retry_failed, outcome, bar):
        self.candidates, self.db, self.slots, self.timeout_s = candidates, db, slots, timeout_s
        self.done_statuses = ("ok", "unsupported") if retry_failed else None
        self.outcome, self.bar = outcome, bar
        self.done: dict[str, set] = {}  # env_id -> candidate keys with a row
        self.pending = collections.deque(range(len(candidates)))

    def run(self) -> None:
        for s in self.slots:
            s.start()
        while self.pending or any(s.task for s in self.slots):
            self._dispatch()
            self._collect()

    def close(self) -> None:
        interrupted = bool(self.pending) or any(s.task for s in self.slots)
        self.bar.close()
        for s in self.slots:
            s.stop(kill=interrupted)
        self.db.close()

    def _dispatch(self) -> None:
        for s in self.slots:
            while s.ready and s.task is None and self.pending:
                i = self.pending.popleft()
                if self.candidates[i].key() in self.done[s.env_id]:  # another env finished it
                    self._skip()
                    continue
                try:
                    s.conn.send((i, self.candidates[i].to_wire()))
                except OSError:  # it died since the last look; _collect restarts it
                    self.pending.appendleft(i)
                    break
                s.task = (i, time.monotonic() + self.timeout_s)

    def _skip(self, n: int = 1) -> None:
        self.outcome.skipped += n
        self.bar.skip(n)

    def _collect(self) -> None:
        """Wait for a message, a worker's death or a deadline, and handle what happened."""
        live = [s for s in self.slots if s.proc is not None]
        deadlines = [s.task[1] for s in live if s.task]
        deadlines += [s.started_at + START_TIMEOUT_S for s in live if not s.ready]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        ready = wait([s.conn for s in live] + [s.proc.sentinel for s in live], timeout)
        for s in live:
            proc, conn = s.proc, s.conn
            if conn not in ready and proc.sentinel not in ready:
                continue
            # Every message it sent, including any sent just before it exited; stop when the
            # handling restarted it (s.proc is then a new process).
            while s.proc is proc:
                try:
                    if not conn.poll():
                        break
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                self._handle(s, msg)
            if s.proc is proc and not proc.is_alive():
                self._died(s)
        now = time.monotonic()
        for s in self.slots:
            if s.task and now > s.task[1]:
                s.stop(kill=True)
                self._record(s, s.task[0], dict(
                    status="failed_timeout", reason=f"no result within {self.timeout_s:g} s; worker killed"))
                s.start()
            elif s.proc is not None and not s.ready and now > s.started_at + START_TIMEOUT_S:
                raise SweepError(f"worker for device {s.label} did not start within {START_TIMEOUT_S} s")

    def _handle(self, s: _Slot, msg) -> None:
        kind = msg[0]
        if kind == "error":
            raise SweepError(msg[1])
        if kind == "ready":
            s.env_id = self.db.add_environment(msg[1])
            s.start_failures = 0
            if s.env_id not in self.done:
                self.done[s.env_id] = self.db.done_candidates(s.env_id, self.done_statuses)
                if len(self.done) == 1:  # the usual case, one environment: skip its work up front
                    keep = [i for i in self.pending if self.candidates[i].key() not in self.done[s.env_id]]
                    self._skip(len(self.pending) - len(keep))
                    self.pending = collections.deque(keep)
        elif kind == "result":
            self._record(s, msg[1], msg[2])
            if msg[2].get("status") == "failed_runtime":  # the worker exits after these (see worker)
                s.stop()
                s.start()

    def _died(self, s: _Slot) -> None:
        s.proc.join()
        code = s.proc.exitcode
        if s.task:
            self._record(s, s.task[0], dict(
                status="failed_runtime", reason=f"worker died ({_signal_name(code)}) while measuring this candidate"))
        elif not s.ready:
            s.start_failures += 1
            if s.start_failures >= MAX_START_FAILURES:
                raise SweepError(f"worker for device {s.label} died {s.start_failures} times while "
                                 f"starting ({_signal_name(code)})")
        s.stop(kill=True)
        s.start()

    def _record(self, s: _Slot, i: int, result: dict) -> None:
        c = self.candidates[i]
        sweep_id = self.outcome.sweep_id
        self.db.add_result(result_row(c, result, s.env_id, sweep_id, s.label))  # its own transaction, now
        self.done[s.env_id].add(c.key())
        status = result.get("status", "?")
        self.outcome.by_status[status] += 1
        s.task = None
        self.bar.result(c, status, result.get("reason"))


class _Progress:
    """A rich progress bar with ETA (stderr); failures are printed above it as they happen."""

    def __init__(self, enabled: bool, name: str, total: int):
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.counts = collections.Counter()
        self.name = name
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=Console(stderr=True))
        self.task = self.progress.add_task(self._describe(), total=total)
        self.progress.start()

    def _describe(self) -> str:
        c = self.counts
        failed = sum(n for s, n in c.items() if s.startswith("failed"))
        return (f"{self.name}: [green]{c['ok']} ok[/] [red]{failed} failed[/] "
                f"{c['unsupported']} unsupported {c['skipped']} done before")

    def skip(self, n: int = 1) -> None:
        """Candidates done before: out of the total, so the ETA counts only work left."""
        if self.enabled and n:
            self.counts["skipped"] += n
            total = self.progress.tasks[0].total - n
            self.progress.update(self.task, total=total, description=self._describe())

    def result(self, c: Candidate, status: str, reason: str | None) -> None:
        if not self.enabled:
            return
        self.counts[status] += 1
        if status.startswith("failed"):
            self.progress.console.print(f"[red]{status}[/] {c.label()}: {(reason or '').splitlines()[0][:200]}")
        self.progress.update(self.task, advance=1, description=self._describe())

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
