"""Nsight Systems, the third host-sync layer (tuner.syncs): finding `nsys`, saying why it cannot
run, the capture command line, and reading what it wrote.

- `find_nsys()` looks on `PATH`, then at `$NSYS` (the executable or its folder), then in the
  usual install folders (`INSTALL_GLOBS`), newest version first. An `nsys` that is there but
  whose importer (`QdstrmImporter`, which turns a capture into a report) cannot load a shared
  library is reported with the library's name (from `ldd`), e.g. the H200 image's
  `libdw.so.1`; `missing_from_output` reads the same from a failed run's messages.
- `profile_command()` captures only the timed steps: `--capture-range=cudaProfilerApi`, so
  nothing is recorded before the target calls `cudaProfilerStart` (compilation, loading and
  warm-up stay out of the trace) or after `cudaProfilerStop`; each step is one NVTX range named
  `MARKER`.
- `parse_nsys_sqlite()` reads an `nsys export --type sqlite` file without nsys (CI has none): the
  blocking CUDA calls on the range's thread inside each `MARKER` range, their host time, and the
  device-to-host copies they issued, per step. `stats_syncs()` gets the same figures from `nsys
  stats` reports (`cuda_api_sum`, `nvtx_sum`, `cuda_gpu_mem_time_sum`), which count the whole
  capture: with the capture range that is the timed steps alone, so the two agree.
"""

from __future__ import annotations

import csv
import glob
import io
import os
import re
import shutil
import sqlite3
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "drafter_step"
INSTALL_GLOBS = ("/opt/nvidia/nsight-systems/*/bin", "/opt/nvidia/nsight-compute/*/host/target-linux-x64")
IMPORTER = "QdstrmImporter"
# Runtime / driver API calls that block the host until the device (or a stream) is done.
BLOCKING_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cudaMemcpyToSymbol", "cudaMemcpyFromSymbol", "cudaThreadSynchronize",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpy",
})
# The Debian packages of the libraries nsys importers are known to miss.
PACKAGES = {"libdw.so.1": "libdw1", "libelf.so.1": "libelf1"}
DTOH = 2  # ENUM_CUDA_MEMCPY_OPER: CUDA_MEMCPY_KIND_DTOH
STATS_REPORTS = ("cuda_api_sum", "nvtx_sum", "cuda_gpu_mem_time_sum")
_VERSION_SUFFIX = re.compile(r"_v\d+$|_ptsz$|_ptds$")
_VERSION = re.compile(r"^(\d{4}(?:\.\d+)+)$")
_LOAD_ERROR = re.compile(r"([^\s:]+): error while loading shared libraries: ([^\s:]+): cannot open shared object file")


def call_name(name: str) -> str:
    """cudaStreamSynchronize_v3020 -> cudaStreamSynchronize (nsys appends API versions)."""
    return _VERSION_SUFFIX.sub("", name)


@dataclass(frozen=True)
class RuntimeSyncs:
    """Blocking runtime calls a tracer saw inside the step (per step)."""

    count: int
    host_us: float  # host time spent inside those calls
    dtoh_copies: int
    by_call: dict = field(default_factory=dict)
    steps: int | None = None  # how many step ranges the figures are averaged over (nsys)


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


def per_step(total: RuntimeSyncs, steps: int) -> RuntimeSyncs:
    """Totals over `steps` steps -> figures per step (counts rounded)."""
    steps = max(1, steps)
    return RuntimeSyncs(round(total.count / steps), total.host_us / steps, round(total.dtoh_copies / steps),
                        {k: v / steps for k, v in total.by_call.items()}, steps)


# ---------------------------------------------------------------------------------------------
# Finding nsys


@dataclass(frozen=True)
class NsysInstall:
    """Where `find_nsys` found nsys (path None: nowhere) and whether it can import a capture."""

    path: str | None
    found_via: str | None = None  # "PATH", "$NSYS" or "install folder"
    version: str | None = None  # from the install folder's name, when it has one
    importer: str | None = None  # QdstrmImporter beside it, when found
    missing: tuple = ()  # (binary, library) pairs ldd could not resolve
    searched: tuple = ()  # where it looked, in order

    @property
    def usable(self) -> bool:
        return self.path is not None and not self.missing

    @property
    def missing_libraries(self) -> list[str]:
        return list(dict.fromkeys(lib for _, lib in self.missing))

    @property
    def note(self) -> str | None:
        """Why the Nsight Systems layer cannot run (None: it can)."""
        if self.path is None:
            return (f"nsys not found ({'; '.join(self.searched) or 'nowhere searched'}): the Nsight Systems "
                    "layer did not run (the sync-debug and profiler layers did)")
        if self.missing:
            return missing_note(self.path, self.version, self.missing)
        return None

    def as_dict(self) -> dict:
        return dict(path=self.path, found_via=self.found_via, version=self.version, importer=self.importer,
                    missing_libraries=self.missing_libraries, usable=self.usable, note=self.note,
                    searched=list(self.searched))


