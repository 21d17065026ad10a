"""`bench decode` / `bench prefill`: the drafter's whole step, paged against arena, on the GPU at hand.

A decode step (tuner.step.DecodeStep) is, for every layer, the store of the accepted rows (a fixed
Qb rows per request with a device-side valid count) followed by the drafter attention, captured in
a CUDA graph. A context step (bench.steps.ContextStep) stores a prompt chunk instead. Each
(step, impl, layout, page size, batch, context) is measured by tuner.measure (correctness against
the reference first, then graph replays: latency median/p10/p90, the attention and store split,
roofline and read floor, memory, host syncs) and written to the profile database at once. The
baselines (kernels.baselines: FlashInfer fa2 with its per-shape plan and with its CUDA-graph plan,
TensorRT-LLM's XQA), when installed and when they take the geometry, run beside (attention only:
one layer measured, times the layer count for the step).

`plan()` turns options into jobs (no GPU needed); `execute()` measures them with injectable
measure functions (the CPU tests pass fakes); `finish()` adds the paged-over-arena overhead and
the KV memory model of the configured concurrency and max context.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from drafter_attn.bench.options import BenchError
from drafter_attn.kernels import footprint as kvmem
from drafter_attn.kernels.tuned_table import sync_count

DECODE, CONTEXT = "decode", "context"
FALLBACK_IMPL = "cupy"


@dataclass(frozen=True)
class Job:
    step: str  # DECODE or CONTEXT
    chunk: int | None  # rows per request stored by a context step
    impl_option: str  # as given with --impl ("auto", "cupy", ...)
    layout: str  # "paged" or "arena"
    page: int | None
    batch: int
    ctx: int


@dataclass
class Plan:
    command: str  # "decode" or "prefill"
    geometry: object  # kernels.spec.Geometry
    label: str  # preset name, or "custom:<fields>"
    preset: str | None  # recorded in the database (None for a custom geometry)
    pages: list[int]
    batches: list[int]
    ctxs: list[int]
    impls: list[str]
    steps: list[tuple[str, int | None]]  # (DECODE, None) and/or (CONTEXT, chunk)
    accepted: float | None  # mean accepted tokens per request (user's figure)
    rows_stored: float | None  # rows a decode step stores per request: accepted + 1 (None: Qb)
    baselines: list[str]  # kernels.baselines names to run beside
    reps: int = 0
    nsys: bool = False
    concurrency: int | None = None  # None: each row's batch
    max_ctx: int | None = None  # None: largest context + the store's rows
    notes: list[str] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    interrupted: bool = False  # set by execute() on Ctrl-C: the rows so far are kept

    def baseline_jobs(self, sm: int | None = None) -> list[tuple[str, int, int, int]]:
        """(baseline, batch, ctx, page) for every page size each baseline takes."""
        from drafter_attn.kernels import baselines

        return [(name, b, c, s) for name in self.baselines for b in self.batches for c in self.ctxs
                for s in self.pages if baselines.reason(name, self.geometry, s, sm) is None]

    @property
    def total(self) -> int:
        """Rows a full run gives: the jobs and the baseline rows."""
        return len(self.jobs) + len(self.baseline_jobs())

    def settings(self) -> dict:
        """JSON-able description of what was asked."""
        return dict(command=self.command, preset=self.label, geometry=asdict(self.geometry),
                    pages=self.pages, batches=self.batches, ctxs=self.ctxs, impls=self.impls,
                    steps=[dict(step=s, chunk=c) for s, c in self.steps], accepted=self.accepted,
                    rows_stored=self.rows_stored, baselines=self.baselines, reps=self.reps,
                    nsys=self.nsys, concurrency=self.concurrency, max_ctx=self.max_ctx, notes=self.notes)


# ---------------------------------------------------------------------------------------------
# Planning (no GPU)


def rows_stored_for(accepted: float | None, block_size: int) -> float | None:
    """Rows a decode step stores per request: accepted tokens + 1 (the bonus token), at most Qb.
    None (no --accepted) stores all Qb rows, the worst case."""
    if accepted is None:
        return None
    if accepted < 0:
        raise BenchError(f"--accepted {accepted:g}: expected a non-negative mean of accepted tokens")
    if accepted + 1 > block_size:
        raise BenchError(f"--accepted {accepted:g}: a step stores accepted + 1 = {accepted + 1:g} rows per "
                         f"request, more than the block size Qb = {block_size}; use at most {block_size - 1}")
    return float(accepted) + 1


def baselines_wanted(option: str, geometry) -> tuple[list[str], list[str]]:
    """(baseline names to run, notes). `auto`: every baseline installed that takes the geometry;
    `flashinfer`: FlashInfer fa2 in both plans; a comma list of names (kernels.baselines.NAMES);
    `none`. A baseline named explicitly must be able to run (BenchError otherwise)."""
    from drafter_attn.kernels import baselines

    if option == "none":
        return [], []
    if option == "auto":
        names, notes = [], []
        for name in baselines.NAMES:
            why = baselines.reason(name, geometry, page_size=max(baselines.XQA_PAGE_SIZES))
            if why:
                notes.append(f"baseline {name}: {why}; no rows")
            else:
                names.append(name)
        return names, notes
    names = [baselines.FA2, baselines.FA2_GRAPH] if option == "flashinfer" else \
        [n.strip() for n in option.split(",") if n.strip()]
    for name in names:
        why = baselines.reason(name, geometry, page_size=max(baselines.XQA_PAGE_SIZES))
        if why:
            raise BenchError(f"--baseline {option}: {why}; or pass --baseline none")
    return names, []


def check_impls(impls: list[str]) -> list[str]:
    from drafter_attn.kernels import registry

    known = registry.names()
    for name in impls:
        if name != "auto" and name not in known:
            raise BenchError(f"--impl {name}: unknown implementation; known: auto, {', '.join(known)}")
    return list(dict.fromkeys(impls))


def plan(command: str, geometry, label: str, preset: str | None, *, pages, batches, ctxs, impls,
         accepted=None, context_chunks=(), decode=True, baseline="auto", reps=0, nsys=False,
         concurrency=None, max_ctx=None) -> Plan:
    """Validate the options and list the jobs. Raises BenchError with what to change."""
    impls = check_impls(impls)
    rows = rows_stored_for(accepted, geometry.block_size)
    steps = ([(DECODE, None)] if decode else []) + [(CONTEXT, c) for c in context_chunks]
    if not steps:
        raise BenchError("nothing to measure: no decode step and no context chunk")
    names, notes = baselines_wanted(baseline, geometry) if decode else ([], [])
    p = Plan(command, geometry, label, preset, list(pages), list(batches), list(ctxs), impls, steps,
             accepted, rows, names, reps, nsys, concurrency, max_ctx)
    p.notes.extend(notes)
    for step, chunk in steps:
        room = geometry.block_size if step == DECODE else chunk
        if max_ctx is not None and max(ctxs) + room > max_ctx:
            raise BenchError(f"--max-ctx {max_ctx}: the largest context {max(ctxs)} plus the {room} rows "
                             f"a {step} step stores do not fit; raise --max-ctx or lower --ctx")
    layouts = [("paged", s) for s in pages] + [("arena", None)]
    for step, chunk in steps:
        for impl in impls:
            for batch in batches:
                for ctx in ctxs:
                    for layout, page in layouts:
                        p.jobs.append(Job(step, chunk, impl, layout, page, batch, ctx))
    return p


# ---------------------------------------------------------------------------------------------
# Which implementation runs a problem


@dataclass(frozen=True)
class ImplPick:
    impl: str  # registry name
    params: dict  # full parameters (the backend's defaults, then the pick's)
    note: str  # how it was picked, for this problem (goes into the row)
    summary: str  # how it was picked, without per-problem detail (printed once per group)


def load_dispatcher(table=None):
    """(kernels.dispatch.Dispatcher, what it reads). The table is $DRAFTER_TUNED_TABLE when set,
    else `table` (bench passes its profile database); one that is missing or unusable gives the
    dispatcher's default heuristic."""
    from drafter_attn.kernels.dispatcher import CURRENT, Dispatcher

    source = os.environ.get("DRAFTER_TUNED_TABLE") or table
    if source is None or not Path(source).exists():
        return Dispatcher(), "kernels.dispatch, default heuristic" + (f" ({source} does not exist)" if source else "")
    try:
        # env=CURRENT: entries measured on another GPU or other kernel sources are misses
        return Dispatcher.load(source, env=CURRENT), f"kernels.dispatch over {source}"
    except Exception as exc:  # TableError: unreadable, foreign, another schema
        return Dispatcher(), f"kernels.dispatch, default heuristic ({source} unusable: {exc})"


