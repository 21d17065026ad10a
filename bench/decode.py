"""`bench decode` / `bench prefill`: the drafter's whole step, paged against arena, on the GPU at hand.

A decode step (tuner.step.DecodeStep) is, for every layer, the store of the accepted rows (a fixed
Qb rows per request with a device-side valid count) followed by the drafter attention, captured in
a CUDA graph. A context step (bench.steps.ContextStep) stores a prompt chunk instead. Each
(step, impl, layout, page size, batch, context) is measured by tuner.measure (correctness against
the reference first, then graph replays: latency median/p10/p90, the attention and store split,
roofline and read floor, memory, host syncs) and written to the profile database at once. The
baselines (kernels.baselines: FlashInfer fa2 with its per-shape plan and with its CUDA-graph plan,
TensorRT-LLM's XQA), when installed and when they take the geometry, run beside (attention only:
every layer's, back to back in one captured call, as the step runs its layers). Each row also
reaches `on_row` (the CLI's CSV) the moment it is measured.

`--table-capacity N` adds, for every paged row, the same step with the block table sized for N
tokens (an engine sizes it for the model's longest context; the pool still holds only the pages
needed), without and with the host-side `max_ctx` hint (`--max-ctx-hint`): the first shows what
the table's width costs, the second what the hint recovers (`over_fitted_pct`). Those rows are
not recorded into the profile database: its problem key has no table width, and they would stand
for the fitted table's rows in `tuner export`, `kernels.dispatch` and a sweep's resume.

`plan()` turns options into jobs (no GPU needed); `check_memory()` refuses a job whose tensors
would not fit the GPU (tuner.memory.measurement_bytes) before anything is measured; `execute()`
measures them with injectable measure functions (the CPU tests pass fakes); `finish()` adds the
paged-over-arena overhead, the cost over the fitted table and the KV memory model of the
configured concurrency and max context.
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
from drafter_attn.kernels import contract
from drafter_attn.kernels import footprint as kvmem
from drafter_attn.kernels.tuned_table import SUSTAIN_S, sync_count
from drafter_attn.tuner import memory as step_memory
from drafter_attn.tuner.cli_checks import load_without_sustain

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
    table: int | None = None  # tokens the block table addresses (None: fitted to the context)
    hint: bool = False  # the attention gets the host-side max_ctx hint

    @property
    def step_options(self) -> dict:
        """What the measurement passes to its step (tuner.step.DecodeStep); empty for the
        plain step, so measure functions without these options still serve it."""
        out = {}
        if self.table is not None:
            out["table_capacity"] = self.table
        if self.hint:
            out["max_ctx_hint"] = True
        return out

    @property
    def recorded(self) -> bool:
        """Whether the row goes into the profile database (a wide table's rows do not)."""
        return self.table is None


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
    table_capacities: list[int] = field(default_factory=list)  # --table-capacity (tokens)
    max_ctx_hint: str = "off"  # --max-ctx-hint: on, off or both
    regime: str = "burst"  # --regime: the table `auto` picks from (kernels.tuned_table.REGIMES)
    sustain_s: float = 0.0  # each timing after this long of the step's own back-to-back load
    sustain_load: str = "self"  # or a co-runner's (kernels.tuned_table.SUSTAIN_LOADS)
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
                    nsys=self.nsys, concurrency=self.concurrency, max_ctx=self.max_ctx,
                    table_capacities=self.table_capacities, max_ctx_hint=self.max_ctx_hint,
                    notes=self.notes)


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


