"""Measure one candidate on this process's GPU: correctness first, then latency (whole step and
its attention / store halves), roofline, memory and host-sync stalls -> one database row's values.

`measure_candidate` is what a sweep worker runs; it never raises: a failure becomes a status
(failed_compile, failed_runtime, failed_correctness, unsupported) with its reason.
"""

from __future__ import annotations

import functools
import time
import traceback

# Timed work per timing (replays x step length) when the spec leaves reps automatic.
REPS_BUDGET_S = 0.25
MIN_REPS, MAX_REPS = 30, 400
# The L2 is flushed before each replay when the step's bytes are below this many L2 sizes (a
# larger working set evicts itself; flushing it only costs time).
FLUSH_BELOW_L2_MULTIPLE = 4


# The status of a diagnostic variant (the loads alone, or the math alone): timed for the limiter, but
# its output is not attention, so no table or dispatcher may ever pick it.
DIAGNOSTIC_REASON = ("diagnostic variant (skip_compute: loads only, or skip_loads: math only; the output "
                     "is not attention); timed, never ok")


def choose_reps(step_us: float, budget_s: float = REPS_BUDGET_S, lo: int = MIN_REPS,
                hi: int = MAX_REPS) -> int:
    """Replays for about `budget_s` of timed work, within [lo, hi]."""
    if step_us <= 0:
        return hi
    return max(lo, min(hi, int(budget_s * 1e6 / step_us)))


def roofline_row(median_us: float, nbytes: int, copy_bytes_per_s: float) -> dict:
    """Achieved bandwidth of a step that moves `nbytes` in `median_us`, and its fraction of the
    copy bandwidth measured on the same GPU (1.0 = at the memory roofline)."""
    achieved = nbytes / (median_us * 1e-6)
    return dict(bytes_moved=nbytes, bandwidth_gbs=achieved / 1e9, copy_bandwidth_gbs=copy_bytes_per_s / 1e9,
                roofline_fraction=achieved / copy_bytes_per_s)


def _needs_flush(nbytes: int) -> bool:
    import torch

    return nbytes < FLUSH_BELOW_L2_MULTIPLE * _l2_bytes(torch.cuda.current_device())


@functools.cache
def _l2_bytes(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).L2_cache_size or (60 << 20)


def _timer(fn, eager: bool, load=None):
    """time(reps, warmup, cold_l2, sustain_s) of `fn`: graph replays (captured once here), or
    eager calls; `sustain_s` of back-to-back calls before the timing (timing.sustain), or of
    the co-runner `load` (timing.co_load), which then also runs before every timed call."""
    from drafter_attn.tuner import timing

    if eager:
        return lambda reps, warmup=3, cold_l2=True, sustain_s=0.0: timing.time_eager(
            fn, reps=reps, warmup=warmup, cold_l2=cold_l2, sustain_s=sustain_s, load=load)
    graph = timing.capture(fn)
    return lambda reps, warmup=10, cold_l2=True, sustain_s=0.0: timing.time_graph(
        graph, reps=reps, warmup=warmup, cold_l2=cold_l2, sustain_s=sustain_s, load=load)


def time_fn(fn, nbytes: int, reps: int = 0, eager: bool = False, sustain_s: float = 0.0,
            sustain_load: str = "") -> tuple[dict, int]:
    """Latency of `fn` (graph-capturable, moves at least `nbytes`) from CUDA graph replays, timed
    twice (the second median shows the noise), beside its floors: the copy roofline and the read
    floor of the same bytes, and the timing method's fixed cost. `reps=0` picks the count from a
    short first timing. `eager`: time eager calls instead (a step that syncs the host cannot be
    captured). `sustain_s`: each timing after that long of back-to-back calls (the clock state
    of a sustained load), or of a co-runner's work (`sustain_load`, kernels.tuned_table's
    SUSTAIN_LOADS), which also runs before every timed call. Returns (columns, reps used)."""
    import torch

    from drafter_attn.tuner import floors, roofline, timing

    cold = _needs_flush(nbytes)
    load = timing.co_load(sustain_load) if sustain_s else None
    co_loaded = load is not None
    timer = _timer(fn, eager, load)
    del load  # its operands live as long as the timer
    if not reps:
        reps = choose_reps(timer(5, warmup=2, cold_l2=cold).median_us)
    first = timer(reps, cold_l2=cold, sustain_s=sustain_s)
    second = timer(reps, cold_l2=cold, sustain_s=sustain_s)
    del timer
    row = dict(median_us=first.median_us, p10_us=first.p10_us, p90_us=first.p90_us,
               mean_us=first.mean_us, min_us=first.min_us, count=first.count,
               # a co-runner's replays are flushed whatever the size (timing._each_timed)
               repeat_median_us=second.median_us, l2_flushed=cold or co_loaded,
               sm_clock_mhz=first.sm_mhz,
               **roofline_row(first.median_us, nbytes, roofline.copy_bandwidth()),
               **floors.read_floor(nbytes).row(first.median_us),
               graph_fixed_us=floors.empty_graph_us())
    return row, reps


