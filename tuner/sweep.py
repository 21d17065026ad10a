"""Crash-isolated, resumable sweeps: every candidate runs in a worker process (one per visible
GPU), every finished result is written to the profile database at once, and a sweep that is
killed resumes by skipping what the database already holds for the same environment.

    outcome = run_sweep(spec.candidates(), "profiles/profile.db", timeout_s=600)

A candidate whose worker dies (illegal address, launch failure, abort) is recorded as
`failed_runtime` with the exit code; one that gives no result within `timeout_s` as
`failed_timeout`; either way the worker is restarted and the sweep goes on.

Each candidate is claimed in the database before it is measured (tuner.db's claims), so sweeps
of the same spec running at once share the work instead of repeating it. A candidate that names
an SM target (`sm90`) or a GPU class (`H200`) runs only on a matching GPU; one that no GPU here
matches is reported as not run. `SweepQueue` holds this bookkeeping for both the local loop below
and the Ray driver (tuner.ray_sweep).
"""

from __future__ import annotations

import collections
import datetime as _dt
import multiprocessing as mp
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from drafter_attn.tuner import db as dbm
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import Candidate, target_sm
from drafter_attn.tuner.worker import FINGERPRINT, MEASURE, Slot, died_result, timeout_result

START_TIMEOUT_S = 300  # a worker imports torch and CUDA before it says ready
MAX_START_FAILURES = 3  # consecutive deaths of one worker slot without any result
CLAIM_LEASE_S = 20.0  # a killed sweep's claims free up this long after its last heartbeat


class SweepError(RuntimeError):
    """The sweep cannot run at all (no GPU, workers that cannot start)."""


def visible_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES entries to pin one worker each to (every GPU torch sees)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def serves(target: str | None, fp: dict) -> bool:
    """Whether a GPU of fingerprint `fp` may measure a candidate aimed at `target`: None (any
    GPU), an SM target such as "sm90", or part of a GPU name such as "H200"."""
    if target is None:
        return True
    sm = target_sm(target)
    if sm is not None:
        return fp.get("sm") == sm
    return target.lower() in str(fp.get("gpu_name") or "").lower()


def _scope(c: Candidate) -> str:
    """What a claim on `c` covers: its target, or "*" (any GPU)."""
    return c.target or "*"


def result_row(c: Candidate, result: dict, env_id: str, sweep_id: str, worker: str) -> dict:
    """A database row: the candidate's identity plus the worker's result columns."""
    key = c.problem.key()
    row = dict(env_id=env_id, candidate_key=c.key(), problem_key=key, preset=c.preset, **key,
               accepted=c.accepted, sustain_s=c.sustain_s or None,
               sustain_load=c.sustain_load or None, impl=c.impl, params=c.params_dict,
               sweep_id=sweep_id, worker=worker, provenance="measured")
    row.update(result)
    return row


def new_sweep_id(name: str) -> str:
    return f"{name}-{_dt.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


@dataclass
class SweepOutcome:
    sweep_id: str
    total: int
    skipped: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    not_run: collections.Counter = field(default_factory=collections.Counter)  # target -> count
    requeued: int = 0  # candidates handed out again after their node left (Ray sweeps)

    @property
    def measured(self) -> int:
        return sum(self.by_status.values())

    @property
    def failed(self) -> int:
        return sum(n for s, n in self.by_status.items() if s.startswith("failed"))

    def summary(self) -> str:
        text = ", ".join(f"{n} {s}" for s, n in sorted(self.by_status.items())) or "nothing measured"
        text += f"; {self.skipped} done before (skipped)"
        if self.requeued:
            text += f"; {self.requeued} requeued after their node left"
        for target, n in sorted(self.not_run.items()):
            text += f"; {n} not run: no GPU for target {target!r}"
        return text


@dataclass
class Worker:
    """Where a result comes from: a worker's label, host, environment and SM."""

    label: str
    env_id: str
    fp: dict
    node: str = field(default_factory=socket.gethostname)

    @property
    def sm(self):
        return self.fp.get("sm")