def split_impls(text: str) -> list[str]:
    """--impl's items: names or backend specs (`cupy:tile_n=32,stages=4`), separated by commas
    (a `key=value` item belongs to the spec before it: names hold no "=") or by semicolons."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(";" if ";" in text else ",")):
        if not part:
            continue
        if out and "=" in part and ":" not in part and ";" not in text:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def check_impls(impls: list[str]) -> list[str]:
    """`impls` checked: `auto`, registry names, or specs of known backends with parameters they
    take (BenchError naming the first that is not)."""
    from drafter_attn.kernels import registry

    known = registry.names()
    for spec in impls:
        if spec == "auto":
            continue
        try:
            name, params = registry.parse_spec(spec)
        except ValueError as exc:
            raise BenchError(f"--impl {spec}: {exc}") from None
        if name not in known:
            raise BenchError(f"--impl {spec}: unknown implementation {name!r}; known: auto, "
                             f"{', '.join(known)} (each optionally with parameters, e.g. "
                             f"cupy:tile_n=32,stages=4)")
        if params:
            try:
                registry.check_params(registry.get(name), params)
            except registry.BackendUnavailable:
                pass  # measured as a failure, with the reason, where it cannot be built
            except (ValueError, TypeError) as exc:
                raise BenchError(f"--impl {spec}: {exc}") from None
    return list(dict.fromkeys(impls))


# Context lengths are int32 on the device, and a position plus the stored rows (and a tile of
# keys) must stay one: the contract's limit.
MAX_TOKENS = contract.MAX_CAPACITY
HINT_CHOICES = ("on", "off", "both")


def table_variants(table_capacities, max_ctx_hint: str | None) -> tuple[str, list[tuple[int | None, bool]]]:
    """(the --max-ctx-hint in effect, the (table capacity, hint) variants of each paged row).
    The fitted table comes first, hinted only with `on`; each wide table follows without the
    hint, with it, or both (the default when a table capacity is given)."""
    option = max_ctx_hint or ("both" if table_capacities else "off")
    if option not in HINT_CHOICES:
        raise BenchError(f"--max-ctx-hint {option}: expected one of {', '.join(HINT_CHOICES)}")
    hints = {"on": [True], "off": [False], "both": [False, True]}[option]
    variants = [(None, option == "on")] + [(t, h) for t in table_capacities for h in hints]
    return option, variants


def plan(command: str, geometry, label: str, preset: str | None, *, pages, batches, ctxs, impls,
         accepted=None, context_chunks=(), decode=True, baseline="auto", reps=0, nsys=False,
         concurrency=None, max_ctx=None, table_capacities=(), max_ctx_hint=None, regime="burst",
         sustain_s=None, sustain_load="self") -> Plan:
    """Validate the options and list the jobs. Raises BenchError with what to change. `regime`
    "sustained": `auto` picks from that regime's table, and each timing follows `sustain_s`
    seconds of load (default SUSTAIN_S there, 0 in a burst): the step's own, or with
    `sustain_load` "gemm" a co-runner's, which then also runs before every timed replay."""
    impls = check_impls(impls)
    rows = rows_stored_for(accepted, geometry.block_size)
    steps = ([(DECODE, None)] if decode else []) + [(CONTEXT, c) for c in context_chunks]
    if not steps:
        raise BenchError("nothing to measure: no decode step and no context chunk")
    names, notes = baselines_wanted(baseline, geometry) if decode else ([], [])
    hint_option, variants = table_variants(list(table_capacities), max_ctx_hint)
    if sustain_s is None:
        sustain_s = SUSTAIN_S if regime == "sustained" else 0.0
    problem = load_without_sustain(sustain_load, sustain_s)
    if problem:
        raise BenchError(f"{problem} or --regime sustained (it needs a sustained timing)")
    p = Plan(command, geometry, label, preset, list(pages), list(batches), list(ctxs), impls, steps,
             accepted, rows, names, reps, nsys, concurrency, max_ctx, list(table_capacities), hint_option,
             regime, float(sustain_s), sustain_load)
    p.notes.extend(notes)
    if p.sustain_s and sustain_load == "self":
        p.notes.append(f"each timing after {p.sustain_s:g} s of its step's own back-to-back load")
    elif p.sustain_s:
        p.notes.append(f"each timing after {p.sustain_s:g} s of a co-runner's load ({sustain_load}), "
                       "which also runs before every timed replay")
    if regime != "burst":
        p.notes.append(f"auto picks from the {regime} regime's table")
    from drafter_attn.kernels import registry

    for impl in impls:
        why = impl != "auto" and registry.reference_only(registry.parse_spec(impl)[0])
        if why:
            p.notes.append(f"{impl}: {why}; timed eagerly (no CUDA graph)")
    for step, chunk in steps:
        room = geometry.block_size if step == DECODE else chunk
        if max_ctx is not None and max(ctxs) + room > max_ctx:
            raise BenchError(f"--max-ctx {max_ctx}: the largest context {max(ctxs)} plus the {room} rows "
                             f"a {step} step stores do not fit; raise --max-ctx or lower --ctx")
        if max(ctxs) + room > MAX_TOKENS:
            raise BenchError(f"--ctx {max(ctxs)}: plus the {room} rows a {step} step stores it passes "
                             f"{MAX_TOKENS} tokens, the int32 context lengths of the kernels")
        for cap in table_capacities:
            if max(ctxs) + room > cap:
                raise BenchError(f"--table-capacity {cap}: the largest context {max(ctxs)} plus the {room} "
                                 f"rows a {step} step stores do not fit a table that wide; raise "
                                 f"--table-capacity or lower --ctx")
            if cap > MAX_TOKENS:
                raise BenchError(f"--table-capacity {cap}: more than {MAX_TOKENS} tokens, the int32 "
                                 f"context lengths of the kernels")
    if table_capacities:
        p.notes.append("rows with --table-capacity tables are not recorded into the profile database "
                       "(its problem key has no table width; they would stand for the fitted table's rows)")
    layouts = [("paged", s, t, h) for s in pages for t, h in variants] + [("arena", None, None, False)]
    for step, chunk in steps:
        for impl in impls:
            for batch in batches:
                for ctx in ctxs:
                    for layout, page, table, hint in layouts:
                        p.jobs.append(Job(step, chunk, impl, layout, page, batch, ctx, table, hint))
    return p


