"""Memory of a decode step: K/V bytes of the workload per layout, and workspace / peak bytes.

KV bytes are a model of the workload (kernels.footprint), not of an allocation: a paged cache holds
ceil((P + Qb) / page_size) pages per request (its context plus room for the store), an arena holds
one slot of max_ctx = P + Qb tokens per request (dense, whatever the real lengths). Workspace and
peak come from torch's allocator around one eager step (backends allocate through torch).
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
    #                       split-KV partials, any scratch)
    peak_bytes: int  # the allocator's peak during the step (everything live, K/V included)

    def as_dict(self) -> dict:
        return asdict(self)


def measure_step_memory(fn, kv_bytes: int, device=None) -> StepMemory:
    """Run `fn` once eagerly (after a warm-up elsewhere) and read torch's allocator around it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return StepMemory(kv_bytes, peak - before, peak)
