"""The `cupy` backend: hand-written CUDA C++ (kernels/cuda/drafter_attention.cu) compiled with
NVRTC and launched through CuPy on torch's current stream, on the torch tensors themselves.

Host work per call is shape arithmetic only (grid, split count, workspace size): nothing reads a
device value, so a step runs under ``torch.cuda.set_sync_debug_mode("error")`` and captures into
a CUDA graph. Data-dependent work (which tiles a request reads, where a split starts) is decided
on the device from ``ctx_lens``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch

from drafter_attn.kernels import contract
from drafter_attn.kernels.nvrtc import compile_for_device
from drafter_attn.kernels.spec import Geometry, Problem

SOURCE = "drafter_attention.cu"
HEAD_DIMS = (64, 128)
PAGE_SIZES = tuple(2**k for k in range(3, 9))  # 8 .. 256
MAX_ROWS = 256  # Qb * G rows packed per CTA: 16 warps of 16 rows
MASK_CODE = {"full": 0, "sliding": 1, "sliding_causal": 2}
SMEM_LIMIT = 227 * 1024  # opt-in dynamic shared memory per block on SM90/SM100
SMEM_PER_SM = 228 * 1024
REGS_PER_SM = 65536
_COUNTER_SLOTS = 65536  # max batch of one store launch


@dataclass(frozen=True)
class Params:
    """Tunable knobs. `num_splits=0` means: pick from the batch, heads and capacity (device-side
    balancing spreads the actual context over the splits). `q_smem` keeps Q in shared memory
    instead of registers (for CTAs of many warps, whose per-thread register budget is small).
    `wgmma` (sm_90a only) computes both products with warpgroup MMAs; None = wherever it runs."""

    tile_n: int = 64
    stages: int = 3
    num_splits: int = 0
    q_smem: bool = False
    wgmma: bool | None = None
    min_ctas: int = 1  # occupancy the compiler must fit (caps registers per thread)
    skip_compute: bool = False  # diagnostic: loads only, output is garbage (never a default)

    def smem_bytes(self, head_dim: int, warps: int, wgmma: bool = False) -> int:
        return smem_bytes(self.tile_n, self.stages, head_dim, warps if self.q_smem else 0, wgmma)


def smem_bytes(tile_n: int, stages: int, head_dim: int, q_warps: int = 0,
               wgmma: bool = False) -> int:
    """K and V stages (rows padded by 16 bytes for ldmatrix, unpadded core matrices for wgmma),
    plus Q rows (padded) when Q lives in shared memory."""
    kv_row = head_dim if wgmma else head_dim + 8
    return 2 * stages * tile_n * kv_row * 2 + 16 * q_warps * (head_dim + 8) * 2


def num_warps(block_size: int, group: int) -> int:
    """16 packed query rows per warp, and at least 4 warps so loads keep enough bytes in flight."""
    return max(4, -(-block_size * group // 16))


def wgmma_fits(head_dim: int, warps: int, tile_n: int) -> bool:
    """Shapes the wgmma path compiles for: whole warpgroups, whole warps per tile load."""
    return (warps % 4 == 0 and tile_n in (32, 64, 128) and head_dim in (64, 128)
            and (tile_n * head_dim // 8) % (warps * 32) == 0)


def use_wgmma(params: Params, head_dim: int, warps: int, sm: int) -> bool:
    if params.wgmma is None:
        return sm == 90 and wgmma_fits(head_dim, warps, params.tile_n)
    if params.wgmma and (sm != 90 or not wgmma_fits(head_dim, warps, params.tile_n)):
        raise ValueError(f"wgmma=True needs sm_90 and a fitting shape (sm={sm}, "
                         f"head_dim={head_dim}, warps={warps}, tile_n={params.tile_n})")
    return params.wgmma


def default_params(problem: Problem | None = None, **overrides) -> Params:
    """Fast-without-tuning defaults, chosen so no default variant spills on sm_90a/100a/103a:
    above 8 warps (registers are allocated per 4 warps, so 9 warps get the budget of 12) Q moves
    to shared memory, and pages under 64 tokens take smaller key tiles: the choices below are the
    ones ptxas compiles without spills on every target (checked by tests/test_static_profile)."""
    base = Params()
    if problem is not None:
        warps = num_warps(problem.geometry.block_size, problem.geometry.group)
        if warps > 8:
            page = problem.page_size if problem.layout == "paged" else None
            if page is None or page >= 64:
                base = Params(q_smem=True)
            elif page == 32:
                base = Params(tile_n=16, stages=6, q_smem=True)
            else:
                base = Params(tile_n=32, stages=4, q_smem=True)
    return dataclasses.replace(base, **overrides)


def problem_reason(problem: Problem, tile_n: int, head_dims=HEAD_DIMS,
                   page_sizes=PAGE_SIZES, max_rows: int = MAX_ROWS) -> str | None:
    """Checks every kernel family here shares: dtype, head_dim, rows per CTA, tile, page size."""
    g = problem.geometry
    if g.dtype not in ("bfloat16", "float16"):
        return f"dtype {g.dtype} not supported (bfloat16, float16)"
    if g.head_dim not in head_dims:
        return f"head_dim {g.head_dim} not compiled (supported: {head_dims})"
    if g.block_size * g.group > max_rows:
        return (f"Qb*G = {g.block_size}*{g.group} = {g.block_size * g.group} query rows exceed "
                f"{max_rows} per CTA")
    if g.block_size > tile_n:
        return f"block_size {g.block_size} exceeds tile_n {tile_n}"
    if problem.layout == "paged" and problem.page_size not in page_sizes:
        return f"page_size {problem.page_size} not supported ({page_sizes[0]}..{page_sizes[-1]})"
    return None


def supports(problem: Problem, params: Params | None = None) -> str | None:
    """None when the cupy kernels run this problem, else the reason they do not."""
    g = problem.geometry
    params = params or default_params(problem)
    reason = problem_reason(problem, params.tile_n)
    if reason:
        return reason
    if params.smem_bytes(g.head_dim, num_warps(g.block_size, g.group), bool(params.wgmma)) > SMEM_LIMIT:
        return f"tile_n={params.tile_n} stages={params.stages} needs more than 227 KB of smem"
    return None


def tunables(problem: Problem | None = None) -> dict[str, list]:
    return {
        "tile_n": [32, 64, 128],
        "stages": [2, 3, 4],
        "num_splits": [0, 1, 2, 4, 8, 16, 32],
        "q_smem": [False, True],
        "wgmma": [None, False],
    }


# --------------------------------------------------------------------------------------------
# compile + load


def common_defines(dtype: torch.dtype | str, head_dim: int, page_size: int | None,
                   block_size: int, group: int, params, wgmma: bool) -> dict[str, int]:
    """The compile-time knobs every kernel family takes (kernels/cuda/variant.cuh)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return dict(
        DTYPE_BF16=int(name == "bfloat16"),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size or 0,
        TILE_N=params.tile_n,
        NUM_WARPS=num_warps(block_size, group),
        STAGES=params.stages,
        Q_SMEM=int(params.q_smem),
        WGMMA=int(wgmma),
        MIN_CTAS=params.min_ctas,
    )