def job_bytes(p: Plan, job: Job) -> int:
    """GPU bytes one job's measurement needs at its peak (tuner.memory.measurement_bytes)."""
    room = p.geometry.block_size if job.step == DECODE else job.chunk
    return step_memory.measurement_bytes(p.geometry, job.layout, job.page, job.batch, job.ctx, room, job.table)


def check_memory(p: Plan, gpu_bytes: int, sm: int | None = None) -> None:
    """BenchError (before anything is measured) when a job or baseline row would not fit
    `gpu_bytes` of GPU memory, naming the largest and what to lower."""
    need = [(job_bytes(p, j), f"{j.step} {j.layout}" + (f" page {j.page}" if j.page else "")
             + (f" table {j.table}" if j.table else "") + f" B={j.batch} ctx={j.ctx}") for j in p.jobs]
    need += [(step_memory.baseline_bytes(p.geometry, page, b, c, layers=p.geometry.num_layers),
              f"baseline {name} page {page} B={b} ctx={c}")
             for name, b, c, page in p.baseline_jobs(sm)]
    if not need:
        return
    worst, what = max(need)
    usable = int(gpu_bytes * step_memory.USABLE_FRACTION)
    if worst > usable:
        n = sum(1 for b, _ in need if b > usable)
        raise BenchError(
            f"bench {p.command}: {what} needs about {kvmem.fmt_bytes(worst)} of GPU memory (its "
            f"{p.geometry.num_layers} layers' K/V, the correctness check's copy of one layer and "
            f"the read floor's buffer of the step's bytes), more than the {kvmem.fmt_bytes(usable)} "
            f"usable of this GPU's {kvmem.fmt_bytes(gpu_bytes)}; {n} of {len(need)} rows do not "
            f"fit. Lower --batch, --ctx or --layers (e.g. --layers 1), or --table-capacity")


# ---------------------------------------------------------------------------------------------
# Which implementation runs a problem


@dataclass(frozen=True)
class ImplPick:
    impl: str  # registry name
    params: dict  # full parameters (the backend's defaults, then the pick's)
    note: str  # how it was picked, for this problem (goes into the row)
    summary: str  # how it was picked, without per-problem detail (printed once per group)