def resolve_impl(option: str, problem, *, dispatcher=None, dispatcher_note: str = "", sm: int | None = None) -> ImplPick:
    """What runs `problem` for --impl `option`: a registry name as given, or for `auto` the
    pick of `dispatcher` (a kernels.dispatch.Dispatcher) on SM `sm`; cupy if the pick fails."""
    from drafter_attn.kernels import registry

    if option != "auto":
        impl, params, note, summary = option, {}, f"--impl {option}", f"--impl {option}"
    else:
        try:
            pick = dispatcher.pick(problem, sm)
            impl, params = pick.impl, dict(pick.params)
            note = f"auto: {dispatcher_note} picked {impl}, {pick.reason}"
            summary = f"auto: {dispatcher_note}, tier {pick.tier}"
        except Exception as exc:
            impl, params = FALLBACK_IMPL, {}
            note = summary = f"auto: kernels.dispatch failed ({type(exc).__name__}: {exc}); fell back to {FALLBACK_IMPL}"
    try:
        full = {**registry.get(impl).default_params(problem), **params}
    except Exception:  # unavailable here: the measurement reports it as a failure
        full = dict(params)
    return ImplPick(impl, full, note, summary)


# ---------------------------------------------------------------------------------------------
# Measuring


def default_measures():
    from drafter_attn.bench.steps import measure_context
    from drafter_attn.tuner.measure import measure_baseline, measure_candidate

    return measure_candidate, measure_context, measure_baseline