def variant_defines(dtype: torch.dtype | str, head_dim: int, page_size: int | None,
                    block_size: int, group: int, params: Params, sm: int) -> dict[str, int]:
    wgmma = use_wgmma(params, head_dim, num_warps(block_size, group), sm)
    return dict(common_defines(dtype, head_dim, page_size, block_size, group, params, wgmma),
                SKIP_COMPUTE=int(params.skip_compute))


# ptxas otherwise caps some variants at 128 registers and spills; occupancy is planned by hand.
NVRTC_OPTIONS = ("-maxrregcount=255",)


def compile_variant(defines: dict[str, int], sm: int):
    """For a GPU of SM `sm`: its exact arch, or PTX the driver JITs where NVRTC lacks it."""
    return compile_for_device(SOURCE, defines, sm, extra_options=NVRTC_OPTIONS)


@functools.cache
def _device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major * 10 + props.minor


_load_lock = threading.Lock()


@functools.cache
def _load(index: int, defines_items: tuple) -> "_Module":
    import cupy

    defines = dict(defines_items)
    _, sm = _device_info(index)
    result = compile_variant(defines, sm)
    with cupy.cuda.Device(index):
        mod = cupy.RawModule(path=str(result.cubin_path))
        attn = mod.get_function("drafter_attention")
        smem = smem_bytes(defines["TILE_N"], defines["STAGES"], defines["HEAD_DIM"],
                          defines["NUM_WARPS"] if defines["Q_SMEM"] else 0, defines["WGMMA"])
        attn.max_dynamic_shared_size_bytes = smem
        regs = attn.num_regs  # from the loaded cubin itself
    return _Module(attn, mod.get_function("drafter_combine"), mod.get_function("drafter_store"),
                   smem, regs, defines["NUM_WARPS"] * 32)