def missing_note(nsys: str, version: str | None, missing) -> str:
    """'nsys at X (2025.3.1) cannot import its captures: QdstrmImporter needs libdw.so.1 ...'"""
    by_binary: dict[str, list[str]] = {}
    for binary, lib in missing:
        by_binary.setdefault(Path(binary).name, []).append(lib)
    needs = "; ".join(f"{b} needs {', '.join(dict.fromkeys(libs))}" for b, libs in by_binary.items())
    libs = list(dict.fromkeys(lib for _, lib in missing))
    debs = [PACKAGES[lib] for lib in libs if lib in PACKAGES]
    fix = (f"unpack the Debian package(s) {', '.join(debs)} and put their usr/lib/x86_64-linux-gnu on "
           "LD_LIBRARY_PATH" if debs else "put a folder holding them on LD_LIBRARY_PATH")
    where = f"nsys at {nsys}" + (f" ({version})" if version else "")
    return (f"{where} cannot import its captures: {needs}, not found (missing shared libraries: "
            f"{', '.join(libs)}); {fix}. The Nsight Systems layer did not run")


def _version_of(path: str) -> str | None:
    for part in reversed(Path(path).parts):
        if _VERSION.match(part):
            return part
    return None


def _version_key(version: str | None) -> tuple:
    return tuple(int(x) for x in version.split(".")) if version else ()


def _executable(path: str | os.PathLike) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_importer(nsys: str) -> str | None:
    """QdstrmImporter of the install `nsys` belongs to: beside it, else in a sibling folder
    (nsight-systems: bin/../host-linux-x64; nsight-compute: host/*/)."""
    seen = []
    for exe in dict.fromkeys((nsys, os.path.realpath(nsys))):
        here = os.path.dirname(exe)
        seen.append(os.path.join(here, IMPORTER))
        seen.extend(sorted(glob.glob(os.path.join(here, "..", "*", IMPORTER))))
    for cand in seen:
        if _executable(cand):
            return os.path.normpath(cand)
    return None


def ldd_missing(binary: str, environ=None) -> list[str]:
    """Shared libraries `ldd` reports 'not found' for `binary` (under `environ`'s
    LD_LIBRARY_PATH); [] when all resolve or ldd cannot tell."""
    env = dict(os.environ if environ is None else environ)
    ldd = shutil.which("ldd", path=env.get("PATH")) or shutil.which("ldd")
    if ldd is None:
        return []
    try:
        out = subprocess.run([ldd, binary], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError):
        return []
    return [m.group(1) for m in re.finditer(r"^\s*(\S+)\s+=>\s+not found", out.stdout, re.M)]


def missing_from_output(text: str) -> list[tuple[str, str]]:
    """(binary, library) pairs of 'X: error while loading shared libraries: Y: cannot open
    shared object file' messages in a failed run's output."""
    return list(dict.fromkeys((m.group(1), m.group(2)) for m in _LOAD_ERROR.finditer(text or "")))


def find_nsys(environ=None, install_globs=None, check_libraries: bool = True) -> NsysInstall:
    """The nsys to use: on PATH, else $NSYS (an executable or a folder holding `nsys`), else the
    newest version in the install folders (`install_globs`, default `INSTALL_GLOBS`). With
    `check_libraries`, the libraries of nsys and of its importer are checked with ldd (under
    `environ`'s LD_LIBRARY_PATH)."""
    env = dict(os.environ if environ is None else environ)
    install_globs = INSTALL_GLOBS if install_globs is None else install_globs
    searched = []
    found, via = None, None
    on_path = shutil.which("nsys", path=env.get("PATH", ""))
    searched.append(f"PATH: {on_path or 'no nsys'}")
    if on_path:
        found, via = on_path, "PATH"
    if found is None and env.get("NSYS"):
        given = env["NSYS"]
        cand = os.path.join(given, "nsys") if os.path.isdir(given) else given
        ok = _executable(cand)
        searched.append(f"$NSYS={given}: {'found' if ok else 'not an executable nsys'}")
        if ok:
            found, via = cand, "$NSYS"
    elif found is None:
        searched.append("$NSYS: not set")
    if found is None:
        installs = []
        for order, pattern in enumerate(install_globs):
            for folder in glob.glob(pattern):
                exe = os.path.join(folder, "nsys")
                if _executable(exe):
                    installs.append((_version_key(_version_of(folder)), -order, exe))
            searched.append(f"{pattern}: {sum(1 for i in installs if i[1] == -order)} found")
        if installs:
            found, via = max(installs)[2], "install folder"
    if found is None:
        return NsysInstall(None, searched=tuple(searched))
    version = _version_of(os.path.realpath(found)) or _version_of(found)
    importer = find_importer(found)
    missing = []
    if check_libraries:
        for binary in filter(None, (found, importer)):
            missing += [(binary, lib) for lib in ldd_missing(os.path.realpath(binary), env)]
    return NsysInstall(found, via, version, importer, tuple(missing), tuple(searched))