def execute(p: Plan, db, env: dict, *, measure=None, measure_context=None, measure_baseline=None,
            echo=print, sweep_id: str | None = None) -> list[dict]:
    """Measure every job of `p` (and the baseline), recording each result in `db` the moment it
    exists; returns the output rows (database columns plus step, label, impl_note, syncs)."""
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner.spec import Candidate
    from drafter_attn.tuner.sweep import result_row

    if measure is None or measure_context is None or measure_baseline is None:
        d_measure, d_context, d_base = default_measures()
        measure = measure or d_measure
        measure_context = measure_context or d_context
        measure_baseline = measure_baseline or d_base
    env_id = db.add_environment(env)
    sweep_id = sweep_id or f"bench-{p.command}-{dt.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    base_jobs = p.baseline_jobs(env.get("sm"))
    total = len(p.jobs) + len(base_jobs)
    rows = []
    dispatcher, dispatcher_note = (load_dispatcher(str(db.path)) if "auto" in p.impls else (None, ""))
    picks: dict[tuple, ImplPick] = {}
    counts: dict[tuple, int] = {}
    for job in p.jobs:
        problem = Problem(p.geometry, job.layout, job.page, job.batch, job.ctx)
        key = (job.impl_option, problem)
        if key not in picks:
            picks[key] = resolve_impl(job.impl_option, problem, dispatcher=dispatcher,
                                      dispatcher_note=dispatcher_note, sm=env.get("sm"))
        group = (job.impl_option, picks[key].impl, picks[key].summary)
        counts[group] = counts.get(group, 0) + 1
    for (option, impl, summary), count in counts.items():
        share = "" if count == sum(1 for j in p.jobs if j.impl_option == option) else f" for {count} steps"
        echo(f"impl picked: {impl}{share} ({summary})")
    try:
        for n, job in enumerate(p.jobs, 1):
            problem = Problem(p.geometry, job.layout, job.page, job.batch, job.ctx)
            pick = picks[(job.impl_option, problem)]
            impl, params, note = pick.impl, pick.params, pick.note
            stored = p.rows_stored if job.step == DECODE else float(job.chunk)
            cand = Candidate(problem, impl, tuple(sorted(params.items())), stored, p.preset)
            if job.step == DECODE:
                result = measure(cand.to_wire(), reps=p.reps, nsys=p.nsys)
            else:
                result = measure_context(cand.to_wire(), job.chunk, reps=p.reps)
            db.add_result(result_row(cand, result, env_id, sweep_id, "bench"))
            row = _output_row(p, job, cand, result, note)
            rows.append(row)
            echo(f"[{n}/{total}] {_describe(row)}")
        for n, (name, batch, ctx, page) in enumerate(base_jobs, len(p.jobs) + 1):
            g1 = p.geometry.with_(num_layers=1)
            cand = Candidate(Problem(g1, "paged", page, batch, ctx), name, (), None, p.preset)
            result = measure_baseline(name, p.geometry, page, batch, ctx, reps=p.reps)
            db.add_result(result_row(cand, baseline_db_result(result), env_id, sweep_id, "bench"))
            row = _baseline_row(p, cand, result)
            rows.append(row)
            echo(f"[{n}/{total}] {_describe(row)}")
    except KeyboardInterrupt:
        p.interrupted = True
        echo(f"interrupted: keeping the {len(rows)} rows measured so far")
    return finish(p, rows)


