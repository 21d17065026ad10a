"""Device timing of one step: CUDA graph replays bracketed by CUDA events, a cold L2 per replay.

    t = time_replays(lambda: backend.paged_attention(...))
    t.median_us, t.p10_us, t.p90_us, t.count

The step is run eagerly twice (compiles, loads, allocates workspaces), captured into a CUDA graph,
then replayed `reps` times. Before each replay a buffer twice the L2 size is overwritten, outside
the timed region (by reading it, so the L2 holds no dirty lines), so every replay reads its inputs
from HBM as a serving step would (the drafter layer's K/V was evicted by the target model's
forward in between).

A graph timing whose replays spread wide was disturbed (`steady`): it is timed again, at most
`RETRIES` times, and the lowest median is kept.

Each timing also says the SM clock the GPU ran at (`Timing.sm_mhz`, NVML, sampled while the
replays run). Under a sustained memory-bound load the H200 holds its 700 W power limit by lowering
its SM clock (1980 MHz down to 1500-1700 and at times 1200), and kernels differ in how much that
slows them (results/perf-notes.md, "The SM clock under the power limit"). A timing of short
bursts on a cool GPU runs at a higher clock than a serving loop does: `sustain_s` first replays the
step back to back for that long, so that the timing runs in the clock state the step's own load
brings the GPU to. A drafter's light calls never bring it there themselves; in a serving loop the
target model's forwards do. `load` (`co_load("gemm")`) is such a co-runner: it runs for the
`sustain_s` instead of the step, and again before every timed replay, outside the events.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    mean_us: float
    min_us: float
    count: int
    sm_mhz: float | None = None  # mean SM clock sampled while the replays ran (None: no NVML)

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(samples_us: list[float]) -> Timing:
    """Median, p10, p90 (inclusive quantiles), mean and min of a list of times."""
    if not samples_us:
        raise ValueError("no samples to summarize")
    s = sorted(samples_us)
    if len(s) == 1:
        p10 = p90 = s[0]
    else:
        q = statistics.quantiles(s, n=10, method="inclusive")
        p10, p90 = q[0], q[-1]
    return Timing(statistics.median(s), p10, p90, statistics.fmean(s), s[0], len(s))


# A timing whose p90 lies more than this fraction above its p10 was disturbed. On the H200 a few
# rounds of a run now and then take some replays twice as long (2026-12-04, one B=1 ctx 2k call:
# p10 14.0 / median 20.5 / p90 30.0 us in one round, 13.9 / 14.1 / 14.5 in the round before; the
# host's enqueue is not the cause: timed behind a GPU-side sleep that queues every replay first,
# the figures are the same, results/sm90-2026-12-04/session25/lead/). A steady call's replays lie
# within a few percent of each other (the same call: 13.9-14.5 us).
NOISY_SPREAD = 0.25
# Timings after a disturbed one, at most. Disturbances only ever add time, so the lowest median is
# the estimate of the undisturbed call, as for the read floor (tuner.floors).
RETRIES = 2


def steady(time_once, retries: int = RETRIES, spread: float = NOISY_SPREAD) -> Timing:
    """`time_once()` (a Timing), again while the last one's p90 is more than `spread` above its
    p10, at most `retries` times more; of those, the timing of the lowest median. A steady first
    timing is the only one."""
    best = last = time_once()
    for _ in range(retries):
        if last.p90_us <= last.p10_us * (1 + spread):
            break
        last = time_once()
        if last.median_us < best.median_us:
            best = last
    return best


def ensure_flush_buffer() -> None:
    """Allocate the L2 flush's buffer on the current device now, if it was not: it lives for the
    process, outside any step, so a measurement of memory allocates it before it starts."""
    _flush_buffer(torch.cuda.current_device())


@functools.cache
def _flush_buffer(device_index: int) -> torch.Tensor:
    l2 = torch.cuda.get_device_properties(device_index).L2_cache_size or (64 << 20)
    return torch.ones(2 * l2 // 4, dtype=torch.int32, device=f"cuda:{device_index}")


def flush_l2(device_index: int | None = None) -> None:
    """Evict the L2 by *reading* twice its size. A write (e.g. zero_) would leave the L2 full of
    dirty lines, whose write-back then lands inside the timed step (seen: +15 us on an H200)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    _flush_buffer(index).max()


