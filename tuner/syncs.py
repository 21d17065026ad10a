"""Host-sync stalls of one decode step, measured in layers (a zero is reported only when measured):

1. `torch.cuda.set_sync_debug_mode("warn")`: torch warns at every synchronizing call it makes;
   the warnings are caught and counted.
2. The torch profiler's CUDA runtime events (CUPTI): blocking calls (cudaStreamSynchronize,
   cudaDeviceSynchronize, cudaEventSynchronize, synchronous cudaMemcpy) inside the step, their
   count and host time, and device-to-host copies. Unlike layer 1 this also sees other libraries
   that call the CUDA runtime.
3. Nsight Systems in a subprocess (`tuner.nsys`: found on PATH, at $NSYS or in the install
   folders; only the timed steps captured, through cudaProfilerStart/Stop; the blocking calls
   inside each step's NVTX range read from the sqlite export), when asked for; otherwise a note
   says why it did not run (not asked, not found, or the exact shared library it lacks).
4. Whether the step captures into a CUDA graph at all (a host sync inside capture fails it).

The deliberately bad step that proves the detector is the registry's `reference-syncing`
(`kernels.syncing_store`): the cupy attention, with a store that reads the per-request block
counts back with `.tolist()` before writing, once per layer. `bad_step` builds it.

    python -m drafter_attn.tuner.syncs --candidate '<Candidate.to_wire() JSON>' [--runs N]
runs a step under NVTX ranges between cudaProfilerStart and cudaProfilerStop (the target that
the Nsight Systems layer profiles);

    python -m drafter_attn.tuner.syncs compare [--impl cupy,reference-syncing] [--batch 2] ... [--keep DIR]
runs every layer on each implementation's step and prints them side by side as JSON (`--keep`
also keeps each nsys export and its `nsys stats` text in DIR).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from drafter_attn.kernels.tuned_table import sync_count
from drafter_attn.tuner import nsys as nsys_tool
from drafter_attn.tuner.nsys import (  # noqa: F401  (the layers' shared vocabulary, used here and by tests)
    BLOCKING_CALLS, MARKER, RuntimeSyncs, call_name, classify_runtime, parse_nsys_sqlite)

NSYS_NOT_ASKED = "nsys layer not requested (bench decode --syncs all, or sweep.nsys = true, runs it)"


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


@dataclass(frozen=True)
class NsysResult:
    syncs: RuntimeSyncs | None  # from the sqlite export, per step (None: no result)
    note: str | None  # why there is no result, or where the figures disagree; None when all is well
    stats: RuntimeSyncs | None = None  # the same figures from `nsys stats` reports, when nsys ran them
    export: str | None = None  # the kept sqlite export (`keep`)


def _target_argv(candidate: dict, runs: int) -> list[str]:
    return [sys.executable, "-m", "drafter_attn.tuner.syncs", "--candidate", json.dumps(candidate),
            "--runs", str(runs)]


def _failure_note(proc, install) -> str:
    text = f"{proc.stdout or ''}\n{proc.stderr or ''}"
    missing = nsys_tool.missing_from_output(text)
    if missing:
        return nsys_tool.missing_note(install.path, install.version, missing)
    if "No reports were generated" in text:
        return ("nsys generated no report: the target never called cudaProfilerStart (the capture "
                "range), or it failed before the timed steps: " + " | ".join(text.strip().splitlines()[-3:]))
    tail = " | ".join(text.strip().splitlines()[-3:])
    return f"nsys profile failed (exit {proc.returncode}): {tail}"


def nsys_syncs(candidate: dict, runs: int = 5, timeout_s: float = 600, *, install=None,
               keep: str | Path | None = None, name: str = "step", stats: bool = True) -> NsysResult:
    """Profile the step of `candidate` (Candidate.to_wire()) under Nsight Systems: `runs` timed
    steps in the capture range, each an NVTX range; the blocking calls per step read from the
    sqlite export, cross-checked against `nsys stats` (`stats`). `install` (tuner.nsys.find_nsys()
    by default) says which nsys. `keep`: a folder that receives `<name>.sqlite` and
    `<name>-stats.txt`."""
    install = install or nsys_tool.find_nsys()
    if not install.usable:
        return NsysResult(None, install.note)
    with tempfile.TemporaryDirectory(prefix="tuner-nsys-") as tmp:
        report = Path(tmp) / name
        cmd = nsys_tool.profile_command(install.path, report, _target_argv(candidate, runs))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return NsysResult(None, f"nsys profile timed out after {timeout_s:.0f} s")
        sqlite_path = report.with_suffix(".sqlite")
        if proc.returncode != 0 or not sqlite_path.exists():
            return NsysResult(None, _failure_note(proc, install))
        try:
            syncs = parse_nsys_sqlite(sqlite_path)
        except (sqlite3.Error, ValueError) as exc:
            return NsysResult(None, f"could not read the nsys export: {exc}")
        note, from_stats, text = None, None, ""
        if stats:
            from_stats, text, why = nsys_tool.stats_syncs(install.path, sqlite_path)
            if why:
                note = why
            elif from_stats.count != syncs.count:
                note = (f"nsys stats counts {from_stats.count} blocking calls per step over the whole capture, "
                        f"the export {syncs.count} inside the steps' NVTX ranges")
        export = None
        if keep is not None:
            keep = Path(keep)
            keep.mkdir(parents=True, exist_ok=True)
            export = str(shutil.copy(sqlite_path, keep / f"{name}.sqlite"))
            if text:
                (keep / f"{name}-stats.txt").write_text(text)
        return NsysResult(syncs, note, from_stats, export)


# ---------------------------------------------------------------------------------------------
# Everything together


@dataclass
class SyncReport:
    debug_syncs: int | None = None
    profiler: RuntimeSyncs | None = None
    nsys: RuntimeSyncs | None = None
    nsys_stats: RuntimeSyncs | None = None  # the nsys figures from `nsys stats`, a cross-check
    graph_error: str | None = None  # why capture failed (None: captured, or not tried)
    graph_tried: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def graph_capturable(self) -> bool | None:
        return (self.graph_error is None) if self.graph_tried else None

    @property
    def counts(self) -> dict[str, int]:
        """Blocking calls per step of each layer that ran: debug, profiler, nsys."""
        out = {"debug": self.debug_syncs, "profiler": self.profiler and self.profiler.count,
               "nsys": self.nsys and self.nsys.count}
        return {k: v for k, v in out.items() if v is not None}

    @property
    def syncs(self) -> int | None:
        """The most blocking calls any layer saw; None when no layer measured (the database's
        rule, kernels.tuned_table.sync_count, over this report's row)."""
        return sync_count(self.as_row())

    @property
    def agree(self) -> bool | None:
        """Whether every layer that ran counts the same (None: none ran)."""
        return len(set(self.counts.values())) == 1 if self.counts else None

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
        return {**asdict(self), "graph_capturable": self.graph_capturable, "syncs": self.syncs,
                "counts": self.counts, "agree": self.agree}


def detect_syncs(fn, *, graph: bool = True, nsys_candidate: dict | None = None, nsys_runs: int = 5,
                 nsys_install=None, nsys_keep=None, nsys_name: str = "step") -> SyncReport:
    """Run every layer on `fn` (one step; it is run once first as a warm-up). `graph=False`
    skips the capture layer (e.g. when the caller already captured the step).
    `nsys_candidate` (Candidate.to_wire()) enables the Nsight Systems layer, over `nsys_runs`
    steps of a fresh process (`nsys_syncs`: `nsys_install`, `nsys_keep`, `nsys_name`)."""
    import torch

    fn()  # compile, load and allocate outside the measured calls
    torch.cuda.synchronize()
    report = SyncReport()
    report.debug_syncs = debug_mode_syncs(fn)
    report.profiler = profiler_syncs(fn)
    if nsys_candidate is not None:
        result = nsys_syncs(nsys_candidate, runs=nsys_runs, install=nsys_install, keep=nsys_keep, name=nsys_name)
        report.nsys, report.nsys_stats = result.syncs, result.stats
        if result.note:
            report.notes.append(result.note)
    else:
        report.notes.append(NSYS_NOT_ASKED)
    if graph:
        report.graph_tried = True
        report.graph_error = graph_capture(fn)
    return report


# ---------------------------------------------------------------------------------------------
# The deliberately bad step


def bad_step(problem, inner=None, **kwargs):
    """A DecodeStep of the `reference-syncing` store, which syncs the host once per layer; with
    `inner` (a registry name or backend) its attention and store are that backend's instead of
    cupy's (e.g. "reference", on CPU tensors)."""
    from drafter_attn.kernels import registry
    from drafter_attn.kernels.syncing_store import SyncingStoreBackend
    from drafter_attn.tuner.step import DecodeStep

    if inner is None:
        return DecodeStep(problem, "reference-syncing", **kwargs)
    base = registry.get(inner) if isinstance(inner, str) else inner
    return DecodeStep(problem, SyncingStoreBackend(base), **kwargs)


def _wait_without_blocking_call() -> None:
    """Wait for the device by polling an event (cudaEventQuery, which never blocks), so that the
    capture holds no blocking call of our own: `nsys stats` over the whole capture then counts
    the steps' calls alone."""
    import torch

    done = torch.cuda.Event()
    done.record()
    while not done.query():
        time.sleep(50e-6)


def _target(argv=None) -> int:
    """The process Nsight Systems profiles: build the step, warm it up (compile, load, allocate:
    outside the capture), then `--runs` steps back to back, each in an NVTX range, between
    cudaProfilerStart and cudaProfilerStop."""
    ap = argparse.ArgumentParser(prog="python -m drafter_attn.tuner.syncs")
    ap.add_argument("--candidate", required=True, help="Candidate.to_wire() as JSON")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    from drafter_attn.tuner.spec import Candidate
    from drafter_attn.tuner.step import DecodeStep

    c = Candidate.from_wire(json.loads(args.candidate))
    step = DecodeStep(c.problem, c.impl, c.params_dict, accepted=c.accepted)
    for _ in range(2):
        step.run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # cudaProfilerStart: the capture range begins
    for _ in range(args.runs):
        with torch.cuda.nvtx.range(MARKER):
            step.run()
    _wait_without_blocking_call()  # the steps' device work lands inside the capture
    torch.cuda.profiler.stop()
    torch.cuda.synchronize()
    return 0


# ---------------------------------------------------------------------------------------------
# Every layer on several implementations, side by side


def layers_dict(report: SyncReport) -> dict:
    """The comparison of one step's layers: count and host time blocked per layer."""
    def layer(r: RuntimeSyncs | None):
        return None if r is None else dict(syncs=r.count, host_us=round(r.host_us, 3), dtoh_copies=r.dtoh_copies,
                                           by_call=r.by_call, **({"steps": r.steps} if r.steps else {}))

    return dict(syncs_debug=report.debug_syncs, profiler=layer(report.profiler), nsys=layer(report.nsys),
                nsys_stats=layer(report.nsys_stats), counts=report.counts, agree=report.agree,
                graph_capturable=report.graph_capturable, notes=report.as_row()["sync_note"])


def compare(impls, problem, *, accepted=None, runs: int = 3, nsys: bool = True, keep=None) -> dict:
    """Every layer on the step of each implementation in `impls` for `problem` -> a JSON-able
    comparison (the nsys install found, then per implementation its layers)."""
    from drafter_attn.kernels import registry
    from drafter_attn.tuner.spec import Candidate
    from drafter_attn.tuner.step import DecodeStep

    install = nsys_tool.find_nsys() if nsys else None
    out = dict(nsys=install.as_dict() if install else None, problem=problem.key(), accepted=accepted,
               runs=runs, layers=problem.geometry.num_layers, stores=[])
    for impl in impls:
        c = Candidate(problem, impl, (), accepted)
        step = DecodeStep(problem, impl, accepted=accepted)
        report = detect_syncs(step.run, nsys_candidate=c.to_wire() if nsys else None, nsys_runs=runs,
                              nsys_install=install, nsys_keep=keep, nsys_name=impl)
        out["stores"].append(dict(impl=impl, reference_only=registry.reference_only(impl), **layers_dict(report)))
        del step
    return out


def _compare(argv) -> int:
    from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
    from drafter_attn.kernels.spec import Problem

    ap = argparse.ArgumentParser(prog="python -m drafter_attn.tuner.syncs compare",
                                 description="every host-sync layer on each implementation's step, as JSON")
    ap.add_argument("--impl", default="cupy,reference-syncing", help="comma list of registry names")
    ap.add_argument("--preset", default=MAIN_PRESET)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--layout", choices=("paged", "arena"), default="paged")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3, help="steps inside the nsys capture")
    ap.add_argument("--no-nsys", action="store_true", help="the two in-process layers only")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep each nsys export (<impl>.sqlite) here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"{ap.prog}: no CUDA GPU here (torch.cuda.is_available() is False): the sync "
              f"detectors watch a decode step run on one", file=sys.stderr)
        return 2
    g = get_preset(args.preset)
    if args.layers:
        g = g.with_(num_layers=args.layers)
    problem = Problem(g, args.layout, args.page if args.layout == "paged" else None, args.batch, args.ctx)
    impls = [s.strip() for s in args.impl.split(",") if s.strip()]
    print(json.dumps(compare(impls, problem, runs=args.runs, nsys=not args.no_nsys, keep=args.keep), indent=1))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        return _compare(argv[1:])
    return _target(argv)


if __name__ == "__main__":
    raise SystemExit(main())
