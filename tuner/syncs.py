"""Host-sync stalls of one decode step, measured in layers (a zero is reported only when measured):

1. `torch.cuda.set_sync_debug_mode("warn")`: torch warns at every synchronizing call it makes;
   the warnings are caught and counted.
2. The torch profiler's CUDA runtime events (CUPTI): blocking calls (cudaStreamSynchronize,
   cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy) inside the step, their
   count and host time, and device-to-host copies. Unlike layer 1 this also sees other libraries
   that call the CUDA runtime.
3. Nsight Systems in a subprocess (`nsys profile --export=sqlite`, then the runtime and memcpy
   tables inside the step's NVTX ranges), when `nsys` is on PATH; otherwise a note says it is not.
4. Whether the step captures into a CUDA graph at all (a host sync inside capture fails it).

`SyncingBackend` / `bad_step` build the deliberately bad step that proves the detector: its store
reads `num_new` to the host with `.tolist()` before storing.

    python -m drafter_attn.tuner.syncs --candidate '<Candidate.to_wire() JSON>' [--bad] [--runs N]
runs a step under NVTX ranges (the target that the Nsight Systems layer profiles).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from drafter_attn.kernels.tuned_table import sync_count

MARKER = "drafter_step"
# Runtime / driver API calls that block the host until the device (or a stream) is done.
BLOCKING_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol", "cudaThreadSynchronize",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpy",
})
NSYS_MISSING = ("nsys not found on PATH: the Nsight Systems layer did not run "
                "(the sync-debug and profiler layers did)")
_VERSION_SUFFIX = re.compile(r"_v\d+$|_ptsz$|_ptds$")


def call_name(name: str) -> str:
    """cudaStreamSynchronize_v3020 -> cudaStreamSynchronize (nsys appends API versions)."""
    return _VERSION_SUFFIX.sub("", name)


@dataclass(frozen=True)
class RuntimeSyncs:
    """Blocking runtime calls seen by a tracer inside the step."""

    count: int
    host_us: float  # host time spent inside those calls
    dtoh_copies: int
    by_call: dict = field(default_factory=dict)


def classify_runtime(calls, windows=None, dtoh_copies: int = 0) -> RuntimeSyncs:
    """Count blocking calls among `calls` [(name, start_us, duration_us)], keeping only those
    that start inside one of `windows` [(start_us, end_us)] when windows are given."""
    count, host_us, by_call = 0, 0.0, {}
    for name, start, duration in calls:
        base = call_name(name)
        if base not in BLOCKING_CALLS:
            continue
        if windows is not None and not any(lo <= start <= hi for lo, hi in windows):
            continue
        count += 1
        host_us += duration
        by_call[base] = by_call.get(base, 0) + 1
    return RuntimeSyncs(count, host_us, dtoh_copies, by_call)


# ---------------------------------------------------------------------------------------------
# The layers


def debug_mode_syncs(fn) -> int:
    """Synchronizing calls torch reports while `fn` runs (set_sync_debug_mode "warn")."""
    import torch

    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    # Count torch's own sync warning only: the one-time "Synchronization debug mode is a
    # prototype feature ..." notice of a fresh process must not read as a sync.
    return sum("called a synchronizing" in str(w.message) for w in caught)


def profiler_syncs(fn) -> RuntimeSyncs:
    """Blocking CUDA runtime calls of `fn` from the torch profiler (inside a record_function
    range, so the profiler's own start/stop synchronisation is not counted)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(MARKER):
            fn()
    events = prof.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.name == MARKER and e.device_type == DeviceType.CPU] or None
    calls = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in events
             if e.device_type == DeviceType.CPU]
    dtoh = sum(1 for e in events if e.device_type != DeviceType.CPU and e.name.startswith("Memcpy DtoH"))
    return classify_runtime(calls, windows, dtoh)