class SweepQueue:
    """The candidates still to measure, and everything a sweep writes: claims (taken before a
    candidate is handed out, renewed by `heartbeat`, released once its row is in), result rows,
    the outcome and the progress bar. Only the process that owns it writes the database."""

    def __init__(self, candidates, db: ProfileDB, outcome: SweepOutcome, bar, *, retry_failed=False,
                 lease_s: float = CLAIM_LEASE_S, fresh=frozenset()):
        self.candidates, self.db, self.outcome, self.bar = candidates, db, outcome, bar
        self.fresh = frozenset(fresh)  # keys measured again even where rows exist (`run_sweep`)
        self.statuses = ("ok", "unsupported") if retry_failed else None
        self.lease_s, self.since = lease_s, dbm.now()
        self.pending = collections.deque(range(len(candidates)))
        self.deferred: list[int] = []  # claimed by another sweep: looked at again later
        self.envs: set[str] = set()
        self.next_beat = 0.0
        dbm.ensure_claims(db)

    @property
    def owner(self) -> str:
        return self.outcome.sweep_id

    def open(self) -> bool:
        """Whether any candidate is still waiting (pending or claimed by another sweep)."""
        return bool(self.pending or self.deferred)

    def add_environment(self, fp: dict) -> str:
        """Record a worker's environment; the first time, skip up front what it already holds."""
        env_id = self.db.add_environment(fp)
        if env_id not in self.envs:
            self.envs.add(env_id)
            done = self.db.done_candidates(env_id, self.statuses)
            keep = [i for i in self.pending
                    if not (self.candidates[i].key() in done - self.fresh
                            and serves(self.candidates[i].target, fp))]
            self._skip(len(self.pending) - len(keep))
            self.pending = collections.deque(keep)
        return env_id

    def take(self, w: Worker) -> int | None:
        """The next candidate `w` may measure, claimed for this sweep; None when none is left."""
        for _ in range(len(self.pending)):
            i = self.pending.popleft()
            if not serves(self.candidates[i].target, w.fp):
                self.pending.append(i)
                continue
            c = self.candidates[i]
            state = dbm.claim_candidate(self.db, _scope(c), w.env_id, c.key(), self.owner, lease_s=self.lease_s,
                                        since=self.since, statuses=self.statuses,
                                        serves=lambda env, t=c.target: serves(t, env),
                                        fresh=c.key() in self.fresh)
            if state == dbm.CLAIMED:
                return i
            if state == dbm.DONE:  # another environment or another sweep finished it
                self._skip()
            else:
                self.deferred.append(i)
        return None

    def put_back(self, i: int) -> None:
        """A candidate handed out but not measured (its node left): free and queue it again."""
        c = self.candidates[i]
        dbm.release_claim(self.db, _scope(c), c.key(), self.owner)
        self.pending.appendleft(i)

    def record(self, i: int, w: Worker, result: dict) -> None:
        c = self.candidates[i]
        self.db.add_result(result_row(c, result, w.env_id, self.outcome.sweep_id, w.label))  # now
        dbm.release_claim(self.db, _scope(c), c.key(), self.owner)
        status = result.get("status", "?")
        self.outcome.by_status[status] += 1
        self.bar.result(c, status, result.get("reason"), w)

    def drop_unserved(self, fps: list[dict]) -> None:
        """Once every worker has said what it is: candidates none of them can run are not run."""
        keep = collections.deque()
        dropped: collections.Counter = collections.Counter()
        for i in self.pending:
            target = self.candidates[i].target
            if any(serves(target, fp) for fp in fps):
                keep.append(i)
            else:
                dropped[target] += 1
        self.pending = keep
        # called again after every worker restart: only what this call drops is news
        self.outcome.not_run.update(dropped)
        for target, n in dropped.items():
            self.bar.not_run(target, n)

    def heartbeat(self) -> float:
        """Renew this sweep's claims and look again at candidates others held, when due; returns
        the seconds until the next beat."""
        now = time.monotonic()
        if now >= self.next_beat:
            dbm.renew_claims(self.db, self.owner, self.lease_s)
            self.pending.extend(self.deferred)
            self.deferred.clear()
            self.next_beat = now + min(self.lease_s / 3, 2.0)
        return self.next_beat - now

    def close(self) -> None:
        dbm.release_claims(self.db, self.owner)
        self.bar.close()
        self.db.close()

    def _skip(self, n: int = 1) -> None:
        self.outcome.skipped += n
        self.bar.skip(n)


