"""Device timing of one step: CUDA graph replays bracketed by CUDA events, a cold L2 per replay.

    t = time_replays(lambda: backend.paged_attention(...))
    t.median_us, t.p10_us, t.p90_us, t.count

The step is run eagerly twice (compiles, loads, allocates workspaces), captured into a CUDA graph,
then replayed `reps` times. Before each replay a buffer twice the L2 size is overwritten, outside
the timed region (by reading it, so the L2 holds no dirty lines), so every replay reads its inputs
from HBM as a serving step would (the drafter layer's K/V was evicted by the target model's
forward in between).
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    mean_us: float
    min_us: float
    count: int

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


@functools.cache
def _flush_buffer(device_index: int) -> torch.Tensor:
    l2 = torch.cuda.get_device_properties(device_index).L2_cache_size or (64 << 20)
    return torch.ones(2 * l2 // 4, dtype=torch.int32, device=f"cuda:{device_index}")


def flush_l2(device_index: int | None = None) -> None:
    """Evict the L2 by *reading* twice its size. A write (e.g. zero_) would leave the L2 full of
    dirty lines, whose write-back then lands inside the timed step (seen: +15 us on an H200)."""
    index = torch.cuda.current_device() if device_index is None else device_index
    _flush_buffer(index).max()


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
               cold_l2: bool = True) -> Timing:
    """Replay a captured graph `reps` times; each replay timed alone with CUDA events."""
    for _ in range(warmup):
        graph.replay()
    return _each_timed(graph.replay, reps, cold_l2)


def time_eager(fn, reps: int = 100, warmup: int = 3, cold_l2: bool = True) -> Timing:
    """Time `fn` called eagerly `reps` times, each call alone between CUDA events (L2 evicted
    before each when `cold_l2`): for a step that cannot be captured into a graph, such as one
    whose host waits for the device inside it. The host's launch time and its waits show in the
    figures, as they do when such a step runs in a serving loop."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _each_timed(fn, reps, cold_l2)


def _each_timed(call, reps: int, cold_l2: bool) -> Timing:
    """`call()` `reps` times, each alone between two CUDA events (the L2 evicted before each when
    `cold_l2`); one synchronisation at the end."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if cold_l2:
            flush_l2()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def time_replays(fn, reps: int = 100, warmup: int = 10, cold_l2: bool = True) -> Timing:
    """Capture `fn` (a whole step: must not sync the host) and time its replays."""
    return time_graph(capture(fn), reps=reps, warmup=warmup, cold_l2=cold_l2)
