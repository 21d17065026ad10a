"""The C runner of a call's graph launch (kernels/host/graph_runner.c through kernels.native) on
the CPU: C stand-ins of the driver's two functions see what libcuda would."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import sysconfig

import pytest
import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import launch as L
from drafter_attn.kernels import native

v = ctypes.c_void_p
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, v, v)
SET = ctypes.CFUNCTYPE(ctypes.c_int, v, v, v)


def _can_build() -> bool:
    include = sysconfig.get_paths()["include"]
    return bool(shutil.which(os.environ.get("CC", "cc"))) and os.path.exists(f"{include}/Python.h")


def test_the_runner_builds_where_a_compiler_is():
    """With a C compiler and Python's headers (CI, the GPU machine) the C path is what runs;
    without them the Python path runs and `unavailable()` says why."""
    if _can_build() and os.environ.get("DRAFTER_NATIVE") != "0":
        assert native.graph_runner() is not None, native.unavailable()
        assert native.unavailable() is None
    else:
        assert native.graph_runner() is None and native.unavailable()


def test_a_failed_build_is_said_and_not_retried(monkeypatch, tmp_path):
    monkeypatch.delenv("DRAFTER_NATIVE", raising=False)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_why", [])
    native.graph_runner.cache_clear()
    try:
        assert native.graph_runner() is None
        assert "no-such-cc" in native.unavailable()
        assert native.graph_runner() is None and len(native._why) == 1  # tried once
    finally:
        native.graph_runner.cache_clear()  # later tests build (or load) the real one again


class Driver:
    """cuGraphLaunch and cuGraphExecKernelNodeSetParams as C function pointers that record what
    they see: (name, exe, stream or node, the node's first two pointer fields)."""

    def __init__(self):
        self.log, self.fail_set = [], 0
        self.launch = LAUNCH(lambda exe, stream: self.log.append(("launch", exe, stream)) or 0)
        self.set_params = SET(self._set)
        self.args = {}  # node handle -> packed arguments, to read what the node is set with

    def _set(self, exe, node, params):
        if self.fail_set:
            return self.fail_set
        a = self.args[node]
        self.log.append(("set", exe, node, ctypes.c_void_p.from_address(ctypes.addressof(a)).value,
                         ctypes.c_void_p.from_address(ctypes.addressof(a) + 8).value))
        return 0

    def runner(self, nodes, n_tensors, n_sources, *aligns):
        for handle, args, _ in nodes:
            self.args[handle] = args
        module = native.graph_runner()
        if module is None:
            pytest.skip(f"no C runner here: {native.unavailable()}")
        addr = [ctypes.cast(f, v).value for f in (self.launch, self.set_params)]
        return module.Runner(
            *addr, 0xE0, n_tensors, n_sources,
            [(h, 0x1000 + h, ctypes.addressof(a), w) for h, a, w in nodes], *aligns)


def _tensors(n):
    return [torch.empty(4) for _ in range(n)]


def test_runner_sets_only_the_nodes_whose_pointers_changed():
    drv = Driver()
    attention, combine = cb.DrafterParams(), cb.CombineArgs()
    run = drv.runner([(0xA1, attention, cb._ATTENTION_WRITES), (0xB1, combine, cb._COMBINE_WRITES)],
                     8, 10)
    ts = _tensors(8)
    ptr = [t.data_ptr() for t in ts]
    run(7, *ts, 0x5000, 0x6000)  # first call: every node set
    assert drv.log == [("set", 0xE0, 0xA1, ptr[0], ptr[1]), ("set", 0xE0, 0xB1, 0x5000, 0x6000),
                       ("launch", 0xE0, 7)]
    assert [attention.q, attention.out, attention.o_part, attention.lse_part] == [ptr[0], ptr[7], 0x5000, 0x6000]
    assert [combine.o_part, combine.lse_part, combine.out] == [0x5000, 0x6000, ptr[7]]
    drv.log.clear()
    run(7, *ts, 0x5000, 0x6000)  # nothing changed: the launch alone
    assert drv.log == [("launch", 0xE0, 7)]
    drv.log.clear()
    q = torch.empty(4)
    run(9, q, *ts[1:], 0x5000, 0x6000)  # q only: the attention node, not the combine
    assert drv.log == [("set", 0xE0, 0xA1, q.data_ptr(), ptr[1]), ("launch", 0xE0, 9)]
    drv.log.clear()
    out = torch.empty(4)
    run(9, q, *ts[1:7], out, 0x5000, 0x6000)  # out: both take it
    assert [e[2] for e in drv.log if e[0] == "set"] == [0xA1, 0xB1]
    assert attention.out == combine.out == out.data_ptr()


def test_runner_errors_are_raised_and_the_next_call_sets_again():
    drv = Driver()
    args = cb.StoreArgs()
    run = drv.runner([(0xC1, args, cb._STORE_WRITES)], 7, 8)
    ts = _tensors(7)
    drv.fail_set = 700
    with pytest.raises(RuntimeError, match="cuGraphExecKernelNodeSetParams failed: CUresult 700"):
        run(3, *ts, 0xC0)
    drv.fail_set = 0
    run(3, *ts, 0xC0)
    assert [e[0] for e in drv.log] == ["set", "launch"]  # not skipped after the failure
    assert (args.k_new, args.ctx_lens, args.counters) == (ts[0].data_ptr(), ts[6].data_ptr(), 0xC0)
    with pytest.raises(TypeError, match="9 positional arguments"):
        run(3, *ts[:6], 0xC0)
    with pytest.raises(AttributeError):
        run(3, *ts[:6], 5, 0xC0)  # an int where a tensor goes
    failing = Driver()
    failing.launch = LAUNCH(lambda exe, stream: 4)
    with pytest.raises(RuntimeError, match="cuGraphLaunch failed: CUresult 4"):
        failing.runner([(0xC2, cb.StoreArgs(), cb._STORE_WRITES)], 7, 8)(3, *ts, 0xC0)


def _misaligned(offset_bytes: int) -> torch.Tensor:
    """A bf16 tensor whose data_ptr is `offset_bytes` past a 16-byte boundary."""
    base = torch.empty(64, dtype=torch.bfloat16)
    skip = (-base.data_ptr() % 16 + offset_bytes) // 2
    return base[skip:skip + 8]


def test_runner_refuses_a_misaligned_pointer_before_any_launch():
    """A tensor the kernels would copy in 16-byte pieces from a 2-byte aligned address: a
    ValueError naming it, no node set and no launch (on the GPU such a copy faults the context);
    the next aligned call runs as usual."""
    drv = Driver()
    run = drv.runner([(0xC1, cb.StoreArgs(), cb._STORE_WRITES)], 7, 8, cb.STORE_ALIGN)
    ts = _tensors(7)
    k_cache = _misaligned(2)
    with pytest.raises(ValueError, match=r"k_cache: data_ptr 0x[0-9a-f]+ is not 16-byte aligned"):
        run(3, *ts[:3], k_cache, *ts[4:], 0xC0)
    assert drv.log == []
    run(3, *ts[:3], _misaligned(0), *ts[4:], 0xC0)
    assert [e[0] for e in drv.log] == ["set", "launch"]
    out = drv.runner([(0xA1, cb.DrafterParams(), cb._ATTENTION_WRITES)], 8, 10, cb.ATTENTION_ALIGN)
    out(3, *_tensors(7), _misaligned(4), 0, 0)  # out takes 4-byte stores
    with pytest.raises(ValueError, match="out: data_ptr .* is not 4-byte aligned"):
        out(3, *_tensors(7), _misaligned(2), 0, 0)


@pytest.mark.parametrize("aligns", [[("q", 3)], [("q", 8192)], [("q", 16)] * 8, [(1, 16)]])
def test_runner_rejects_bad_aligns(aligns):
    with pytest.raises((ValueError, TypeError)):
        Driver().runner([(0xC1, cb.StoreArgs(), cb._STORE_WRITES)], 7, 8, aligns)


def test_check_aligned_names_the_first_misaligned_pointer():
    cb.check_aligned(cb.ATTENTION_ALIGN, [16, 32, 48, 64, 80, 2, 6, 4])  # int32s and out: fine
    with pytest.raises(ValueError, match="v_blk: data_ptr 0x32 is not 16-byte aligned"):
        cb.check_aligned(cb.ATTENTION_ALIGN, [16, 32, 0x32, 0x42, 80, 0, 0, 4])
    with pytest.raises(ValueError, match="out: data_ptr 0x6 is not 4-byte aligned"):
        cb.check_aligned(cb.ATTENTION_ALIGN, [16] * 7 + [6])


def test_runner_rejects_a_bad_layout():
    drv = Driver()
    with pytest.raises(ValueError, match="sources below n_sources"):
        drv.runner([(0xA1, cb.CombineArgs(), ((0, 3),))], 2, 3)
    with pytest.raises(ValueError, match="n_sources <= 16"):
        drv.runner([(0xA1, cb.CombineArgs(), ())], 2, 17)


def test_runner_writes_match_the_packed_structs():
    """The runner's (offset, source) layouts are the structs' leading pointer fields."""
    names = ["q", "k_blk", "v_blk", "k_cache", "v_cache", "table", "ctx_lens", "out", "o_part",
             "lse_part"]
    assert [getattr(cb.DrafterParams, n).offset for n in names] == [o for o, _ in cb._ATTENTION_WRITES]
    assert [getattr(cb.TmaDrafterParams, n).offset for n in names] == [o for o, _ in cb._ATTENTION_WRITES]
    assert [(getattr(cb.CombineArgs, n).offset, names.index(n)) for n in ("o_part", "lse_part", "out")] \
        == list(cb._COMBINE_WRITES)
    store = ["k_new", "v_new", "num_new", "k_cache", "v_cache", "table", "ctx_lens", "counters"]
    assert [(getattr(cb.StoreArgs, n).offset, i) for i, n in enumerate(store)] == list(cb._STORE_WRITES)


class CGraphApi:
    """libcuda's graph functions with C stand-ins for launch and set (so graphs get a runner),
    Python ones for building (as tests/test_launch.py's FakeGraphApi)."""

    def __init__(self):
        self.drv, self._next = Driver(), 0x100
        self.launch, self.set_params = self.drv.launch, self.drv.set_params

    def _handle(self, ref):
        self._next += 0x10
        ref._obj.value = self._next
        return 0

    def create(self, ref, flags):
        return self._handle(ref)

    def add_kernel(self, ref, graph, deps, count, params):
        self._handle(ref)
        self.drv.args[self._next] = ctypes.c_char.from_address(
            ctypes.c_void_p.from_address(params._obj.kernelParams).value)  # first field's address
        return 0

    def instantiate(self, ref, graph, flags):
        return self._handle(ref)

    def destroy_exec(self, exe):
        return 0

    destroy = destroy_exec


def test_planned_calls_run_through_the_runner(monkeypatch):
    """An attention plan: the first eager call on a stream builds its graph (Python path), later
    ones go through that graph's runner with the call's pointers; inside a capture, one by one."""
    if native.graph_runner() is None:
        pytest.skip(f"no C runner here: {native.unavailable()}")
    api = CGraphApi()
    raw = ctypes.CFUNCTYPE(ctypes.c_int, *[v] + [ctypes.c_uint] * 7 + [v] * 3)(lambda *a: 0)
    raw.argtypes = [v] + [ctypes.c_uint] * 7 + [v] * 3
    monkeypatch.setattr(L, "_driver_launch", lambda: raw)  # no libcuda here
    monkeypatch.setattr(L, "graph_api", lambda: api)
    monkeypatch.setattr(cb, "_stream", lambda index: 0x77)
    monkeypatch.setattr(cb, "capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())  # CPU torch
    attention = L.Launch(0xA000, (4, 8, 1), (384, 1, 1), 0, cb.DrafterParams())
    combine = L.Launch(0xB000, (128, 1, 1), (128, 1, 1), 0, cb.CombineArgs())
    plan = cb.AttentionPlan(0, 4, 64, 8, attention, combine)
    ts = _tensors(7)
    out = plan.run(*ts, None)
    assert plan.launches.no_graph is None and 0x77 in plan.launches.graphs, plan.launches.no_graph
    exe = plan.launches.graphs[0x77].exe.value
    assert 0x77 in plan.launches.runners  # built on the Python path, which launched the graph
    assert api.drv.log == [("launch", exe, 0x77)]
    api.drv.log.clear()
    work = plan.workspaces[0x77].data_ptr()
    out2 = torch.empty(4)
    assert plan.run(*ts, out2) is out2
    sets = [e for e in api.drv.log if e[0] == "set"]
    assert len(sets) == 2 and api.drv.log[-1] == ("launch", exe, 0x77)  # the runner's first call
    assert attention.args.out == combine.args.out == out2.data_ptr() != out.data_ptr()
    assert (attention.args.o_part, combine.args.o_part) == (work, work)
    assert plan.packed == ()  # the Python path packs again next time it runs


def test_the_python_path_refuses_a_misaligned_pointer_too(monkeypatch):
    """Inside a capture (and wherever no runner is built) the Python path packs the call's
    pointers: a misaligned one raises before anything is packed or launched."""
    launched = []
    monkeypatch.setattr(cb, "_stream", lambda index: 0x77)
    monkeypatch.setattr(cb, "capturing", lambda: True)
    monkeypatch.setattr(L.LaunchGraph, "__call__", lambda self, stream, captured: launched.append(1))
    attention = L.Launch.__new__(L.Launch)
    attention.args = cb.DrafterParams()
    plan = cb.AttentionPlan(0, 1, 0, 0, attention, None)
    ts = _tensors(7)
    with pytest.raises(ValueError, match="q: data_ptr .* is not 16-byte aligned"):
        plan.run(_misaligned(8), *ts[1:], torch.empty(4))
    assert not launched and attention.args.q is None and plan.packed == ()
    plan.run(*ts, torch.empty(4))
    assert launched == [1] and attention.args.q == ts[0].data_ptr()
    for i, (name, align) in enumerate(cb.STORE_ALIGN):  # each tensor the store copies
        store = L.Launch.__new__(L.Launch)
        store.args = cb.StoreArgs()
        splan = cb.StorePlan(0, store, torch.zeros(2, dtype=torch.int32))
        args = _tensors(7)
        args[i] = _misaligned(2)
        if align:
            with pytest.raises(ValueError, match=f"{name}: data_ptr .* is not {align}-byte"):
                splan.run(*args)
            assert store.args.k_new is None
        else:
            splan.run(*args)
    assert launched == [1, 1, 1, 1]  # the three int32 tensors are not checked


def test_a_layout_the_runner_refuses_leaves_the_python_path(monkeypatch):
    if native.graph_runner() is None:
        pytest.skip(f"no C runner here: {native.unavailable()}")
    api = CGraphApi()
    launch = L.Launch.__new__(L.Launch)  # only what a graph node needs
    launch.func, launch.grid, launch.block, launch.smem = 0xA000, (1, 1, 1), (32, 1, 1), 0
    launch.args = cb.StoreArgs()
    launch._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(launch.args))
    monkeypatch.setattr(L, "graph_api", lambda: api)
    graph = L.LaunchGraph([launch], None, (7, 99, (cb._STORE_WRITES,)))  # 99 sources: too many
    graph(stream=5, captured=False)
    assert 5 in graph.graphs and not graph.runners and graph.no_graph is None