def run_sweep(candidates: list[Candidate], db_path, *, timeout_s: float = 600, options: dict | None = None,
              devices: list[str | None] | None = None, measure: str = MEASURE,
              fingerprint: str = FINGERPRINT, retry_failed: bool = False, progress: bool = True,
              sweep_id: str | None = None, name: str = "sweep",
              lease_s: float = CLAIM_LEASE_S, fresh=frozenset()) -> SweepOutcome:
    """Measure `candidates` in worker processes, one per entry of `devices` (CUDA_VISIBLE_DEVICES
    entries; default: one per visible GPU; None entries pin nothing), writing each result to
    `db_path` the moment it arrives. Candidates with a row for the worker's environment are
    skipped (with `retry_failed`, only rows that are ok or unsupported count as done), except
    those whose keys are in `fresh`: they are measured again unless a row of theirs was written
    since this sweep started (`tuner refine --with-winners`: each key's winner, runners-up and
    refined candidate, in one run). `measure` and `fingerprint` name the worker's functions
    ("module:attr")."""
    devices = visible_devices() if devices is None else list(devices)
    if not devices:
        raise SweepError("no CUDA GPU is visible: a sweep measures kernels on a GPU "
                         "(check CUDA_VISIBLE_DEVICES and nvidia-smi)")
    ctx = mp.get_context("spawn")
    slots = [Slot(ctx, d, d if d is not None else str(i), measure, fingerprint, options)
             for i, d in enumerate(devices)]
    outcome = SweepOutcome(sweep_id or new_sweep_id(name), len(candidates))
    queue = SweepQueue(candidates, ProfileDB(db_path), outcome, Progress(progress, name, len(candidates)),
                       retry_failed=retry_failed, lease_s=lease_s, fresh=fresh)
    sweep = _Sweep(queue, slots, timeout_s)
    try:
        sweep.run()
    finally:
        sweep.close()
    return outcome