# ---------------------------------------------------------------------------------------------
# The capture


def profile_command(nsys: str, report: str | os.PathLike, target: list[str], *,
                    capture_range: str = "cudaProfilerApi") -> list[str]:
    """`nsys profile` of `target` (argv) into `report`(.nsys-rep, and .sqlite beside it).
    `capture_range="cudaProfilerApi"` records only between the target's cudaProfilerStart and
    cudaProfilerStop (the timed steps; the target keeps running after the stop); "none"
    records the whole process."""
    if capture_range not in ("cudaProfilerApi", "none"):
        raise ValueError(f"capture_range must be 'cudaProfilerApi' or 'none', got {capture_range!r}")
    cmd = [nsys, "profile", "--trace=cuda,nvtx", "--sample=none", "--cpuctxsw=none"]
    if capture_range != "none":
        cmd += [f"--capture-range={capture_range}", "--capture-range-end=stop"]
    return cmd + ["--force-overwrite=true", "--export=sqlite", "-o", str(report), *target]


def stats_command(nsys: str, sqlite_path, reports=STATS_REPORTS) -> list[str]:
    """`nsys stats` of the given reports on an export, as CSV on stdout."""
    return [nsys, "stats", "--report", ",".join(reports), "--format", "csv", "--output", "-", str(sqlite_path)]


# ---------------------------------------------------------------------------------------------
# Reading an export without nsys