def graph_capture(fn) -> str | None:
    """None when `fn` captures into a CUDA graph, else why not."""
    import torch

    from drafter_attn.tuner.timing import capture

    try:
        capture(fn, warmup=1)
        return None
    except Exception as exc:  # a sync during capture invalidates it
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def parse_nsys_sqlite(path, marker: str = MARKER, runs: int = 1) -> RuntimeSyncs:
    """Blocking runtime calls (and DtoH copies) inside the NVTX ranges named `marker` of an
    `nsys export --type sqlite` file, per run (totals divided by `runs`, rounded)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        nvtx_cols = {r[1] for r in con.execute("PRAGMA table_info(NVTX_EVENTS)")} if "NVTX_EVENTS" in tables else set()
        text = "text"
        if "textId" in nvtx_cols:
            text = "COALESCE(n.text, (SELECT value FROM StringIds WHERE id = n.textId))"
        windows = [(s, e) for s, e in con.execute(
            f"SELECT n.start, n.end FROM NVTX_EVENTS n WHERE {text} = ? AND n.end IS NOT NULL", (marker,))]
        if not windows:
            raise ValueError(f"no NVTX range {marker!r} in {path}")
        calls = []
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            calls = [(name, s / 1e3, (e - s) / 1e3) for name, s, e in con.execute(
                "SELECT s.value, r.start, r.end FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
                "JOIN StringIds s ON r.nameId = s.id")]
        dtoh = 0
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
            for s, kind in con.execute("SELECT start, copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"):
                if kind == 2 and any(lo <= s <= hi for lo, hi in windows):  # 2: device to host
                    dtoh += 1
    finally:
        con.close()
    total = classify_runtime(calls, [(lo / 1e3, hi / 1e3) for lo, hi in windows], dtoh)
    return RuntimeSyncs(round(total.count / runs), total.host_us / runs, round(dtoh / runs),
                        {k: v / runs for k, v in total.by_call.items()})


@dataclass(frozen=True)
class NsysResult:
    syncs: RuntimeSyncs | None
    note: str | None  # why there is no result, or None


def nsys_syncs(candidate: dict, bad: bool = False, runs: int = 5, timeout_s: float = 600) -> NsysResult:
    """Profile the step of `candidate` (Candidate.to_wire()) under Nsight Systems."""
    exe = shutil.which("nsys")
    if exe is None:
        return NsysResult(None, NSYS_MISSING)
    with tempfile.TemporaryDirectory(prefix="tuner-nsys-") as tmp:
        report = Path(tmp) / "step"
        cmd = [exe, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none",
               "--force-overwrite=true", "--export=sqlite", "-o", str(report),
               sys.executable, "-m", "drafter_attn.tuner.syncs", "--candidate", json.dumps(candidate),
               "--runs", str(runs), *(["--bad"] if bad else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return NsysResult(None, f"nsys profile timed out after {timeout_s:.0f} s")
        sqlite_path = report.with_suffix(".sqlite")
        if proc.returncode != 0 or not sqlite_path.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return NsysResult(None, f"nsys profile failed (exit {proc.returncode}): {' | '.join(tail)}")
        try:
            return NsysResult(parse_nsys_sqlite(sqlite_path, runs=runs), None)
        except (sqlite3.Error, ValueError) as exc:
            return NsysResult(None, f"could not read the nsys export: {exc}")


# ---------------------------------------------------------------------------------------------
# Everything together


@dataclass
class SyncReport:
    debug_syncs: int | None = None
    profiler: RuntimeSyncs | None = None
    nsys: RuntimeSyncs | None = None
    graph_error: str | None = None  # why capture failed (None: captured, or not tried)
    graph_tried: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def graph_capturable(self) -> bool | None:
        return (self.graph_error is None) if self.graph_tried else None

    @property
    def syncs(self) -> int | None:
        """The most blocking calls any layer saw; None when no layer measured (the database's
        rule, kernels.tuned_table.sync_count, over this report's row)."""
        return sync_count(self.as_row())

    def as_row(self) -> dict:
        """Database columns (NULL where a layer did not run)."""
        notes = list(self.notes)
        if self.graph_error:
            notes.append(f"graph capture failed: {self.graph_error}")
        return dict(
            syncs_debug=self.debug_syncs,
            syncs_profiler=None if self.profiler is None else self.profiler.count,
            sync_host_us=None if self.profiler is None else self.profiler.host_us,
            dtoh_copies=None if self.profiler is None else self.profiler.dtoh_copies,
            syncs_nsys=None if self.nsys is None else self.nsys.count,
            sync_host_us_nsys=None if self.nsys is None else self.nsys.host_us,
            graph_capturable=self.graph_capturable,
            sync_note="; ".join(notes) or None,
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "graph_capturable": self.graph_capturable, "syncs": self.syncs}


def detect_syncs(fn, *, graph: bool = True, nsys_candidate: dict | None = None,
                 nsys_bad: bool = False) -> SyncReport:
    """Run every layer on `fn` (one step; it is run once first as a warm-up). `graph=False`
    skips the capture layer (e.g. when the caller already captured the step).
    `nsys_candidate` (Candidate.to_wire()) enables the Nsight Systems layer."""
    import torch

    fn()  # compile, load and allocate outside the measured calls
    torch.cuda.synchronize()
    report = SyncReport()
    report.debug_syncs = debug_mode_syncs(fn)
    report.profiler = profiler_syncs(fn)
    if nsys_candidate is not None:
        result = nsys_syncs(nsys_candidate, bad=nsys_bad)
        report.nsys = result.syncs
        if result.note:
            report.notes.append(result.note)
    else:
        report.notes.append("nsys layer not requested (sweep.nsys = true runs it)")
    if graph:
        report.graph_tried = True
        report.graph_error = graph_capture(fn)
    return report


# ---------------------------------------------------------------------------------------------
# The deliberately bad step


class SyncingBackend:
    """A backend whose stores first read `num_new` to the host (`.tolist()`): one host sync per
    store, the mistake the detector must catch. Everything else is the wrapped backend's."""

    def __init__(self, inner):
        self.inner = inner
        self.name = f"{inner.name}+tolist"

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def with_params(self, **params):
        return SyncingBackend(self.inner.with_params(**params))

    def store_paged(self, k_new, v_new, num_new, *cache):
        num_new.tolist()  # the host waits for the device here
        return self.inner.store_paged(k_new, v_new, num_new, *cache)

    def store_arena(self, k_new, v_new, num_new, *cache):
        num_new.tolist()
        return self.inner.store_arena(k_new, v_new, num_new, *cache)


def bad_step(problem, backend="cupy", params=None, **kwargs):
    """A DecodeStep whose store syncs the host once per layer (see SyncingBackend)."""
    from drafter_attn.kernels import registry
    from drafter_attn.tuner.step import DecodeStep

    inner = registry.get(backend) if isinstance(backend, str) else backend
    return DecodeStep(problem, SyncingBackend(inner), params, **kwargs)


def _target(argv=None) -> int:
    """The process Nsight Systems profiles: build the step, warm up, run it in NVTX ranges."""
    ap = argparse.ArgumentParser(prog="python -m drafter_attn.tuner.syncs")
    ap.add_argument("--candidate", required=True, help="Candidate.to_wire() as JSON")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bad", action="store_true", help="the deliberately syncing store")
    args = ap.parse_args(argv)
    import torch

    from drafter_attn.tuner.spec import Candidate
    from drafter_attn.tuner.step import DecodeStep

    c = Candidate.from_wire(json.loads(args.candidate))
    make = bad_step if args.bad else DecodeStep
    step = make(c.problem, c.impl, c.params_dict, accepted=c.accepted)
    for _ in range(2):
        step.run()
    torch.cuda.synchronize()
    for _ in range(args.runs):
        with torch.cuda.nvtx.range(MARKER):
            step.run()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(_target())
