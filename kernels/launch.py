"""Kernel launches through the CUDA driver, packed once per shape (the per-call path of a plan).

- `Launch`: one kernel and its argument struct (a ctypes struct holding the kernel's parameters
  field by field). Per call only pointer fields change, then one `cuLaunchKernel`.
- `LaunchGraph`: the launches of one call (an attention and its split combine, or a store) as one
  instantiated CUDA graph per stream. Outside a stream capture a call copies each launch's
  current arguments into its graph node (`cuGraphExecKernelNodeSetParams`, only after the owner
  said they changed, `touch`, and only for a node whose arguments differ) and launches the graph
  once. The driver's host time for two
  kernels that way is 1.9 us against 6.3 us for two `cuLaunchKernel` (H200,
  scripts/launch_cost.cu; results/sm90-2026-12-03/session16/host/).
  Inside a capture the kernels launch one by one: the captured graph holds them and its replays
  pay no host time, and a graph launched into a capturing stream would be a child graph frozen
  with the arguments of the capture.

- With a `layout` (which pointer of a call goes into which field of which launch), each graph
  also gets a C runner (kernels.native, kernels/host/graph_runner.c) where one can be built: a
  stream's later eager calls then hand the call's tensors to it, and it reads their pointers,
  re-sets the nodes whose pointers changed and launches the graph, in one Python call. A graph
  with a runner is driven by it alone outside a capture.

Both take libcuda's functions through ctypes with their argument types bound once, which costs
less than cuda.bindings' wrappers (H200, 2026-11-30: those took 6.5 us of the 29 us a planned
call took). A graph executable is freed when dropped; one still running is freed by the driver
when it completes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref

import torch

# A stream's graphs a LaunchGraph keeps, the oldest dropped beyond this (the split-KV
# workspaces follow the same rule, kernels.cupy_backend).
GRAPH_STREAMS = 4

_u, _p = ctypes.c_uint, ctypes.c_void_p


class KernelNodeParams(ctypes.Structure):
    """`CUDA_KERNEL_NODE_PARAMS_v2` of cuda.h (CUDA 12+): with `func` set, `kern` and `ctx` are
    ignored (the current context's)."""

    _fields_ = [("func", _p), ("gridDimX", _u), ("gridDimY", _u), ("gridDimZ", _u),
                ("blockDimX", _u), ("blockDimY", _u), ("blockDimZ", _u),
                ("sharedMemBytes", _u), ("kernelParams", _p), ("extra", _p), ("kern", _p),
                ("ctx", _p)]


@functools.cache
def _driver_launch():
    """libcuda's cuLaunchKernel with its argument types bound, or None where libcuda cannot be
    loaded by name (the cuda.bindings wrapper then)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    except (OSError, AttributeError):
        return None
    fn.argtypes = [_p, _u, _u, _u, _u, _u, _u, _u, _p, _p, _p]
    fn.restype = ctypes.c_int
    return fn


class _GraphApi:
    """The graph functions of libcuda, argument types bound."""

    def __init__(self, lib: ctypes.CDLL):
        def bind(name, *argtypes):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            return fn

        pp, node_params = ctypes.POINTER(_p), ctypes.POINTER(KernelNodeParams)
        self.create = bind("cuGraphCreate", pp, _u)
        self.add_kernel = bind("cuGraphAddKernelNode_v2", pp, _p, pp, ctypes.c_size_t,
                               node_params)
        self.instantiate = bind("cuGraphInstantiateWithFlags", pp, _p, ctypes.c_ulonglong)
        self.set_params = bind("cuGraphExecKernelNodeSetParams_v2", _p, _p, node_params)
        self.launch = bind("cuGraphLaunch", _p, _p)
        self.destroy_exec = bind("cuGraphExecDestroy", _p)
        self.destroy = bind("cuGraphDestroy", _p)


@functools.cache
def graph_api() -> _GraphApi | None:
    """libcuda's graph functions, or None where libcuda or one of them is missing (a driver
    older than CUDA 12): calls then launch their kernels one by one."""
    try:
        return _GraphApi(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed: CUresult {err}")


class Launch:
    """One kernel launch with its arguments packed once: `args` (a ctypes struct) holds the
    kernel's parameters field by field. Per call only pointer fields change, then one
    `cuLaunchKernel` on the given stream."""

    def __init__(self, func, grid, block, smem, args: ctypes.Structure):
        self.func, self.grid, self.block, self.smem, self.args = func, grid, block, smem, args
        base = ctypes.addressof(args)
        offsets = [getattr(type(args), f[0]).offset for f in args._fields_]
        # kernelParams: one pointer to each parameter, in the kernel's order
        self._ptrs = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        raw = _driver_launch()
        if raw is not None:
            self._raw = raw
            # converted to the argument types once: ctypes passes instances of them as they are,
            # only the stream is converted per call (timeit, a stand-in of this signature:
            # 1.8 -> 1.1 us a call)
            self._head = tuple(t(v) for t, v in zip(raw.argtypes, (int(func), *grid, *block, smem)))
            self._params = ctypes.c_void_p(ctypes.addressof(self._ptrs))
        else:  # no libcuda by name: the cuda.bindings wrapper
            from cuda.bindings import driver

            self._raw = None
            self._launch, self._ok = driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS
            self._head = (func, *grid, *block, smem)
            self._tail = (ctypes.addressof(self._ptrs), 0)

    def node_params(self) -> KernelNodeParams:
        """This launch as a graph kernel node; its `kernelParams` point at the packed `args`, so
        setting the node copies their values at that moment."""
        return KernelNodeParams(int(self.func), *self.grid, *self.block, self.smem,
                                ctypes.addressof(self._ptrs), None, None, None)

    def __call__(self, stream: int) -> None:
        if self._raw is not None:
            err = self._raw(*self._head, stream, self._params, None)
            if err:
                raise RuntimeError(f"cuLaunchKernel failed: CUresult {err}")
            return
        (err,) = self._launch(*self._head, stream, *self._tail)
        if err != self._ok:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


class _Graph:
    """One instantiated graph of a LaunchGraph's launches (each node after the one before); its
    driver objects are destroyed with it (an exec still running is freed when it completes).
    With a `layout` and the C runner built (kernels.native), `runner` does a call's tail in C."""

    def __init__(self, api: _GraphApi, launches, layout=None):
        self.nodes = [launch.node_params() for launch in launches]
        graph, exe = _p(), _p()
        _check(api.create(ctypes.byref(graph), 0), "cuGraphCreate")
        self._finalizer = weakref.finalize(self, _destroy, api, graph, exe)
        self._finalizer.atexit = False  # the driver may be gone by then
        handles = []
        for params in self.nodes:
            node, deps = _p(), (_p * 1)(*handles[-1:])
            _check(api.add_kernel(ctypes.byref(node), graph, deps, len(handles[-1:]),
                                  ctypes.byref(params)), "cuGraphAddKernelNode")
            handles.append(node)
        _check(api.instantiate(ctypes.byref(exe), graph, 0), "cuGraphInstantiate")
        # per call: (exec, node, its params, the packed arguments) for each set, then (exec,
        # stream) for the launch
        self._sets = [(api.set_params, exe, node, ctypes.byref(params), launch.args)
                      for node, params, launch in zip(handles, self.nodes, launches)]
        self._set = [bytes(launch.args) for launch in launches]  # what each node holds
        self.version = None  # the LaunchGraph version the nodes were last compared at
        self._launch, self.exe = api.launch, exe
        self.runner = _runner(api, exe, handles, self.nodes, launches, layout)

    def __call__(self, stream: int, version: int) -> None:
        # After a change to the launches' arguments (`version`, LaunchGraph.touch) a node is set
        # only when its arguments differ from what it holds: bytes() of a 120-384 byte struct
        # costs less than the driver call it saves. A decode loop over static buffers sets none
        # and compares none.
        if version != self.version:
            for i, (set_params, exe, node, params, args) in enumerate(self._sets):
                now = bytes(args)
                if now != self._set[i]:
                    _check(set_params(exe, node, params), "cuGraphExecKernelNodeSetParams")
                    self._set[i] = now
            self.version = version
        err = self._launch(self.exe, stream)
        if err:
            raise RuntimeError(f"cuGraphLaunch failed: CUresult {err}")