def sm_clock_mhz() -> float | None:
    """The current device's SM clock now (MHz, through NVML), or None where NVML is missing."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # no pynvml, no NVML, or a device NVML cannot see
        return None


def _sample_clock(into: list[float]) -> bool:
    """Append the SM clock now to `into`; False where NVML cannot say."""
    c = sm_clock_mhz()
    if c is not None:
        into.append(c)
    return c is not None


def sustain(call, seconds: float) -> None:
    """`call()` back to back for about `seconds` (in chunks of 32 calls, synchronised, so that
    the host never queues far ahead): the GPU then runs in the clock state this load brings it to."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(32):
            call()
        torch.cuda.synchronize()


# The co-runner of `co_load("gemm")`: one bf16 matmul of this size, about 1.6 ms on an H200,
# compute-bound like a target model's forward over a batch of drafted blocks; back to back it holds
# the H200 at its 700 W limit, SM clock about 1450-1500 MHz (results/perf-notes.md, "The picks
# under a target model's load").
GEMM_N = 8192


def co_load(kind: str | None):
    """One unit of a co-runner's work for the sustained load `kind`
    (kernels.tuned_table.SUSTAIN_LOADS), or None for the step's own load ("self", "" or None).
    Its operands (256 MB) live as long as the returned function: a timing's, so that they are
    not counted in the memory a step is measured to hold afterwards (tuner.memory)."""
    from drafter_attn.kernels.tuned_table import check_sustain_load

    if kind in (None, "", "self"):
        return None
    check_sustain_load(kind)
    a, b = (torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return lambda: torch.matmul(a, b)


def capture(fn, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """Run `fn` eagerly `warmup` times on a side stream, then capture it into a graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, reps: int = 100, warmup: int = 10,
               cold_l2: bool = True, sustain_s: float = 0.0, load=None) -> Timing:
    """Replay a captured graph `reps` times; each replay timed alone with CUDA events (`steady`:
    timed again where the replays spread wide). `sustain_s`: replayed back to back that long
    first, or with `load` (`co_load`) that co-runner's work run that long and then before every
    replay."""
    between = load if sustain_s > 0 else None
    if sustain_s > 0:
        sustain(load or graph.replay, sustain_s)
    for _ in range(warmup):
        graph.replay()
    return steady(lambda: _each_timed(graph.replay, reps, cold_l2, between=between))


def time_eager(fn, reps: int = 100, warmup: int = 3, cold_l2: bool = True,
               sustain_s: float = 0.0, load=None) -> Timing:
    """Time `fn` called eagerly `reps` times, each call alone between CUDA events (L2 evicted
    before each when `cold_l2`): for a step that cannot be captured into a graph, such as one
    whose host waits for the device inside it. The host's launch time and its waits show in the
    figures, as they do when such a step runs in a serving loop. `sustain_s` and `load` as
    `time_graph`'s."""
    between = load if sustain_s > 0 else None
    if sustain_s > 0:
        sustain(load or fn, sustain_s)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _each_timed(fn, reps, cold_l2, between=between)


def _each_timed(call, reps: int, cold_l2: bool, between=None) -> Timing:
    """`call()` `reps` times, each alone between two CUDA events (the L2 evicted before each when
    `cold_l2`); one synchronisation at the end, the SM clock sampled while waiting for it.
    `between()`, where given, runs before each replay, outside the events: other work the GPU
    does between two calls (scripts/diag_coload.py: a target model's load). The L2 is then
    flushed whatever `cold_l2` says: the co-runner leaves it full of dirty lines, whose
    write-back would otherwise land inside the timed call (a step too large to need a flush
    for its own data still needs one for another's)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    clocks: list[float] = []
    _sample_clock(clocks)
    for start, end in zip(starts, ends):
        if between is not None:
            between()
        if cold_l2 or between is not None:
            flush_l2()
        start.record()
        call()
        end.record()
    while not ends[-1].query() and _sample_clock(clocks):  # the clock while the replays run
        time.sleep(0.003)
    torch.cuda.synchronize()
    _sample_clock(clocks)
    t = summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])
    return replace(t, sm_mhz=statistics.fmean(clocks)) if clocks else t


def time_replays(fn, reps: int = 100, warmup: int = 10, cold_l2: bool = True,
                 sustain_s: float = 0.0, load=None) -> Timing:
    """Capture `fn` (a whole step: must not sync the host) and time its replays."""
    return time_graph(capture(fn), reps=reps, warmup=warmup, cold_l2=cold_l2, sustain_s=sustain_s, load=load)
