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


@functools.cache
def _l2_bytes(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).L2_cache_size or (60 << 20)


def time_step(step, reps: int = 0) -> dict:
    """Latency of the whole step (timed twice: the second median shows the noise) and of each
    half, from CUDA graph replays; `reps=0` picks the count from a short first timing."""
    import torch

    from drafter_attn.tuner import roofline, timing

    cold = step.bytes_moved < FLUSH_BELOW_L2_MULTIPLE * _l2_bytes(torch.cuda.current_device())
    graph = timing.capture(step.run)
    if not reps:
        reps = choose_reps(timing.time_graph(graph, reps=5, warmup=2, cold_l2=cold).median_us)
    first = timing.time_graph(graph, reps=reps, cold_l2=cold)
    second = timing.time_graph(graph, reps=reps, cold_l2=cold)
    del graph
    row = dict(median_us=first.median_us, p10_us=first.p10_us, p90_us=first.p90_us,
               mean_us=first.mean_us, min_us=first.min_us, count=first.count,
               repeat_median_us=second.median_us, l2_flushed=cold)
    for name, fn in (("attention", step.attention_only), ("store", step.store_only)):
        graph = timing.capture(fn)
        t = timing.time_graph(graph, reps=reps, cold_l2=cold)
        del graph
        row.update({f"{name}_median_us": t.median_us, f"{name}_p10_us": t.p10_us,
                    f"{name}_p90_us": t.p90_us})
    row.update(roofline_row(first.median_us, step.bytes_moved, roofline.copy_bandwidth()))
    return row


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


def measure_candidate(wire: dict, *, reps: int = 0, nsys: bool = False) -> dict:
    """Measure `wire` (Candidate.to_wire()) on cuda:0 -> result columns. Never raises."""
    from drafter_attn.tuner.step import DecodeStep

    return measure_step(wire, lambda c, backend: DecodeStep(c.problem, backend, c.params_dict,
                                                            accepted=c.accepted),
                        reps=reps, nsys=nsys)


def measure_step(wire: dict, make_step, *, reps: int = 0, nsys: bool = False,
                 nsys_note: str | None = None) -> dict:
    """The measurement of one step of `wire`, built by `make_step(candidate, backend)` (a
    DecodeStep or a subclass): supports() first, then check, latency, memory and syncs (with
    Nsight Systems when `nsys`; `nsys_note` replaces its layer's note where it is not run).
    Never raises: a failure becomes a status with its reason."""
    import torch

    from drafter_attn.kernels import registry
    from drafter_attn.tuner import memory, syncs
    from drafter_attn.tuner.spec import Candidate

    t0 = time.perf_counter()
    row: dict = {}
    step = None
    try:
        c = Candidate.from_wire(wire)
        backend = registry.get(c.impl)
        reason = backend.with_params(**c.params_dict).supports(c.problem)
        if reason:
            return dict(status="unsupported", reason=reason, elapsed_s=time.perf_counter() - t0)
        step = make_step(c, backend)
        row["rel_err"] = step.check()
        row.update(time_step(step, reps))
        row.update(memory.measure_step_memory(step.run, step.kv_bytes).as_dict())
        # The step was captured above, so the capture layer is known to pass.
        report = syncs.detect_syncs(step.run, graph=False, nsys_candidate=wire if nsys else None)
        if nsys_note:
            report.notes[:] = [n for n in report.notes if not n.startswith("nsys layer")]
            report.notes.append(nsys_note)
        row.update(report.as_row(), graph_capturable=True)
        row.update(status="ok", reason=None)
    except Exception as exc:
        row.update(zip(("status", "reason"), failure(exc)))
    finally:
        step = None  # noqa: F841 (frees the step's caches before empty_cache)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the next candidate's sizes differ: start from a clean pool
        except Exception as exc:  # a fault in the step: this process's CUDA context is gone
            if row.get("status") == "ok":
                row.update(status="failed_runtime", reason=f"{type(exc).__name__}: {exc}")
    row["elapsed_s"] = time.perf_counter() - t0
    return row
