"""The context step (a prompt chunk stored as a request arrives) and its measurement.

A decode step stores the Qb rows of the last verified block; a context step stores a whole prompt
chunk of `chunk` rows per request, every layer, then runs the drafter attention over the new
length (the request's first block is drafted right after). It is where blocking host copies
showed up in practice (per-request page arithmetic on the host), so it gets the same timing, split
and host-sync measurement as the decode step (`tuner.measure`).

`ContextStep` is a `tuner.step.DecodeStep` whose store writes `chunk` rows (all valid, a device
tensor) instead of the block's Qb rows; everything else, re-runnable graphs included, is the
decode step's.
"""

from __future__ import annotations

import math
import time
import traceback

import torch

from kernels.cache import ArenaKVCache, PagedKVPool, _randn, random_arena_context, random_paged_context
from tuner.step import DecodeStep


class ContextStep(DecodeStep):
    """Per layer: store a prompt chunk of `chunk` rows per request at [P, P + chunk), then the
    attention of the block at P + chunk. `problem.ctx_len` is P (0: a request's first chunk)."""

    def __init__(self, problem, backend="cupy", params=None, *, chunk: int, device="cuda", seed: int = 0):
        if not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
        self.chunk = chunk  # read by _context/_block while the base class builds the step
        super().__init__(problem, backend, params, accepted=None, device=device, seed=seed)
        self.num_new_rows = [chunk] * problem.batch
        self.num_new = torch.full((problem.batch,), chunk, dtype=torch.int32, device=self.device)
        self._lens_stored = (self._lens_start + self.num_new).contiguous()

    def _context(self, gen):
        p, g = self.problem, self.problem.geometry
        lens = [p.ctx_len] * p.batch
        if self.paged:
            ps = p.page_size
            extra = math.ceil((p.ctx_len + self.chunk) / ps) - math.ceil(p.ctx_len / ps)
            return random_paged_context(g, lens, ps, self.device, gen, extra_pages=extra)
        return random_arena_context(g, lens, p.ctx_len + self.chunk, self.device, gen, extra_slots=0)

    def _block(self, gen):
        p, g = self.problem, self.problem.geometry
        q_shape = (p.batch, g.block_size, g.num_q_heads, g.head_dim)
        blk_shape = (p.batch, g.block_size, g.num_kv_heads, g.head_dim)
        new_shape = (p.batch, self.chunk, g.num_kv_heads, g.head_dim)
        return tuple(_randn(s, g, self.device, gen)
                     for s in (q_shape, blk_shape, blk_shape, new_shape, new_shape))

    @property
    def kv_bytes(self) -> int:
        """K/V bytes of the workload: the context plus the chunk, per request, every layer."""
        p, g = self.problem, self.problem.geometry
        tokens = p.ctx_len + self.chunk
        if self.paged:
            pages = p.batch * math.ceil(tokens / p.page_size)
            return PagedKVPool.bytes_for(pages, p.page_size, g.num_kv_heads, g.head_dim, g.num_layers,
                                         g.torch_dtype)
        return ArenaKVCache.bytes_for(p.batch, tokens, g.num_kv_heads, g.head_dim, g.num_layers, g.torch_dtype)


def failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of a measurement that raised, in the profile database's terms."""
    from kernels.nvrtc import CompileError
    from tuner.step import CorrectnessError

    if isinstance(exc, CompileError):
        return "failed_compile", str(exc)[:4000]
    if isinstance(exc, CorrectnessError):
        return "failed_correctness", str(exc)
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return "failed_runtime", f"{type(exc).__name__}: {exc}{at}"[:4000]


def measure_context(wire: dict, chunk: int, *, reps: int = 0) -> dict:
    """Measure the context step of `wire` (Candidate.to_wire()) on the current GPU -> result
    columns, as tuner.measure.measure_candidate does for a decode step. Never raises."""
    from kernels import registry
    from tuner import memory, syncs
    from tuner.measure import time_step
    from tuner.spec import Candidate

    t0 = time.perf_counter()
    row: dict = {}
    step = None
    try:
        c = Candidate.from_wire(wire)
        backend = registry.get(c.impl)
        reason = backend.with_params(**c.params_dict).supports(c.problem)
        if reason:
            return dict(status="unsupported", reason=reason, elapsed_s=time.perf_counter() - t0)
        step = ContextStep(c.problem, backend, c.params_dict, chunk=chunk)
        row["rel_err"] = step.check()
        row.update(time_step(step, reps))
        row.update(memory.measure_step_memory(step.run, step.kv_bytes).as_dict())
        report = syncs.detect_syncs(step.run, graph=False)  # captured above by time_step
        report.notes[:] = [n for n in report.notes if not n.startswith("nsys layer")]
        report.notes.append("nsys layer: not run for context steps")
        row.update(report.as_row(), graph_capturable=True)
        row.update(status="ok", reason=None)
    except Exception as exc:
        row.update(zip(("status", "reason"), failure(exc)))
    finally:
        step = None  # noqa: F841 (frees the step's caches before empty_cache)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the next row's sizes differ: start from a clean pool
        except Exception as exc:  # a fault inside the step: the CUDA context is gone
            if row.get("status") == "ok":
                row.update(status="failed_runtime", reason=f"{type(exc).__name__}: {exc}")
    row["elapsed_s"] = time.perf_counter() - t0
    return row