def _runner(api, exe, handles, nodes, launches, layout):
    """The C runner of one graph (kernels/host/graph_runner.c), or None: no layout, the runner
    not built here, or driver functions that are no C functions (a test's stand-ins)."""
    if layout is None:
        return None
    from drafter_attn.kernels import native

    module = native.graph_runner()
    if module is None:
        return None
    n_tensors, n_sources, writes, *aligns = layout
    try:
        launch, set_params = (ctypes.cast(fn, _p).value for fn in (api.launch, api.set_params))
    except ctypes.ArgumentError:
        return None
    try:
        return module.Runner(launch, set_params, exe.value, n_tensors, n_sources,
                             [(h.value, ctypes.addressof(params), ctypes.addressof(launch_.args),
                               w) for h, params, launch_, w in zip(handles, nodes, launches,
                                                                   writes)], *aligns)
    except (TypeError, ValueError, OverflowError):  # a layout it cannot take: the Python path
        return None


def _destroy(api: _GraphApi, graph: ctypes.c_void_p, exe: ctypes.c_void_p) -> None:
    if exe:
        api.destroy_exec(exe)
    if graph:
        api.destroy(graph)


class LaunchGraph:
    """The launches of one call, in order, on one stream: as one graph launch per call outside a
    capture (a graph per stream, instantiated on that stream's first call), one by one inside
    a capture or where the driver has no graph API. Callers serialise calls (a plan's lock):
    the launches' packed arguments are shared."""

    def __init__(self, launches, device: int | None = None, layout=None):
        """`layout`: (n_tensors, n_sources, writes[, aligns]) for the C runner: a call passes
        n_tensors tensors then n_sources - n_tensors ints, each launch's `writes` ((byte offset
        in its packed arguments, source index), ...) say where each one's pointer goes, and
        `aligns` ((name, bytes), ...) what each tensor's pointer must be a multiple of (the
        runner raises ValueError before any launch); None: no runner."""
        self.launches, self.device, self.layout = tuple(launches), device, layout
        self.graphs: dict[int, _Graph] = {}  # by raw stream handle
        # the C runners of the graphs that have one, by stream: `runners[stream](stream,
        # *tensors, *ints)` is a whole eager call's launch (the owner's lock held)
        self.runners: dict[int, object] = {}
        self.no_graph: str | None = None  # why calls launch one by one outside a capture
        self.version = 0  # bumped by `touch`

    def touch(self) -> None:
        """Say that some launch's arguments changed: each stream's graph compares its nodes
        with them on its next call (and sets those that differ). Until then it compares
        nothing."""
        self.version += 1

    def __call__(self, stream: int, captured: bool) -> None:
        """Launch on `stream`; `captured`: whether that stream is being captured."""
        if not captured:
            graph = self.graphs.get(stream) or self._instantiate(stream)
            if graph is not None:
                graph(stream, self.version)
                return
        for launch in self.launches:
            launch(stream)

    def _instantiate(self, stream: int) -> _Graph | None:
        """The stream's graph, built in the device's context; None (and `no_graph` says why)
        where the driver cannot build one: the kernels then launch one by one, as before."""
        api = graph_api()
        if api is None:
            self.no_graph = "no libcuda graph API through ctypes"
        if self.no_graph:
            return None
        if len(self.graphs) >= GRAPH_STREAMS:
            oldest = next(iter(self.graphs))
            del self.graphs[oldest]
            self.runners.pop(oldest, None)
        try:
            with torch.cuda.device(self.device) if self.device is not None \
                    else contextlib.nullcontext():
                graph = self.graphs[stream] = _Graph(api, self.launches, self.layout)
        except RuntimeError as err:  # a call never fails for want of a graph
            self.no_graph = str(err)
            return None
        if graph.runner is not None:
            self.runners[stream] = graph.runner
        return graph


# torch's "is the current stream capturing", bound without its Python wrapper (a CPU-only build
# of torch has no such function, and nothing launches there).
capturing = (torch._C._cuda_isCurrentStreamCapturing if torch.cuda._is_compiled()
             else lambda: False)