class _Sweep:
    """The parent's loop over local worker slots: dispatch, collect, record, restart."""

    def __init__(self, queue: SweepQueue, slots: list[Slot], timeout_s: float):
        self.queue, self.slots, self.timeout_s = queue, slots, timeout_s
        self.workers: dict[str, Worker] = {}  # slot label -> what its worker reported

    def run(self) -> None:
        for s in self.slots:
            s.start()
        while self.queue.open() or any(s.task for s in self.slots):
            self._dispatch()
            self._collect()

    def close(self) -> None:
        interrupted = self.queue.open() or any(s.task for s in self.slots)
        for s in self.slots:
            s.stop(kill=interrupted)
        self.queue.close()

    def _dispatch(self) -> None:
        for s in self.slots:
            if s.ready and s.task is None:
                i = self.queue.take(self.workers[s.label])
                if i is None:
                    continue
                try:
                    s.conn.send((i, self.queue.candidates[i].to_wire()))
                except OSError:  # it died since the last look; _collect restarts it
                    self.queue.put_back(i)
                    continue
                s.task = (i, time.monotonic() + self.timeout_s)

    def _collect(self) -> None:
        """Wait for a message, a worker's death, a deadline or a heartbeat, and handle it."""
        live = [s for s in self.slots if s.proc is not None]
        deadlines = [s.task[1] for s in live if s.task]
        deadlines += [s.started_at + START_TIMEOUT_S for s in live if not s.ready]
        timeout = self.queue.heartbeat()
        if deadlines:
            timeout = max(0.0, min(timeout, min(deadlines) - time.monotonic()))
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
                self._record(s, s.task[0], timeout_result(self.timeout_s))
                s.start()
            elif s.proc is not None and not s.ready and now > s.started_at + START_TIMEOUT_S:
                raise SweepError(f"worker for device {s.label} did not start within {START_TIMEOUT_S} s")

    def _handle(self, s: Slot, msg) -> None:
        kind = msg[0]
        if kind == "error":
            raise SweepError(msg[1])
        if kind == "ready":
            s.env_id = self.queue.add_environment(msg[1])
            s.start_failures = 0
            self.workers[s.label] = Worker(s.label, s.env_id, msg[1])
            if len(self.workers) == len(self.slots):
                self.queue.drop_unserved([w.fp for w in self.workers.values()])
        elif kind == "result":
            self._record(s, msg[1], msg[2])
            if msg[2].get("status") == "failed_runtime":  # the worker exits after these (see worker)
                s.stop()
                s.start()

    def _died(self, s: Slot) -> None:
        s.proc.join()
        code = s.proc.exitcode
        if s.task:
            self._record(s, s.task[0], died_result(code))
        elif not s.ready:
            s.start_failures += 1
            if s.start_failures >= MAX_START_FAILURES:
                raise SweepError(f"worker for device {s.label} died {s.start_failures} times while "
                                 f"starting ({died_result(code)['reason']})")
        s.restart()

    def _record(self, s: Slot, i: int, result: dict) -> None:
        self.queue.record(i, self.workers[s.label], result)
        s.task = None


class Progress:
    """A rich progress bar with ETA (stderr), and below it a line per node and per SM with the
    count each has measured; failures and targets no GPU serves are printed above it."""

    def __init__(self, enabled: bool, name: str, total: int):
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self.counts = collections.Counter()
        self.rows: dict[str, int] = {}  # "node X" / "sm90" -> its task (a count, no bar)
        self.name = name
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=Console(stderr=True))
        self.task = self.progress.add_task(self._describe(), total=total)
        self.progress.start()

    def _describe(self) -> str:
        c = self.counts
        failed = sum(n for s, n in c.items() if s.startswith("failed"))
        text = (f"{self.name}: [green]{c['ok']} ok[/] [red]{failed} failed[/] "
                f"{c['unsupported']} unsupported {c['skipped']} done before")
        return text + (f" [yellow]{c['not run']} not run[/]" if c["not run"] else "")

    def _count(self, row: str) -> None:
        if row not in self.rows:
            self.rows[row] = self.progress.add_task(f"  {row}", total=None)
        self.progress.advance(self.rows[row])

    def _out_of_total(self, n: int, what: str) -> None:
        """Candidates that will not run here: out of the total, so the ETA counts only work left."""
        self.counts[what] += n
        total = self.progress.tasks[0].total - n
        self.progress.update(self.task, total=total, description=self._describe())

    def skip(self, n: int = 1) -> None:
        if self.enabled and n:
            self._out_of_total(n, "skipped")

    def not_run(self, target: str, n: int) -> None:
        if self.enabled:
            self.progress.console.print(f"[yellow]{n} not run[/]: no GPU for target {target!r}")
            self._out_of_total(n, "not run")

    def result(self, c: Candidate, status: str, reason: str | None, w: Worker) -> None:
        if not self.enabled:
            return
        self.counts[status] += 1
        self._count(f"node {w.node}")
        self._count(f"sm{w.sm}")
        if status.startswith("failed"):
            self.progress.console.print(f"[red]{status}[/] {c.label()} on {w.label}: "
                                        f"{(reason or '').splitlines()[0][:200]}")
        self.progress.update(self.task, advance=1, description=self._describe())

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
