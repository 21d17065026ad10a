"""The per-call launch path (kernels.launch) on the CPU: a stand-in of the driver's functions
sees what libcuda would, for one launch and for a call's launches as one graph."""

from __future__ import annotations

import ctypes
import gc

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import launch as L

u, v = ctypes.c_uint, ctypes.c_void_p


@pytest.fixture
def raw_launches(monkeypatch):
    """cuLaunchKernel replaced by a stand-in with its signature; returns what it saw."""
    seen = []
    raw = ctypes.CFUNCTYPE(ctypes.c_int, v, u, u, u, u, u, u, u, v, v, v)(
        lambda *a: seen.append(a) or 0)
    raw.argtypes = [v, u, u, u, u, u, u, u, v, v, v]
    monkeypatch.setattr(L, "_driver_launch", lambda: raw)
    return seen


def test_launch_passes_its_packed_arguments(raw_launches):
    """Launch converts its head (function, grid, block, shared memory) to cuLaunchKernel's
    argument types once."""
    launch = L.Launch(0x7F0012345000, (16, 8, 1), (128, 1, 1), 100_000, cb.CombineArgs())
    launch(0x5A5A0000)
    launch(0)
    params = ctypes.addressof(launch._ptrs)
    assert raw_launches == [(0x7F0012345000, 16, 8, 1, 128, 1, 1, 100_000, 0x5A5A0000, params, None),
                            (0x7F0012345000, 16, 8, 1, 128, 1, 1, 100_000, None, params, None)]


def _first_pointer(node: L.KernelNodeParams) -> int:
    """The value of a node's first kernel parameter (a pointer field), read as the driver
    reads it when the node is set."""
    slot = ctypes.c_void_p.from_address(node.kernelParams).value
    return ctypes.c_void_p.from_address(slot).value


def _val(handle) -> int:
    """A handle as an int: ctypes passes a Python stand-in the c_void_p objects themselves."""
    return getattr(handle, "value", handle)


class FakeGraphApi:
    """libcuda's graph functions as the driver sees them: creates handles, records the nodes
    (their parameters' values at the time they are set), the launches and the destroys."""

    def __init__(self):
        self.log, self._next = [], 0x1000

    def _handle(self, ref):
        self._next += 0x10
        ref._obj.value = self._next
        return self._next

    def create(self, ref, flags):
        self.log.append(("create", self._handle(ref)))
        return 0

    def add_kernel(self, ref, graph, deps, count, params):
        node = params._obj
        self.log.append(("add", _val(graph), [deps[i] for i in range(count)], node.func,
                         (node.gridDimX, node.gridDimY, node.gridDimZ), node.sharedMemBytes,
                         _first_pointer(node), self._handle(ref)))
        return 0

    def instantiate(self, ref, graph, flags):
        self.log.append(("instantiate", _val(graph), self._handle(ref)))
        return 0

    def set_params(self, exe, node, params):
        self.log.append(("set", _val(exe), _val(node), _first_pointer(params._obj)))
        return 0

    def launch(self, exe, stream):
        self.log.append(("launch", _val(exe), stream))
        return 0

    def destroy_exec(self, exe):
        self.log.append(("destroy_exec", _val(exe)))
        return 0

    def destroy(self, graph):
        self.log.append(("destroy", _val(graph)))
        return 0


@pytest.fixture
def fake_graphs(raw_launches, monkeypatch):
    api = FakeGraphApi()
    monkeypatch.setattr(L, "graph_api", lambda: api)
    return api


def _two_launches():
    attention = L.Launch(0xA000, (4, 8, 1), (384, 1, 1), 90_000, cb.DrafterParams())
    combine = L.Launch(0xB000, (128, 1, 1), (128, 1, 1), 0, cb.CombineArgs())
    return attention, combine


def test_a_call_is_one_graph_launch_with_its_current_arguments(fake_graphs, raw_launches):
    attention, combine = _two_launches()
    graph = L.LaunchGraph([attention, combine])
    attention.args.q, combine.args.o_part = 0x111, 0x222
    graph(stream=5, captured=False)
    log = fake_graphs.log
    (_, g), (_, g1, d1, f1, grid1, smem1, q1, n1), (_, g2, d2, f2, _, _, p2, n2), (_, g3, exe) = \
        log[:4]
    assert g == g1 == g2 == g3 and (d1, d2) == ([], [n1])  # the combine after the attention
    assert (f1, grid1, smem1, f2) == (0xA000, (4, 8, 1), 90_000, 0xB000)
    assert (q1, p2) == (0x111, 0x222)  # the nodes are made with the call's arguments
    assert log[4:] == [("launch", exe, 5)]
    assert raw_launches == []  # no kernel launched on its own

    log.clear()
    attention.args.q = 0x333  # the next call's pointers: that node set again, no new graph
    graph.touch()
    graph(stream=5, captured=False)
    assert log == [("set", exe, n1, 0x333), ("launch", exe, 5)]
    log.clear()
    graph(stream=5, captured=False)  # nothing changed: nothing set
    assert log == [("launch", exe, 5)]
    log.clear()
    combine.args.splits = 7  # any byte of the struct, not only the pointers
    graph.touch()
    graph(stream=5, captured=False)
    assert log == [("set", exe, n2, 0x222), ("launch", exe, 5)]
    log.clear()
    graph.touch()  # touched without a change: compared, nothing set
    graph(stream=5, captured=False)
    assert log == [("launch", exe, 5)]