def load_dispatcher(table=None, sm: int | None = None, regime: str = "burst"):
    """(kernels.dispatch.Dispatcher, what it reads): $DRAFTER_TUNED_TABLE when set, else `table`
    (the profile database bench was given with --db), else what kernels.Runtime reads on SM `sm`
    in `regime` ($DRAFTER_DB, else the table or database shipped for that SM and regime). One
    that is missing or unusable gives the dispatcher's default heuristic."""
    from drafter_attn.kernels.dispatcher import CURRENT, Dispatcher
    from drafter_attn.kernels.shipped import find_default

    source = os.environ.get("DRAFTER_TUNED_TABLE") or table or find_default(sm, regime=regime)
    source = str(source) if source else None
    if source is None or not Path(source).exists():
        return Dispatcher(), "kernels.dispatch, default heuristic" + (f" ({source} does not exist)" if source else "")
    try:
        # env=CURRENT: entries measured on another GPU or other kernel sources are misses
        return (Dispatcher.load(source, env=CURRENT, regime=regime),
                f"kernels.dispatch over {source}" + (f" ({regime} regime)" if regime != "burst" else ""))
    except Exception as exc:  # TableError: unreadable, foreign, another schema
        return Dispatcher(), f"kernels.dispatch, default heuristic ({source} unusable: {exc})"


def resolve_impl(option: str, problem, *, dispatcher=None, dispatcher_note: str = "", sm: int | None = None) -> ImplPick:
    """What runs `problem` for --impl `option`: a registry name as given, or for `auto` the
    pick of `dispatcher` (a kernels.dispatch.Dispatcher) on SM `sm`; cupy if the pick fails."""
    from drafter_attn.kernels import registry

    if option != "auto":
        (impl, params), note, summary = registry.parse_spec(option), f"--impl {option}", f"--impl {option}"
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
        full = registry.resolve_params(registry.get(impl), problem, sm, params)
    except Exception:  # unavailable here: the measurement reports it as a failure
        full = dict(params)
    return ImplPick(impl, full, note, summary)


# ---------------------------------------------------------------------------------------------
# Measuring


def default_floor():
    """The read floor `execute` times first (tuner.floors.read_floor: cached per size, so each
    step's measurement reuses it)."""
    from drafter_attn.tuner import floors

    return floors.read_floor


def floor_sizes(p: Plan, sm: int | None = None) -> list[int]:
    """The roofline bytes of every decode job's step, then of every baseline row, each size
    once: the read floors `execute` times before any kernel runs (context steps time theirs as
    they go)."""
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner.roofline import call_bytes
    from drafter_attn.tuner.step import decode_bytes

    sizes = {decode_bytes(Problem(p.geometry, j.layout, j.page, j.batch, j.ctx), p.rows_stored): None
             for j in p.jobs if j.step == DECODE}
    sizes.update({p.geometry.num_layers * call_bytes(p.geometry, b, c, page): None
                  for _, b, c, page in p.baseline_jobs(sm)})
    return list(sizes)


def default_measures():
    from drafter_attn.bench.steps import measure_context
    from drafter_attn.tuner.measure import measure_baseline, measure_candidate

    return measure_candidate, measure_context, measure_baseline


def require_nsys(find=None) -> str:
    """The line saying which nsys `--syncs all` runs; BenchError (exit 2) when none is found or
    it cannot import its captures (the note names the missing library)."""
    from drafter_attn.tuner import nsys as nsys_tool

    install = (find or nsys_tool.find_nsys)()
    if install.path is None:
        raise BenchError(f"--syncs all needs Nsight Systems, and nsys was not found "
                         f"({'; '.join(install.searched) or 'nowhere searched'}); nothing was "
                         f"measured: install it, or use --syncs fast")
    if not install.usable:
        raise BenchError(f"--syncs all: {install.note}")
    return (f"nsys layer: {install.path}" + (f" ({install.version})" if install.version else "")
            + f", found via {install.found_via}; only the timed steps are captured (cudaProfilerStart/Stop)")