# The whole-step latency columns: a baseline has none (it runs one layer's attention, no store).
STEP_LATENCY = ("median_us", "p10_us", "p90_us", "mean_us", "min_us", "repeat_median_us")


def baseline_db_result(result: dict) -> dict:
    """A baseline's database columns: its time goes into attention_median_us/p10/p90 only, with
    median_us (the step latency, which kernels.dispatch and tuner export rank by) left NULL, so a
    one-layer attention-only row can never outrank a whole step of a registry backend."""
    row = {k: v for k, v in result.items() if k not in STEP_LATENCY}
    if row.get("status") == "ok":
        row["reason"] = "baseline: one layer's attention only (attention_* columns); no step latency"
    return row


_SCALED = ("median_us", "p10_us", "p90_us", "mean_us", "min_us", "repeat_median_us",
           "attention_median_us", "attention_p10_us", "attention_p90_us", "bytes_moved", "kv_bytes",
           "read_floor_us")


def _output_row(p: Plan, job: Job, cand, result: dict, note: str) -> dict:
    row = dict(step=job.step, chunk=job.chunk, preset=p.label, impl_option=job.impl_option,
               impl=cand.impl, params=json.dumps(cand.params_dict, sort_keys=True), impl_note=note,
               layout=job.layout, page_size=job.page, batch=job.batch, ctx=job.ctx,
               accepted=p.accepted if job.step == DECODE else None, rows_stored=cand.accepted,
               layers=p.geometry.num_layers, scope="step")
    row.update(result)
    row["syncs"] = sync_count(row)
    return row


def _baseline_row(p: Plan, cand, result: dict) -> dict:
    """The baseline in step terms: one layer's attention times the layer count (no store)."""
    L = p.geometry.num_layers
    pr = cand.problem
    row = dict(step=DECODE, chunk=None, preset=p.label, impl_option=cand.impl, impl=cand.impl,
               params=json.dumps(cand.params_dict, sort_keys=True),
               impl_note=f"baseline: attention only, 1 layer measured x {L} layers, no store",
               layout="paged", page_size=pr.page_size, batch=pr.batch, ctx=pr.ctx_len, accepted=None,
               rows_stored=None, layers=L, scope=f"attention x{L}")
    row.update(result)
    for k in _SCALED:
        if row.get(k) is not None:
            row[k] = row[k] * L
    row["syncs"] = sync_count(row)
    return row