def test_each_streams_graph_catches_up_with_changes_made_for_another(fake_graphs):
    """A change packed for one stream's call reaches another stream's graph on its next call,
    once; untouched calls compare nothing (the owner's `touch` is the only signal)."""
    attention, combine = _two_launches()
    graph = L.LaunchGraph([attention, combine])
    graph(stream=1, captured=False)
    graph(stream=2, captured=False)
    execs = {s: g.exe.value for s, g in graph.graphs.items()}
    nodes = {e[-1] for e in fake_graphs.log if e[0] == "add"}
    fake_graphs.log.clear()
    attention.args.q = 0x444
    graph.touch()
    graph(stream=1, captured=False)
    graph(stream=1, captured=False)
    graph(stream=2, captured=False)
    sets = [e for e in fake_graphs.log if e[0] == "set"]
    assert [(e[1], e[3]) for e in sets] == [(execs[1], 0x444), (execs[2], 0x444)]
    assert {e[2] for e in sets} <= nodes
    fake_graphs.log.clear()
    attention.args.q = 0x555  # changed without a touch: not seen (the caller's contract)
    graph(stream=1, captured=False)
    assert fake_graphs.log == [("launch", execs[1], 1)]


def test_a_capture_launches_the_kernels_one_by_one(fake_graphs, raw_launches):
    attention, combine = _two_launches()
    graph = L.LaunchGraph([attention, combine])
    graph(stream=9, captured=True)
    assert fake_graphs.log == [] and not graph.graphs
    assert [(a[0], a[8]) for a in raw_launches] == [(0xA000, 9), (0xB000, 9)]


def test_each_stream_has_its_graph_the_oldest_dropped(fake_graphs):
    graph = L.LaunchGraph(_two_launches())
    for s in range(1, L.GRAPH_STREAMS + 1):
        graph(stream=s, captured=False)
    execs = {s: g.exe.value for s, g in graph.graphs.items()}
    assert len(set(execs.values())) == L.GRAPH_STREAMS
    graph(stream=1, captured=False)  # still kept: no new graph
    assert list(graph.graphs) == list(range(1, L.GRAPH_STREAMS + 1))
    fake_graphs.log.clear()
    graph(stream=99, captured=False)
    gc.collect()
    assert 1 not in graph.graphs and 99 in graph.graphs
    assert ("destroy_exec", execs[1]) in fake_graphs.log  # the dropped graph is freed


def test_without_the_graph_api_calls_launch_one_by_one(raw_launches, monkeypatch):
    monkeypatch.setattr(L, "graph_api", lambda: None)
    graph = L.LaunchGraph(_two_launches())
    graph(stream=3, captured=False)
    assert [(a[0], a[8]) for a in raw_launches] == [(0xA000, 3), (0xB000, 3)]


def test_node_params_match_the_driver_struct():
    """CUDA_KERNEL_NODE_PARAMS_v2: func, 7 uints, then kernelParams at 40, extra, kern, ctx."""
    assert ctypes.sizeof(L.KernelNodeParams) == 72
    assert L.KernelNodeParams.kernelParams.offset == 40


def test_a_graph_the_driver_refuses_falls_back_to_launches(fake_graphs, raw_launches, monkeypatch):
    monkeypatch.setattr(fake_graphs, "instantiate", lambda ref, graph, flags: 999)
    graph = L.LaunchGraph(_two_launches())
    for _ in range(2):
        graph(stream=4, captured=False)
    assert "cuGraphInstantiate failed: CUresult 999" in graph.no_graph and not graph.graphs
    assert [(a[0], a[8]) for a in raw_launches] == [(0xA000, 4), (0xB000, 4)] * 2
    gc.collect()
    assert sum(e[0] == "create" for e in fake_graphs.log) == 1  # tried once, not every call
    assert [e[0] for e in fake_graphs.log].count("destroy") == 1  # and the graph freed


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["cupy", "cupy:num_splits=1", "cutlass"])
def test_eager_calls_run_as_one_graph_per_stream(spec):
    """On the GPU: a plan's eager calls launch its graph (one per stream), each call with its
    own pointers, and match the reference on every stream."""
    import dataclasses

    import torch

    from drafter_attn.kernels import reference, registry
    from drafter_attn.kernels.cache import random_paged_context
    from drafter_attn.kernels.presets import PRESETS

    if spec == "cutlass":
        pytest.importorskip("cutlass_library")
    impl = dataclasses.replace(registry.from_spec(spec))  # plans of its own
    geom = PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(11)
    lens = [700, 3000]
    cache = random_paged_context(geom, lens, 64, "cuda", gen)
    side = torch.cuda.Stream()
    here = torch.cuda.current_stream()
    # each stream's first call builds its graph, later ones go through its C runner
    for n, stream in enumerate([here, here, side, side, here]):
        q, kb, vb = (torch.randn(len(lens), geom.block_size, h, geom.head_dim, generator=gen)
                     .to("cuda", geom.torch_dtype)
                     for h in (geom.num_q_heads, geom.num_kv_heads, geom.num_kv_heads))
        ref = reference.paged_attention(q, kb, vb, *cache)
        out = torch.full_like(q, float("nan"))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            impl.paged_attention(q, kb, vb, *cache, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.isfinite(out).all(), n
        rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < 1e-2, (n, rel)
    (plan,) = impl._plans.values()
    assert plan.launches.no_graph is None
    assert set(plan.launches.graphs) == {torch.cuda.current_stream().cuda_stream, side.cuda_stream}
    assert (plan.combine is None) == (spec == "cupy:num_splits=1")
    from drafter_attn.kernels import native

    assert native.unavailable() is None and set(plan.launches.runners) == set(plan.launches.graphs)