def time_step(step, reps: int = 0, eager: bool = False, sustain_s: float = 0.0,
              sustain_load: str = "") -> dict:
    """The whole step (`time_fn`) and each half alone (attention, store), from graph replays
    (eager calls with `eager`); the step's and the attention's timings each after `sustain_s`
    of back-to-back calls, or of `sustain_load`'s co-runner (which the store's timing never has:
    not sustained, below)."""
    from drafter_attn.tuner import timing

    row, reps = time_fn(step.run, step.bytes_moved, reps, eager=eager, sustain_s=sustain_s,
                        sustain_load=sustain_load)
    cold = _needs_flush(step.bytes_moved)  # the halves' own: the store has no co-runner
    for name, fn in (("attention", step.attention_only), ("store", step.store_only)):
        load = timing.co_load(sustain_load) if sustain_s and name == "attention" else None
        timer = _timer(fn, eager, load)
        # the store alone moves a few hundred KB: its own load never brings the clock down, so
        # it is not sustained (which would only cost the time)
        t = timer(reps, cold_l2=cold, sustain_s=sustain_s if name == "attention" else 0.0)
        del timer, load
        row.update({f"{name}_median_us": t.median_us, f"{name}_p10_us": t.p10_us,
                    f"{name}_p90_us": t.p90_us})
    return row


def measure_baseline(name: str, geometry, page: int, batch: int, ctx: int, *, layers: int = 1,
                     reps: int = 0, seed: int = 0, sustain_s: float = 0.0, sustain_load: str = "") -> dict:
    """Baseline `name` (kernels.baselines) over `batch` requests of `ctx` tokens: the attention
    (no store) of `layers` layers back to back in one call, each with its own pages, timed as a
    step is, with its host syncs. Several layers in one graph pay the launch once, as a step
    does; one layer's time times L would charge it L launches. Never raises; its time goes into
    the attention columns too, so that it sits beside the kernels' attention halves."""
    import torch

    from drafter_attn.kernels import baselines
    from drafter_attn.tuner import roofline, syncs

    t0 = time.perf_counter()
    g1 = geometry.with_(num_layers=1)
    row: dict = {}
    base = None
    try:
        base = baselines.build(name, g1, page, [ctx] * batch, "cuda", torch.Generator().manual_seed(seed),
                               layers=layers)
        row, _ = time_fn(base.run, layers * roofline.call_bytes(g1, batch, ctx, page), reps,
                         sustain_s=sustain_s, sustain_load=sustain_load)
        row.update(attention_median_us=row["median_us"], attention_p10_us=row["p10_us"],
                   attention_p90_us=row["p90_us"], kv_bytes=base.kv_bytes)
        report = syncs.detect_syncs(base.run, graph=False)
        report.notes[:] = [n for n in report.notes if n != syncs.NSYS_NOT_ASKED]
        report.notes.append(f"{name} baseline: {layers} layer(s)' attention in one call, no store")
        row.update(report.as_row(), graph_capturable=True, status="ok", reason=None)
    except Exception as exc:
        row = dict(zip(("status", "reason"), failure(exc)))
    finally:
        base = None
        _release(row)
    row["elapsed_s"] = time.perf_counter() - t0
    return row


