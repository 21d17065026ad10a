"""The `cutlass` backend: the drafter-attention algorithm of the cupy backend written with CuTe
(kernels/cuda/cute_drafter_attention.cu, headers from the nvidia-cutlass wheel), compiled with
NVRTC against the CUDA toolkit's own CCCL and launched through CuPy on torch's current stream.

Everything but the kernel family is shared with kernels.cupy_backend: the contract functions,
plans, split planning, workspaces, launches on torch's stream and the store counters come from
`CupyBackend`; this module supplies its `KernelFamily` (`CUTLASS`: Params, defaults, supports,
tunables, compile and load). The kernels take the same `DrafterParams` and defines as the cupy
ones; the split-KV combine and the context store are the same
code (kernels/cuda/combine_store.cuh) compiled into the CuTe module.

What it covers against cupy: the same problems (bf16/fp16, head_dim 64 and 128, Qb*G up to 256
rows, page sizes 8..256 and the arena, the three mask modes). The products run on SM80 mma.sync
atoms by default; `wgmma=True` runs them on SM90 warpgroup MMAs reading K/V from shared memory
where that can run (an sm_90 GPU, Qb*G rows in whole 64-row warpgroups) and keeps mma.sync
elsewhere. Unlike cupy's (wgmma=None: wherever it runs), the warpgroup path is opt-in here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import ClassVar

import torch

import cutlass_library  # the nvidia-cutlass wheel: CuTe headers (import fails without it)

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels.nvrtc import compile_for_device
from drafter_attn.kernels.spec import Problem

SOURCE = "cute_drafter_attention.cu"
HEAD_DIMS = (64, 128)
PAGE_SIZES = cb.PAGE_SIZES
MAX_ROWS = cb.MAX_ROWS
SMEM_LIMIT = cb.SMEM_LIMIT
# As for cupy: ptxas would otherwise cap some variants at 128 registers and spill.
NVRTC_OPTIONS = ("-maxrregcount=255",)


@functools.cache
def include_dir() -> str:
    """CUTLASS/CuTe headers shipped in the nvidia-cutlass wheel."""
    inc = os.path.join(cutlass_library.source_path, "include")
    if not os.path.exists(os.path.join(inc, "cute", "tensor.hpp")):
        raise FileNotFoundError(f"CuTe headers not found under {inc} (nvidia-cutlass wheel)")
    return inc


@functools.cache
def header_identity() -> str:
    """Part of the cubin cache key: the CUTLASS headers' version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"cutlass-{version('nvidia-cutlass')}"
    except PackageNotFoundError:
        return f"cutlass-{getattr(cutlass_library, '__version__', 'unknown')}"


@dataclass(frozen=True)
class Params:
    """Tunable knobs, as cupy's: `num_splits=0` picks the split count from the batch, heads and
    capacity; `q_smem` re-reads Q from shared memory per tile instead of holding it in
    registers; `min_ctas` is the __launch_bounds__ occupancy the compiler must fit; `wgmma`
    runs both products on warpgroup MMAs where it can (sm_90, whole 64-row warpgroups)."""

    tile_n: int = 64
    stages: int = 3
    num_splits: int = 0
    q_smem: bool = False
    min_ctas: int = 1
    wgmma: bool = False

    def smem_bytes(self, head_dim: int, warps: int) -> int:
        return smem_bytes(self.tile_n, self.stages, head_dim, warps, self.q_smem, self.wgmma)


def smem_bytes(tile_n: int, stages: int, head_dim: int, warps: int, q_smem: bool,
               wgmma: bool = False) -> int:
    """Dynamic shared memory of the CuTe kernel (mirrors kQRegs/kQAlias/kQOffset in the
    source): `stages` x (K + V tiles of tile_n rows), plus the Q tile of 16 * warps rows unless
    it borrows the last stage (Q held in registers, which only the mma.sync path does, and small
    enough); rows of head_dim + 8 elements (16 bytes of padding, as in the cupy kernel), or
    head_dim with wgmma (swizzled GMMA layouts; Q re-read from its own tile every KV tile)."""
    row = head_dim if wgmma else head_dim + 8
    stage = 2 * tile_n * row
    q_tile = 16 * warps * row
    alias = not q_smem and not wgmma and q_tile <= stage
    return 2 * (stages * stage + (0 if alias else q_tile))


num_warps = cb.num_warps