def sync_lines(rows: list[dict]) -> list[str]:
    """Per row whose step syncs, or where Nsight Systems ran: the blocking syncs per step and the
    host time blocked from every layer side by side, and whether the layers agree."""
    out = []
    for r in rows:
        if r.get("status") != "ok" or not (r.get("syncs") or r.get("syncs_nsys") is not None):
            continue
        layers = {"sync-debug": r.get("syncs_debug"), "profiler": r.get("syncs_profiler"), "nsys": r.get("syncs_nsys")}
        ran = {k: v for k, v in layers.items() if v is not None}
        agree = "agree" if len(set(ran.values())) == 1 else "DISAGREE"
        blocked = ", ".join(f"{name} {r[key]:.1f} us" for name, key in (("profiler", "sync_host_us"), ("nsys", "sync_host_us_nsys"))
                            if isinstance(r.get(key), (int, float)))
        layout = f"paged {r['page_size']}" if r["layout"] == "paged" else "arena"
        out.append(f"syncs per step, {r['impl']} {layout} B={r['batch']} ctx={r['ctx']}: "
                   + ", ".join(f"{k} {v}" for k, v in layers.items() if v is not None)
                   + f" ({agree}); host blocked per step: {blocked or 'not measured'}")
    return out


def execute(p: Plan, db, env: dict, *, measure=None, measure_context=None, measure_baseline=None,
            read_floor=None, echo=print, sweep_id: str | None = None, table=None,
            on_row=None) -> list[dict]:
    """Measure every job of `p` (and the baseline), recording each result in `db` the moment it
    exists, and handing the rows so far to `on_row(rows)` (the CLI's partial CSV: a row that is
    not recorded, a --table-capacity one, is kept there); returns the output rows (database
    columns plus step, label, impl_note, syncs).
    `--impl auto` picks from `table` (a tuned table or database; see load_dispatcher).
    `read_floor(nbytes)` (default `default_floor()`) is called for every decode step's and
    baseline row's bytes before the first measurement (`floor_sizes`)."""
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
    dispatcher, dispatcher_note = (load_dispatcher(table, env.get("sm"), p.regime) if "auto" in p.impls
                                   else (None, ""))
    picks: dict[tuple, ImplPick] = {}
    counts: dict[tuple, int] = {}
    for job in p.jobs:
        problem = _pick_problem(p, job)
        key = (job.impl_option, problem)
        if key not in picks:
            picks[key] = resolve_impl(job.impl_option, problem, dispatcher=dispatcher,
                                      dispatcher_note=dispatcher_note, sm=env.get("sm"))
        group = (job.impl_option, picks[key].impl, picks[key].summary)
        counts[group] = counts.get(group, 0) + 1
    for (option, impl, summary), count in counts.items():
        share = "" if count == sum(1 for j in p.jobs if j.impl_option == option) else f" for {count} steps"
        echo(f"impl picked: {impl}{share} ({summary})")
    # every step's and baseline's read floor before anything is measured (floors.time_first);
    # each measurement then takes its floor from the cache
    sizes = floor_sizes(p, env.get("sm"))
    if sizes:
        from drafter_attn.tuner import floors

        echo(f"timing the read floor of {len(sizes)} size(s) first")
        floors.time_first(sizes, echo, read_floor or default_floor())
    try:
        for n, job in enumerate(p.jobs, 1):
            problem = Problem(p.geometry, job.layout, job.page, job.batch, job.ctx)
            pick = picks[(job.impl_option, _pick_problem(p, job))]
            impl, params, note = pick.impl, pick.params, pick.note
            stored = p.rows_stored if job.step == DECODE else float(job.chunk)
            cand = Candidate(problem, impl, tuple(sorted(params.items())), stored,
                             p.preset).sustained(p.sustain_s, p.sustain_load)
            if job.step == DECODE:
                result = measure(cand.to_wire(), reps=p.reps, nsys=p.nsys, **job.step_options)
            else:
                result = measure_context(cand.to_wire(), job.chunk, reps=p.reps, **job.step_options)
            if job.recorded:
                db.add_result(result_row(cand, result, env_id, sweep_id, "bench"))
            row = _output_row(p, job, cand, result, note)
            rows.append(row)
            echo(f"[{n}/{total}] {_describe(row)}")
            if on_row is not None:
                on_row(rows)
        for n, (name, batch, ctx, page) in enumerate(base_jobs, len(p.jobs) + 1):
            cand = Candidate(Problem(p.geometry, "paged", page, batch, ctx), name, (), None,
                             p.preset).sustained(p.sustain_s, p.sustain_load)
            result = measure_baseline(name, p.geometry, page, batch, ctx, layers=p.geometry.num_layers,
                                      reps=p.reps, sustain_s=p.sustain_s, sustain_load=p.sustain_load)
            db.add_result(result_row(cand, baseline_db_result(result), env_id, sweep_id, "bench"))
            row = _baseline_row(p, cand, result)
            rows.append(row)
            echo(f"[{n}/{total}] {_describe(row)}")
            if on_row is not None:
                on_row(rows)
    except KeyboardInterrupt:
        p.interrupted = True
        echo(f"interrupted: keeping the {len(rows)} rows measured so far")
    return finish(p, rows)