@dataclass
class _Module:
    attention: object
    combine: object
    store: object
    smem: int
    regs: int
    threads: int

    def resident_ctas(self) -> int:
        by_smem = SMEM_PER_SM // (self.smem + 1024)
        regs_per_warp = -(-self.regs * 32 // 256) * 256
        by_regs = REGS_PER_SM // (regs_per_warp * (self.threads // 32))
        return max(1, min(by_smem, by_regs, 32))


def _module(device: torch.device, dtype, head_dim, page_size, block_size, group, params) -> _Module:
    defines = variant_defines(dtype, head_dim, page_size, block_size, group, params,
                              _device_info(_index(device))[1])
    with _load_lock:
        return _load(_index(device), tuple(sorted(defines.items())))


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(t.data_ptr() if t is not None else 0)


_streams: dict[int, object] = {}


def _launch(fn, grid, block, args, smem=0):
    """Launch on torch's current stream (so graph capture and stream order follow torch)."""
    stream = torch.cuda.current_stream()
    ext = _streams.get(stream.cuda_stream)
    if ext is None:
        import warnings

        import cupy

        with warnings.catch_warnings():  # ExternalStream is deprecated in CuPy 14, still works
            warnings.simplefilter("ignore", DeprecationWarning)
            ext = cupy.cuda.ExternalStream(stream.cuda_stream, stream.device_index)
        _streams[stream.cuda_stream] = ext
    with ext:
        fn(grid, block, args, shared_mem=smem)


_counters: dict[int, torch.Tensor] = {}


def _store_counters(device: torch.device, batch: int) -> torch.Tensor:
    """Zeroed per-request arrival counters for the store kernel (it leaves them zeroed)."""
    if batch > _COUNTER_SLOTS:
        raise ValueError(f"batch={batch} exceeds {_COUNTER_SLOTS} requests per store call")
    index = _index(device)
    buf = _counters.get(index)
    if buf is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("run one store eagerly before capturing a CUDA graph "
                               "(its counter buffer is allocated on first use)")
        buf = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[index] = buf
    return buf


# --------------------------------------------------------------------------------------------
# the backend


def choose_splits(batch: int, hkv: int, kv_tokens: int, tile_n: int, num_sms: int,
                  resident: int, max_splits: int = 64) -> int:
    """Split-KV count from a wave model: `batch * hkv * S` CTAs run in ceil(CTAs / slots) waves
    of `slots = SMs * resident` CTAs; a wave lasts one split's share of the KV tiles plus a fixed
    per-CTA cost (pipeline fill, epilogue, its share of the combine) of about two tiles."""
    ctas = batch * hkv
    slots = num_sms * resident
    tiles = max(1, -(-kv_tokens // tile_n))
    limit = max(1, min(max_splits, tiles // 2))
    best, best_cost = 1, float("inf")
    for s in range(1, limit + 1):
        cost = math.ceil(ctas * s / slots) * (tiles / s + 2)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


@dataclass(frozen=True)
class CupyBackend:
    """The four contract functions; `overrides` pin tunables (the rest follow default_params)."""

    overrides: tuple = ()
    name: str = "cupy"

    @property
    def _kernels(self):
        """The module of this backend's kernel family: Params, default_params, supports,
        tunables, HEAD_DIMS, PAGE_SIZES and _module (compile + load). kernels.cutlass_backend
        points it at itself and shares the rest of this class."""
        return sys.modules[__name__]

    # registry protocol -------------------------------------------------------------------
    def params_for(self, problem: Problem) -> Params:
        return self._kernels.default_params(problem, **dict(self.overrides))

    def supports(self, problem: Problem) -> str | None:
        return self._kernels.supports(problem, self.params_for(problem))

    def tunables(self, problem: Problem | None = None) -> dict[str, list]:
        return self._kernels.tunables(problem)

    def default_params(self, problem: Problem | None = None) -> dict:
        return dataclasses.asdict(self._kernels.default_params(problem))

    def with_params(self, **params) -> CupyBackend:
        from drafter_attn.kernels import registry

        params = registry.check_params(self, params)  # values become NVRTC options: typed, ranged
        merged = {**dict(self.overrides), **params}
        return dataclasses.replace(self, overrides=tuple(sorted(merged.items())))

    # contract ------------------------------------------------------------------------------
    def paged_attention(self, q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *,
                        mask="full", window=None, scale=None):
        dims = contract.check_paged(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens,
                                    mask, window, scale)
        return self._attention(dims, "paged", q, k_blk, v_blk, k_pages, v_pages, block_table,
                               ctx_lens, table_stride=block_table.shape[1], max_ctx=0)

    def arena_attention(self, q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *,
                        mask="full", window=None, scale=None):
        dims = contract.check_arena(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens,
                                    mask, window, scale)
        return self._attention(dims, "arena", q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens,
                               table_stride=1, max_ctx=k_arena.shape[1])

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens):
        contract.check_store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens)
        page_size = k_pages.shape[2]
        self._store(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens,
                    page_size=page_size, table_stride=block_table.shape[1],
                    capacity=block_table.shape[1] * page_size, max_ctx=0)

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens):
        contract.check_store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens)
        max_ctx = k_arena.shape[1]
        self._store(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens, page_size=None,
                    table_stride=1, capacity=max_ctx, max_ctx=max_ctx)

    # internals -----------------------------------------------------------------------------
    def _params(self, dims, layout: str) -> Params:
        problem = _problem(dims, layout)
        params = self.params_for(problem)
        reason = self._kernels.supports(problem, params)
        if reason:
            raise ValueError(f"the {self.name} backend cannot run this problem: {reason}")
        return params

    def plan_splits(self, dims, params: Params, device: torch.device) -> int:
        """Split count for a call (host shape arithmetic only, identical on every replay)."""
        p = params
        if p.num_splits:
            return p.num_splits
        mod = self._kernels._module(device, dims.dtype, dims.head_dim, dims.page_size,
                                    dims.block_size, dims.group, p)
        num_sms, _ = _device_info(_index(device))
        kv_tokens = dims.capacity if dims.mask == "full" else min(dims.capacity, dims.window)
        return choose_splits(dims.batch, dims.num_kv_heads, kv_tokens, p.tile_n, num_sms,
                             mod.resident_ctas())

    def _attention(self, dims, layout, q, k_blk, v_blk, k_cache, v_cache, table, ctx_lens, *,
                   table_stride, max_ctx):
        p = self._params(dims, layout)
        mod = self._kernels._module(q.device, q.dtype, dims.head_dim, dims.page_size,
                                    dims.block_size, dims.group, p)
        splits = self.plan_splits(dims, p, q.device)
        out = torch.empty_like(q)
        rows = dims.block_size * dims.group
        o_part = lse_part = None
        if splits > 1:
            o_part = torch.empty((splits, dims.batch, dims.num_kv_heads, rows, dims.head_dim),
                                 dtype=torch.float32, device=q.device)
            lse_part = torch.empty((splits, dims.batch, dims.num_kv_heads, rows),
                                   dtype=torch.float32, device=q.device)
        i32 = np.int32
        args = (_ptr(q), _ptr(k_blk), _ptr(v_blk), _ptr(k_cache), _ptr(v_cache), _ptr(table),
                _ptr(ctx_lens), _ptr(out), _ptr(o_part), _ptr(lse_part),
                i32(dims.block_size), i32(dims.num_q_heads), i32(dims.num_kv_heads),
                i32(dims.group), i32(table_stride), i32(dims.capacity), i32(max_ctx),
                i32(MASK_CODE[dims.mask]), i32(dims.window or 0),
                np.float32(dims.scale * math.log2(math.e)))
        _launch(mod.attention, (splits, dims.num_kv_heads, dims.batch), (mod.threads,), args,
                mod.smem)
        if splits > 1:
            total_rows = dims.batch * dims.num_kv_heads * rows
            _launch(mod.combine, (-(-total_rows // 4),), (128,),
                    (_ptr(o_part), _ptr(lse_part), _ptr(out), i32(dims.batch),
                     i32(dims.block_size), i32(dims.num_q_heads), i32(dims.num_kv_heads),
                     i32(dims.group), i32(splits)))
        return out

    def _store(self, k_new, v_new, num_new, k_cache, v_cache, table, ctx_lens, *, page_size,
               table_stride, capacity, max_ctx):
        batch, rows, hkv, head_dim = k_new.shape
        head_dims, page_sizes = self._kernels.HEAD_DIMS, self._kernels.PAGE_SIZES
        if head_dim not in head_dims:
            raise ValueError(f"k_new: head_dim {head_dim} not compiled (supported: {head_dims})")
        if page_size is not None and page_size not in page_sizes:
            raise ValueError(f"k_pages: page_size {page_size} not supported "
                             f"({page_sizes[0]}..{page_sizes[-1]})")
        if rows == 0 or batch == 0:
            return
        counters = _store_counters(k_new.device, batch)
        # The store kernel only depends on head_dim and the page size; reuse the attention
        # module of a minimal geometry so a step loads one module per layout.
        mod = self._kernels._module(k_new.device, k_new.dtype, head_dim, page_size, 1, 1,
                                   self._kernels.Params())
        i32 = np.int32
        _launch(mod.store, (rows, batch), (128,),
                (_ptr(k_new), _ptr(v_new), _ptr(num_new), _ptr(k_cache), _ptr(v_cache),
                 _ptr(table), _ptr(ctx_lens), _ptr(counters), i32(rows), i32(hkv),
                 i32(table_stride), i32(capacity), i32(max_ctx)))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _problem(dims, layout: str) -> Problem:
    geom = Geometry(dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size,
                    dims.mask, dims.window, 1, str(dims.dtype).removeprefix("torch."))
    return Problem(geom, layout, dims.page_size, dims.batch, 0)


BACKEND = CupyBackend()