def _release(row: dict) -> None:
    """Free what a measurement left in the allocator; a fault shows here as a runtime failure
    (this process's CUDA context is gone)."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the next measurement's sizes differ: start from a clean pool
    except Exception as exc:
        if row.get("status") == "ok":
            row.update(status="failed_runtime", reason=f"{type(exc).__name__}: {exc}")


def failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of a measurement that raised, in the profile database's terms."""
    from drafter_attn.kernels.nvrtc import CompileError
    from drafter_attn.tuner.step import CorrectnessError

    if isinstance(exc, CompileError):
        return "failed_compile", str(exc)[:4000]
    if isinstance(exc, CorrectnessError):
        return "failed_correctness", str(exc)
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return "failed_runtime", f"{type(exc).__name__}: {exc}{at}"[:4000]


def stalling_reason(impl: str, stall: str) -> str:
    """The reason an ok row of a reference that stalls the host carries."""
    return (f"{impl}: a reference that stalls the host, never a candidate ({stall}); timed eagerly, "
            "as a step that syncs cannot be captured into a CUDA graph")


def _device_sm() -> int | None:
    """SM of the current CUDA device (whose shared memory `supports` checks), None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def measure_candidate(wire: dict, *, reps: int = 0, nsys: bool = False, **step_options) -> dict:
    """Measure `wire` (Candidate.to_wire()) on cuda:0 -> result columns. Never raises.
    `step_options` go to the DecodeStep (`table_capacity`, `max_ctx_hint`)."""
    from drafter_attn.tuner.step import DecodeStep

    return measure_step(wire, lambda c, backend: DecodeStep(c.problem, backend, c.params_dict,
                                                            accepted=c.accepted, **step_options),
                        reps=reps, nsys=nsys)


def measure_step(wire: dict, make_step, *, reps: int = 0, nsys: bool = False,
                 nsys_note: str | None = None) -> dict:
    """The measurement of one step of `wire`, built by `make_step(candidate, backend)` (a
    DecodeStep or a subclass): supports() first, then check, latency, memory and syncs (with
    Nsight Systems when `nsys`; `nsys_note` replaces its layer's note where it is not run).
    Each timing follows the candidate's `sustain_s` of back-to-back steps (its regime).
    Never raises: a failure becomes a status with its reason."""
    import torch

    from drafter_attn.kernels import registry
    from drafter_attn.tuner import memory, syncs, timing
    from drafter_attn.tuner.spec import Candidate

    t0 = time.perf_counter()
    row: dict = {}
    step = None
    try:
        c = Candidate.from_wire(wire)
        backend = registry.get(c.impl)
        reason = registry.supports(backend.with_params(**c.params_dict), c.problem, _device_sm())
        if reason:
            return dict(status="unsupported", reason=reason, elapsed_s=time.perf_counter() - t0)
        timing.ensure_flush_buffer()  # before `outside`: the timings' buffer, not the step's
        outside = torch.cuda.memory_allocated()  # live before the step: not its memory
        step = make_step(c, backend)
        # A reference that stalls the host on purpose (reference-syncing) cannot be captured:
        # it is timed eagerly, and its capture is tried to show that it fails.
        stalls = getattr(backend, "stalls_host", None)
        diagnostic = bool(c.params_dict.get("skip_compute") or c.params_dict.get("skip_loads"))
        if diagnostic:  # loads or math only: the output is not attention, so timed but never ok
            row["rel_err"] = None
        else:
            row["rel_err"] = step.check()
        row.update(time_step(step, reps, eager=bool(stalls), sustain_s=c.sustain_s,
                             sustain_load=c.sustain_load))
        row.update(memory.measure_step_memory(step.run, step.kv_bytes, outside=outside).as_dict())
        # Otherwise the step was captured above, so the capture layer is known to pass.
        report = syncs.detect_syncs(step.run, graph=bool(stalls), nsys_candidate=wire if nsys else None)
        if nsys_note:
            report.notes[:] = [n for n in report.notes if n != syncs.NSYS_NOT_ASKED]
            report.notes.append(nsys_note)
        row.update(report.as_row())
        if not stalls:
            row["graph_capturable"] = True
        row.update(status="ok", reason=None if not stalls else stalling_reason(c.impl, stalls))
        if diagnostic:
            row.update(status="failed_correctness", reason=DIAGNOSTIC_REASON)
    except Exception as exc:
        row.update(zip(("status", "reason"), failure(exc)))
    finally:
        step = None  # noqa: F841 (frees the step's caches before empty_cache)
        _release(row)
    row["elapsed_s"] = time.perf_counter() - t0
    return row