def _pick_problem(p: Plan, job: Job):
    """The problem `--impl auto` picks for: the job's own, except that a wide table without the
    hint is picked at the table's capacity, as kernels.dispatch.Runtime picks for an engine that
    passes no hint (with the hint it picks from the real length, as for a fitted table)."""
    from drafter_attn.kernels.spec import Problem

    ctx = job.table if job.table is not None and not job.hint else job.ctx
    return Problem(p.geometry, job.layout, job.page, job.batch, ctx)


# The whole-step latency columns: a baseline has none (it runs the layers' attention, no store).
STEP_LATENCY = ("median_us", "p10_us", "p90_us", "mean_us", "min_us", "repeat_median_us")


def baseline_db_result(result: dict) -> dict:
    """A baseline's database columns: its time goes into attention_median_us/p10/p90 only, with
    median_us (the step latency, which kernels.dispatch and tuner export rank by) left NULL, so an
    attention-only row can never outrank a whole step of a registry backend."""
    row = {k: v for k, v in result.items() if k not in STEP_LATENCY}
    if row.get("status") == "ok":
        row["reason"] = "baseline: the layers' attention only (attention_* columns); no step latency"
    return row


def _output_row(p: Plan, job: Job, cand, result: dict, note: str) -> dict:
    row = dict(step=job.step, chunk=job.chunk, preset=p.label, impl_option=job.impl_option,
               impl=cand.impl, params=json.dumps(cand.params_dict, sort_keys=True), impl_note=note,
               layout=job.layout, page_size=job.page, batch=job.batch, ctx=job.ctx,
               table_capacity=job.table, max_ctx_hint=job.hint,
               accepted=p.accepted if job.step == DECODE else None, rows_stored=cand.accepted,
               layers=p.geometry.num_layers, scope="step")
    row.update(result)
    row["syncs"] = sync_count(row)
    return row


def _baseline_row(p: Plan, cand, result: dict) -> dict:
    """The baseline in step terms: every layer's attention in one call (no store)."""
    L = p.geometry.num_layers
    pr = cand.problem
    row = dict(step=DECODE, chunk=None, preset=p.label, impl_option=cand.impl, impl=cand.impl,
               params=json.dumps(cand.params_dict, sort_keys=True),
               impl_note=f"baseline: attention only, {L} layers in one graph (one plan), no store",
               layout="paged", page_size=pr.page_size, batch=pr.batch, ctx=pr.ctx_len, accepted=None,
               rows_stored=None, layers=L, scope=baseline_scope(L))
    row.update(result)
    row["syncs"] = sync_count(row)
    return row


def baseline_scope(layers: int) -> str:
    """What a baseline row's time covers: the attention of `layers` layers, no store."""
    return f"attention, {layers} layer{'s' if layers != 1 else ''}"