def default_params(problem: Problem | None = None, sm: int | None = None,
                   **overrides) -> Params:
    """Defaults for a GPU of SM `sm` (None: SM 90's), chosen so no default variant spills:
    CTAs of 4-8 warps take the K/V pipeline of the SM's budget (cupy_backend.SM_BUDGETS, the
    same per-SM table as cupy's), with stages taken off where the CuTe kernel's shared memory
    (its Q tile no longer borrowing a stage) would exceed the SM's. Above 8 warps (a CTA of
    9-12 warps gets the register budget of 12, 168 registers a thread) Q moves to shared memory
    and the key tile halves, on every SM. The CuTe kernel keeps a few more values live than
    cupy's: with 64-key tiles (or 32-key tiles in 4 stages) ptxas spills a few bytes at 9 warps
    on sm_90a."""
    return cb.sm_defaults(Params, dict(tile_n=32, stages=3, q_smem=True), problem, sm, overrides)


def supports(problem: Problem, params: Params | None = None, sm: int | None = None) -> str | None:
    """None when the cutlass kernels run this problem (on a GPU of SM `sm`, when given), else
    the reason they do not."""
    g = problem.geometry
    params = params or default_params(problem, sm)
    if params.tile_n not in (16, 32, 64, 128, 256):
        return f"tile_n {params.tile_n} must be a power of two from 16 to 256"
    if params.stages < 2:
        return f"stages {params.stages} < 2 (the cp.async pipeline needs two stages)"
    if params.stages > cb.PIPELINE_MAX_STAGES:
        return f"stages {params.stages} > {cb.PIPELINE_MAX_STAGES} (the deepest pipeline built and tested)"
    reason = cb.problem_reason(problem, params.tile_n, HEAD_DIMS, PAGE_SIZES, MAX_ROWS)
    if reason:
        return reason
    warps = num_warps(g.block_size, g.group)
    # with wgmma=True both kernels may run (mma.sync where the warpgroup path cannot): both fit
    need = max(smem_bytes(params.tile_n, params.stages, g.head_dim, warps, params.q_smem, wgmma)
               for wgmma in {False, bool(params.wgmma)})
    reason = cb.smem_limit_reason(need, sm)
    if reason:
        return f"tile_n={params.tile_n} stages={params.stages} q_smem={params.q_smem} {reason}"
    return None


def tunables(problem: Problem | None = None) -> dict[str, list]:
    return {
        "tile_n": [32, 64, 128],
        "stages": [2, 3, 4],
        "num_splits": [0, 1, 2, 4, 8, 16, 32],
        "q_smem": [False, True],
        "min_ctas": [1, 2],
        "wgmma": [False, True],
    }


# --------------------------------------------------------------------------------------------
# compile + load


def use_wgmma(params: Params, head_dim: int, warps: int, sm: int | None) -> bool:
    """Warpgroup MMAs run on sm_90 (sm_90a code) for whole 64-row warpgroups."""
    return bool(params.wgmma) and sm == 90 and warps % 4 == 0 and head_dim % 64 == 0


def variant_defines(dtype: torch.dtype | str, head_dim: int, page_size: int | None,
                    block_size: int, group: int, params: Params,
                    sm: int | None = None) -> dict[str, int]:
    """The cupy kernel's defines, so both backends share the variant machinery. `sm` is the
    compile target (None: any, which never gets the sm_90a-only warpgroup MMAs)."""
    wgmma = use_wgmma(params, head_dim, num_warps(block_size, group), sm)
    return cb.common_defines(dtype, head_dim, page_size, block_size, group, params, wgmma)


def defines_smem(defines: dict[str, int]) -> int:
    return smem_bytes(defines["TILE_N"], defines["STAGES"], defines["HEAD_DIM"],
                      defines["NUM_WARPS"], bool(defines["Q_SMEM"]), bool(defines["WGMMA"]))


def compile_variant(defines: dict[str, int], sm: int):
    """For a GPU of SM `sm`, as cupy_backend.compile_variant."""
    return compile_for_device(SOURCE, defines, sm, include_dirs=(include_dir(),),
                              extra_options=NVRTC_OPTIONS, header_identity=header_identity())


def _load(index: int, defines_items: tuple) -> cb.Module:
    defines = dict(defines_items)
    result = compile_variant(defines, cb.device_info(index)[1])
    return cb.load_cubin(index, result.cubin_path, defines_smem(defines), defines["NUM_WARPS"] * 32)


CUTLASS = cb.KernelFamily(__name__, Params, default_params, supports, tunables, variant_defines,
                          compile_variant, _load, HEAD_DIMS, PAGE_SIZES)


# --------------------------------------------------------------------------------------------
# the backend


@dataclass(frozen=True)
class CutlassBackend(cb.CupyBackend):
    """The four contract functions on the CuTe kernels; `overrides` pin tunables."""

    name: str = "cutlass"
    family: ClassVar[cb.KernelFamily] = CUTLASS


BACKEND = CutlassBackend()
