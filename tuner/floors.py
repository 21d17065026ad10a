"""Floors measured in the same run as the kernels they judge.

- `read_floor(nbytes)`: the fastest this GPU streams `nbytes` from HBM, timed exactly as a kernel
  is (one CUDA graph replay per sample, L2 cold, CUDA events), so it carries the same fixed launch
  cost. A kernel that must read `nbytes` cannot beat it; `median / read_floor` is how far off it
  is. The copy bandwidth (tuner.roofline) counts reads plus writes and reads lower than a pure
  read stream, so it flatters kernels that only read.
- `empty_graph_us()`: the timing method's own fixed cost (an empty graph's replay), recorded
  once per run.

The streaming kernels are kernels/cuda/read_floor.cu: bulk copies into shared memory on sm_90 and
up, plain 16-byte loads anywhere; the floor is the faster of the two.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

SOURCE = "read_floor.cu"
STAGES, CHUNK = 4, 16384  # bulk copies in flight per CTA, and their size (64 KB per CTA)
CTAS_PER_SM = 2
LD_THREADS, LD_CTAS_PER_SM = 512, 4


@dataclass(frozen=True)
class ReadFloor:
    nbytes: int
    median_us: float  # the faster way's median
    way: str  # "bulk" or "ld"
    bulk_us: float | None
    ld_us: float | None

    @property
    def bandwidth_gbs(self) -> float:
        return self.nbytes / self.median_us / 1e3

    def row(self, median_us: float) -> dict:
        """Columns of a measured row whose kernel moves these bytes in `median_us`."""
        return dict(read_floor_us=self.median_us, read_bandwidth_gbs=self.bandwidth_gbs,
                    read_roofline_fraction=self.median_us / median_us if median_us > 0 else None)


class FloorArgs(ctypes.Structure):
    """The streaming kernels' parameters (kernels/cuda/read_floor.cu, both kernels): the source,
    its size (bytes for `read_floor_bulk`, 16-byte words for `read_floor_ld`) and the sink."""

    _fields_ = [("src", ctypes.c_void_p), ("n", ctypes.c_uint64), ("sink", ctypes.c_void_p)]


@functools.cache
def _kernels(index: int):
    """(bulk or None, ld, SM count, the module keeping them loaded): the streaming kernels of
    device `index` as driver function handles."""
    import cupy
    import torch
    from cuda.bindings import driver

    from drafter_attn.kernels.nvrtc import arch_for_sm, compile_cubin

    props = torch.cuda.get_device_properties(index)
    sm = props.major * 10 + props.minor
    result = compile_cubin(SOURCE, dict(STAGES=STAGES, CHUNK=CHUNK), arch_for_sm(sm))
    with cupy.cuda.Device(index):
        mod = cupy.RawModule(path=str(result.cubin_path))
        bulk = mod.get_function("read_floor_bulk") if sm >= 90 else None
        if bulk is not None:
            bulk.max_dynamic_shared_size_bytes = STAGES * CHUNK
        ld = mod.get_function("read_floor_ld")
    handle = lambda f: None if f is None else driver.CUfunction(f.kernel.ptr)  # noqa: E731
    return handle(bulk), handle(ld), props.multi_processor_count, mod


def streaming_reads(nbytes: int, device_index: int | None = None):
    """(name, fn) pairs, each reading a fresh random buffer of `nbytes` once per call, launched
    through the driver on torch's current stream (so that graph capture follows torch)."""
    import torch

    from drafter_attn.kernels.launch import Launch

    index = torch.cuda.current_device() if device_index is None else device_index
    bulk, ld, sms, _ = _kernels(index)
    n = max(16, nbytes // 16 * 16)
    buf = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, device=f"cuda:{index}")
    sink = torch.zeros(1, dtype=torch.int32, device=buf.device)
    ptr, out = buf.data_ptr(), sink.data_ptr()

    def way(func, ctas, threads, count, smem=0):
        launch = Launch(func, (ctas, 1, 1), (threads, 1, 1), smem, FloorArgs(ptr, count, out))
        return lambda: launch(torch.cuda.current_stream(index).cuda_stream)

    ways = [("ld", way(ld, sms * LD_CTAS_PER_SM, LD_THREADS, n // 16))]
    if bulk is not None:
        ways.insert(0, ("bulk", way(bulk, sms * CTAS_PER_SM, 32, n, STAGES * CHUNK)))
    return ways, (buf, sink)


# Timings of each way a floor keeps the lowest of (a floor is a lower bound, so the lowest is the
# estimate). They guard against one slow timing; they do not cure a floor timed in a process
# where the measurements before it left the GPU reading slowly for a while (H200: 19.2 us at B=1
# 8k, three timings alike, where 11.3-12.3 when timed first): time floors before anything else
# (`time_first`).
FLOOR_ATTEMPTS = 3


@functools.cache
def read_floor(nbytes: int, reps: int = 50, attempts: int = FLOOR_ATTEMPTS) -> ReadFloor:
    """The read floor of `nbytes` on the current device: the lowest median of `attempts`
    interleaved timings of each way (cached per size for the process; `read_floor.cache_clear()`
    measures again)."""
    from drafter_attn.tuner import timing

    ways, keep = streaming_reads(nbytes)
    graphs = {name: timing.capture(fn) for name, fn in ways}
    times: dict[str, float] = {}
    for _ in range(attempts):
        for name, graph in graphs.items():
            t = timing.time_graph(graph, reps=reps).median_us
            times[name] = min(t, times.get(name, t))
    del graphs, keep
    way = min(times, key=times.get)
    return ReadFloor(nbytes, times[way], way, times.get("bulk"), times.get("ld"))


def time_first(sizes, echo=print, floor=None) -> None:
    """Time the read floor of every size in `sizes` now (`floor`, default `read_floor`, which
    caches it), before a run measures anything: timed between measurements, floors have read
    1.6-5x high on the H200, above the kernels they bound, and timed first they are steady
    (results/perf-notes.md, "The read floor, measured more than once"). A size that fails is
    named through `echo`; its row times it again and records the failure there."""
    floor = floor or read_floor
    for nbytes in dict.fromkeys(sizes):
        try:
            floor(nbytes)
        except Exception as exc:
            echo(f"read floor of {nbytes} bytes not timed first: {type(exc).__name__}: {exc}")


@functools.cache
def empty_graph_us(reps: int = 200) -> float:
    """Median replay time of a graph that holds one empty kernel: what the timing method itself
    costs (launch, events), measured cold as every step is."""
    import torch

    from drafter_attn.tuner import timing

    x = torch.zeros(1, device="cuda")
    return timing.time_replays(lambda: x.add_(0), reps=reps).median_us