def _describe(row: dict) -> str:
    layout = f"paged p{row['page_size']}" if row["layout"] == "paged" else "arena"
    if row.get("table_capacity"):
        layout += f" table {row['table_capacity']}"
    if row.get("max_ctx_hint"):
        layout += " +hint"
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
    fitted = {(r["step"], r["chunk"], r["impl_option"], r["page_size"], r["batch"], r["ctx"]): r["median_us"]
              for r in rows if r["layout"] == "paged" and r.get("status") == "ok"
              and not r.get("table_capacity") and not baselines.is_baseline(r["impl"])}
    for r in rows:
        r["overhead_pct"] = r["over_fitted_pct"] = None
        if r["layout"] == "paged" and r.get("status") == "ok" and not baselines.is_baseline(r["impl"]):
            a = arena.get((r["step"], r["chunk"], r["impl_option"], r["batch"], r["ctx"]))
            if a:
                r["overhead_pct"] = (r["median_us"] / a - 1) * 100
            f = fitted.get((r["step"], r["chunk"], r["impl_option"], r["page_size"], r["batch"], r["ctx"]))
            if f and r.get("table_capacity"):
                r["over_fitted_pct"] = (r["median_us"] / f - 1) * 100
        room = p.geometry.block_size if r["step"] == DECODE else r["chunk"]
        conc = p.concurrency or r["batch"]
        max_ctx = p.max_ctx or max(p.ctxs) + room
        page = r["page_size"] or 16  # the arena's figure does not depend on it
        fp = kvmem.footprint(p.geometry, conc, r["ctx"], page, max_ctx, store_rows=room)
        paged = fp.paged_bytes
        if r.get("table_capacity"):  # the same pages, the block table as wide as asked
            paged += kvmem.block_table_bytes(conc, r["table_capacity"], page) - fp.table_bytes
        r.update(kv_concurrency=conc, kv_max_ctx=max_ctx, kv_arena_model_bytes=fp.arena_bytes,
                 kv_model_bytes=paged if r["layout"] == "paged" else fp.arena_bytes,
                 kv_arena_over_paged=fp.arena_bytes / paged if r["layout"] == "paged" else None)
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


def _median(vals: list[float]) -> float:
    vals = sorted(vals)
    return vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per (step, impl, page) of fitted tables: the median paged-over-arena overhead
    across rows; then one per wide table (and hint): the median cost over the fitted table."""
    groups: dict[tuple, list[float]] = {}
    wide: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("table_capacity"):
            if r.get("over_fitted_pct") is not None:
                wide.setdefault((r["step"], r["chunk"], r["impl_option"], r["page_size"], r["table_capacity"],
                                 bool(r.get("max_ctx_hint"))), []).append(r["over_fitted_pct"])
        elif r.get("overhead_pct") is not None:
            groups.setdefault((r["step"], r["chunk"], r["impl_option"], r["page_size"]), []).append(r["overhead_pct"])
    out = []
    for (step, chunk, impl, page), vals in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0,
                                                                                   kv[0][2], kv[0][3])):
        vals.sort()
        tag = step + (f" chunk {chunk}" if chunk else "")
        out.append(f"{tag} {impl} page {page}: paged over arena median {_median(vals):+.3f}% "
                   f"(min {vals[0]:+.3f}%, max {vals[-1]:+.3f}%, {len(vals)} rows)")
    for (step, chunk, impl, page, table, hint), vals in sorted(wide.items(), key=lambda kv: (
            kv[0][0], kv[0][1] or 0, kv[0][2], kv[0][3], kv[0][4], kv[0][5])):
        vals.sort()
        tag = step + (f" chunk {chunk}" if chunk else "")
        how = "with the max_ctx hint" if hint else "without a hint"
        out.append(f"{tag} {impl} page {page}: block table of {table} tokens, {how}: over the fitted "
                   f"table median {_median(vals):+.2f}% (min {vals[0]:+.2f}%, max {vals[-1]:+.2f}%, "
                   f"{len(vals)} rows)")
    return out