def _columns(con, table: str) -> set:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def parse_nsys_sqlite(path, marker: str = MARKER, runs: int | None = None) -> RuntimeSyncs:
    """Blocking runtime calls inside the NVTX ranges named `marker` of an `nsys export --type
    sqlite` file (on the range's own thread, where the export says which thread), their host
    time, and the device-to-host copies those calls issued; per step: totals divided by `runs`
    (default: the number of `marker` ranges)."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "NVTX_EVENTS" not in tables:
            raise ValueError(f"no NVTX_EVENTS table in {path} (was it captured with --trace=nvtx?)")
        nvtx_cols = _columns(con, "NVTX_EVENTS")
        text = "n.text"
        if "textId" in nvtx_cols:
            text = "COALESCE(n.text, (SELECT value FROM StringIds WHERE id = n.textId))"
        tid = "n.globalTid" if "globalTid" in nvtx_cols else "NULL"
        windows = con.execute(f"SELECT n.start, n.end, {tid} FROM NVTX_EVENTS n "
                              f"WHERE {text} = ? AND n.end IS NOT NULL ORDER BY n.start", (marker,)).fetchall()
        if not windows:
            raise ValueError(f"no NVTX range {marker!r} in {path}")
        inside = []  # (name, start_ns, end_ns, correlationId) of calls inside a window, on its thread
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            rt_cols = _columns(con, "CUPTI_ACTIVITY_KIND_RUNTIME")
            rtid = "r.globalTid" if "globalTid" in rt_cols else "NULL"
            corr = "r.correlationId" if "correlationId" in rt_cols else "NULL"
            for name, s, e, t, c in con.execute(
                    f"SELECT s.value, r.start, r.end, {rtid}, {corr} FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
                    "JOIN StringIds s ON r.nameId = s.id"):
                if any(lo <= s <= hi and (wt is None or t is None or wt == t) for lo, hi, wt in windows):
                    inside.append((name, s, e, c))
        dtoh = 0
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
            mc_cols = _columns(con, "CUPTI_ACTIVITY_KIND_MEMCPY")
            correlations = {c for *_, c in inside if c is not None}
            if "correlationId" in mc_cols and correlations:
                copies = con.execute("SELECT copyKind, correlationId FROM CUPTI_ACTIVITY_KIND_MEMCPY")
                dtoh = sum(1 for kind, c in copies if kind == DTOH and c in correlations)
            elif "correlationId" not in mc_cols:  # an export without correlation ids: by time
                dtoh = sum(1 for s, kind in con.execute("SELECT start, copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY")
                           if kind == DTOH and any(lo <= s <= hi for lo, hi, _ in windows))
    finally:
        con.close()
    total = classify_runtime([(name, s / 1e3, (e - s) / 1e3) for name, s, e, _ in inside], None, dtoh)
    return per_step(total, runs or len(windows))


# ---------------------------------------------------------------------------------------------
# Reading `nsys stats` reports


_PROCESSING = re.compile(r"^Processing \[.*\] with \[.*?([A-Za-z0-9_]+)\.py\]")
# Header columns that identify a report (its CSV header), so sections are told apart whether or
# not nsys's 'Processing [...] with [.../NAME.py]' lines are in the text.
_HEADERS = {"cuda_api_sum": {"Num Calls", "Name"}, "nvtx_sum": {"Instances", "Range"},
            "cuda_gpu_mem_time_sum": {"Count", "Operation"}}


def _report_of_header(line: str) -> str | None:
    cells = {c.strip() for c in line.split(",")}
    for name, needed in _HEADERS.items():
        if needed <= cells and "Total Time (ns)" in cells:
            return name
    return None


def parse_stats(text: str) -> dict[str, list[dict]]:
    """`nsys stats --format csv` output -> {report name: rows as dicts}. Reports are told apart
    by their CSV headers (cuda_api_sum, nvtx_sum, cuda_gpu_mem_time_sum) and by nsys's
    'Processing [...] with [.../reports/NAME.py]...' lines; other lines (notices such as
    'SKIPPED: ... does not contain ...', blank lines) are ignored."""
    sections: dict[str, list[str]] = {}
    current, pending = None, None
    for line in (text or "").splitlines():
        m = _PROCESSING.match(line)
        if m:
            pending, current = m.group(1), None
            sections.setdefault(pending, [])
            continue
        header = _report_of_header(line)
        if header or (pending and current is None and line.count(",") >= 2):
            current, pending = header or pending, None
            sections[current] = [line]
        elif current is not None and line.count(",") >= 2:
            sections[current].append(line)
        elif not line.strip():
            current = None
    out = {}
    for name, lines in sections.items():
        reader = csv.DictReader(io.StringIO("\n".join(lines)))
        out[name] = [row for row in reader if None not in row.values() and None not in row]
    return out


def _number(text) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def syncs_from_stats(reports: dict[str, list[dict]], marker: str = MARKER, runs: int | None = None) -> RuntimeSyncs:
    """Per-step blocking calls, host time and device-to-host copies from `nsys stats` reports
    (`parse_stats`): cuda_api_sum (calls and total time per API), nvtx_sum (how many `marker`
    ranges, the steps, unless `runs` is given), cuda_gpu_mem_time_sum (copies by kind). They
    cover the whole capture, so they are per step only when the capture holds the timed steps
    alone (the capture range)."""
    steps = runs
    if steps is None:
        steps = sum(int(_number(r.get("Instances"))) for r in reports.get("nvtx_sum", [])
                    if str(r.get("Range", "")).rsplit(":", 1)[-1] == marker)
    if not steps:
        raise ValueError(f"no NVTX range {marker!r} in the nvtx_sum report")
    count, host_ns, by_call = 0, 0.0, {}
    for r in reports.get("cuda_api_sum", []):
        base = call_name(str(r.get("Name", "")))
        if base in BLOCKING_CALLS:
            calls = int(_number(r.get("Num Calls")))
            count += calls
            host_ns += _number(r.get("Total Time (ns)"))
            by_call[base] = by_call.get(base, 0) + calls
    dtoh = sum(int(_number(r.get("Count"))) for r in reports.get("cuda_gpu_mem_time_sum", [])
               if "Device-to-Host" in str(r.get("Operation", "")))
    return per_step(RuntimeSyncs(count, host_ns / 1e3, dtoh, by_call), steps)


def stats_syncs(nsys: str, sqlite_path, marker: str = MARKER,
                timeout_s: float = 300) -> tuple[RuntimeSyncs | None, str, str | None]:
    """(figures, the stats text, why there are none) from `nsys stats` on an export."""
    try:
        proc = subprocess.run(stats_command(nsys, sqlite_path), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, "", f"nsys stats failed: {exc}"
    text = proc.stdout + ("\n" + proc.stderr if proc.stderr else "")
    if proc.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        return None, text, f"nsys stats failed (exit {proc.returncode}): {tail}"
    try:
        return syncs_from_stats(parse_stats(proc.stdout), marker), text, None
    except ValueError as exc:
        return None, text, f"nsys stats: {exc}"