def _describe(row: dict) -> str:
    layout = f"paged p{row['page_size']}" if row["layout"] == "paged" else "arena"
    step = row["step"] + (f"(chunk {row['chunk']})" if row.get("chunk") else "")
    what = f"{step} {row['impl']} {layout} B={row['batch']} ctx={row['ctx']}"
    if row.get("status") == "ok":
        return f"{what}: {row['median_us']:.1f} us, syncs {row.get('syncs')}"
    return f"{what}: {row.get('status')}: {str(row.get('reason') or '').splitlines()[0][:160] if row.get('reason') else ''}"


def finish(p: Plan, rows: list[dict]) -> list[dict]:
    """Add the paged-over-arena overhead (percent, same step/impl/batch/ctx) and the KV memory
    model of the configured concurrency and max context to every row."""
    from drafter_attn.kernels import baselines

    arena = {(r["step"], r["chunk"], r["impl_option"], r["batch"], r["ctx"]): r["median_us"]
             for r in rows if r["layout"] == "arena" and r.get("status") == "ok"}
    for r in rows:
        r["overhead_pct"] = None
        if r["layout"] == "paged" and r.get("status") == "ok" and not baselines.is_baseline(r["impl"]):
            a = arena.get((r["step"], r["chunk"], r["impl_option"], r["batch"], r["ctx"]))
            if a:
                r["overhead_pct"] = (r["median_us"] / a - 1) * 100
        room = p.geometry.block_size if r["step"] == DECODE else r["chunk"]
        conc = p.concurrency or r["batch"]
        max_ctx = p.max_ctx or max(p.ctxs) + room
        page = r["page_size"] or 16  # the arena's figure does not depend on it
        fp = kvmem.footprint(p.geometry, conc, r["ctx"], page, max_ctx, store_rows=room)
        r.update(kv_concurrency=conc, kv_max_ctx=max_ctx, kv_arena_model_bytes=fp.arena_bytes,
                 kv_model_bytes=fp.paged_bytes if r["layout"] == "paged" else fp.arena_bytes,
                 kv_arena_over_paged=fp.arena_over_paged if r["layout"] == "paged" else None)
    return rows


# ---------------------------------------------------------------------------------------------
# Environment and where results go


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("-dirty" if dirty else "")) if sha else "unknown"


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["bench", *args])


def gpu_environment(gpu) -> dict:
    """The profile database's environment fingerprint of the GPU measured on."""
    from drafter_attn.tuner.env import fingerprint

    return fingerprint(gpu.index)


def run_metadata(env: dict, argv) -> dict:
    """What the JSON carries besides the rows: environment, commit, command line, host, time."""
    meta = dict(env)
    meta.update(commit=git_commit(), command=command_line(argv), host=platform.node(),
                python=platform.python_version(),
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    try:
        import torch

        if torch.cuda.is_available():
            from drafter_attn.tuner import roofline

            meta["copy_bandwidth_gbs"] = roofline.copy_bandwidth() / 1e9
    except Exception:
        pass
    return meta


def results_dir(sm: int, root: str | Path = "results", date: dt.date | None = None) -> Path:
    """results/sm<SM>-<YYYY-MM-DD>/"""
    date = date or dt.date.today()
    return Path(root) / f"sm{sm}-{date:%Y-%m-%d}"


def failed(rows: list[dict]) -> list[dict]:
    return [r for r in rows if str(r.get("status", "")).startswith("failed")]


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per (step, impl, page): the median paged-over-arena overhead across rows."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("overhead_pct") is not None:
            groups.setdefault((r["step"], r["chunk"], r["impl_option"], r["page_size"]), []).append(r["overhead_pct"])
    out = []
    for (step, chunk, impl, page), vals in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                                                   kv[0][2], kv[0][3])):
        vals.sort()
        med = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
        tag = step + (f" chunk {chunk}" if chunk else "")
        out.append(f"{tag} {impl} page {page}: paged over arena median {med:+.2f}% "
                   f"(min {vals[0]:+.2f}%, max {vals[-1]:+.2f}%, {len(vals)} rows)")
    return out

