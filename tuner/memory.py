"""Memory of a decode step: K/V bytes of the workload per layout, and workspace / peak bytes.

KV bytes are a model of the workload (kernels.footprint), not of an allocation: a paged cache holds
ceil((P + Qb) / page_size) pages per request (its context plus room for the store), an arena holds
one slot of max_ctx = P + Qb tokens per request (dense, whatever the real lengths). Workspace and
peak come from torch's allocator around one eager step (backends allocate through torch).

`measurement_bytes` / `baseline_bytes` estimate, from the sizes alone, the GPU memory measuring a
step (or a baseline) takes at its peak: bench decode / prefill and the attention table refuse,
before measuring, a row that would not fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from drafter_attn.kernels import footprint
from drafter_attn.kernels.spec import Problem


def kv_bytes_for(problem: Problem, max_ctx: int | None = None, store_rows: int | None = None) -> int:
    """K and V bytes over all layers for `batch` requests at `ctx_len` (+ room for a store of
    `store_rows` rows, default Qb). `max_ctx` overrides the arena's per-slot capacity (a
    deployment sizes it for its longest request; the default is the workload's own P + rows)."""
    g, p = problem.geometry, problem
    tokens = p.ctx_len + (g.block_size if store_rows is None else store_rows)
    if p.layout == "paged":
        return footprint.paged_kv_bytes(g, p.batch, tokens, p.page_size)
    return footprint.arena_bytes(g, p.batch, max_ctx or tokens)


@dataclass(frozen=True)
class StepMemory:
    kv_bytes: int  # the workload's K/V (model above)
    workspace_bytes: int  # allocated during the step beyond what was live before it (outputs,
    #                       any scratch; the cupy/cutlass split-KV partials are kept per plan and
    #                       stream from the warm-up on, so they show in peak_bytes only)
    peak_bytes: int  # the allocator's peak during the step: everything the step holds, K/V
    #                  included (not what was live before it was built: the L2 flush's buffer)

    def as_dict(self) -> dict:
        return asdict(self)


def measure_step_memory(fn, kv_bytes: int, device=None, outside: int = 0) -> StepMemory:
    """Run `fn` once eagerly (after a warm-up elsewhere) and read torch's allocator around it.
    `outside`: bytes that were live before the step was built and are not its own (the L2
    flush's buffer, what earlier measurements of the process keep), left out of the peak."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return StepMemory(kv_bytes, peak - before, peak - outside)


# ---------------------------------------------------------------------------------------------
# What a measurement allocates on the GPU (over the memory model, kernels.footprint)

USABLE_FRACTION = 0.92  # of the GPU's memory: the CUDA context, cubins, allocator slack
_OVERHEAD_BYTES = 1 << 30
_MAX_SPLITS = 64  # kernels.cupy_backend.choose_splits' cap


def measurement_bytes(geometry, layout: str, page_size: int | None, batch: int, ctx: int, rows: int,
                      table_capacity: int | None = None) -> int:
    """Peak GPU bytes of measuring one step (tuner.step.DecodeStep through tuner.measure), an
    estimate from the sizes alone:

      the step's caches       every layer: the pages the context and the stored rows need (the
                              pool holds no more, whatever the table's width, and one spare), or a
                              dense arena slot of ctx + rows per request
      + the larger of         the correctness check: one more layer's cache and its copy for the
                              reference, and the reference's float32 temporaries over one chunk
                              of requests gathered to the table's capacity
                              the read floor: a buffer of the step's bytes (every layer's K/V)
      + split-KV partials (at most 64 splits) and 1 GiB for the rest.
    """
    from drafter_attn.tuner.step import _REFERENCE_TOKENS  # the reference check's chunk

    g = geometry
    e = footprint.DTYPE_BYTES[g.dtype]
    tokens = ctx + rows
    if layout == "paged":
        pages = batch * footprint.pages_for(tokens, page_size) + 1
        layer = footprint.kv_bytes(pages * page_size, g.num_kv_heads, g.head_dim, 1, e)
        capacity = table_capacity or footprint.pages_for(tokens, page_size) * page_size
    else:
        layer = footprint.kv_bytes(batch * tokens, g.num_kv_heads, g.head_dim, 1, e)
        capacity = tokens
    caches = g.num_layers * layer
    chunk = min(batch, max(1, _REFERENCE_TOKENS // max(1, capacity)))
    per_token = g.num_kv_heads * g.head_dim * (4 * e + 8) + g.num_q_heads * g.block_size * 12
    check = 2 * layer + chunk * (capacity + g.block_size) * per_token
    floor = footprint.kv_bytes(batch * tokens, g.num_kv_heads, g.head_dim, g.num_layers, e)
    partials = footprint.partials_bytes(batch, g.num_kv_heads, g.block_size * g.group, g.head_dim,
                                        _MAX_SPLITS)
    return caches + max(check, floor) + partials + _OVERHEAD_BYTES


def baseline_bytes(geometry, page_size: int, batch: int, ctx: int, layers: int = 1) -> int:
    """Peak GPU bytes of measuring a baseline (kernels.baselines: `layers` layers' pages holding
    the context and the block, its workspace) and its read floor (a buffer of the same bytes)."""
    from drafter_attn.kernels.baselines import _WORKSPACE_BYTES

    pages = footprint.paged_kv_bytes(geometry.with_(num_layers=1), batch, ctx + geometry.block_size,
                                     page_size)
    return 2 * layers * pages + _WORKSPACE_BYTES + _OVERHEAD_BYTES
