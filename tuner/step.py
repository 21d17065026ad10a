"""A whole drafter decode step for one Problem on one backend: what the tuner times and the bench
compares.

    step = DecodeStep(problem, "cupy", {"tile_n": 64}, accepted=12.5)
    step.check()                     # one layer against kernels.reference, fresh inputs -> rel err
    graph = timing.capture(step.run) # no host sync inside: captures into a CUDA graph
    step.attention_only, step.store_only    # the two halves, for the split
    step.kv_bytes, step.bytes_moved         # memory of the workload, roofline bytes

Per layer (`geometry.num_layers` of them) the step holds a random context cache (never zeros) of
`batch` requests at `ctx_len` tokens each, paged (random page order, room for the store) or arena,
the block's q / k_blk / v_blk, and the Qb rows of the previous block to store, of which
`num_new[b]` are valid (a device tensor). `run()` does, for each layer, the store then the
attention, as a serving engine does after verification.

`table_capacity` (paged only) sizes the block table for that many tokens, as an engine sizes it
for the model's longest context, while the pool still holds only the pages the context needs;
`max_ctx_hint` passes the attention the host-side bound `max_ctx` = ctx_len + the stored rows
(what an engine knows without a device read), so the split is planned from the real length.

The step is re-runnable: each layer's `ctx_lens` lives in one [layers, batch] device tensor that
`run()` first resets by a device copy from the saved start lengths, so every replay of a captured
graph stores the same rows and attends the same lengths. Only the host builds and checks; a run
never reads a device value.
"""

from __future__ import annotations

import math
import random

import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.cache import _randn, random_arena_context, random_paged_context
from drafter_attn.kernels.contract import hint_kwargs
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import memory, roofline

# Relative error (Frobenius) above which an attention output is wrong, per dtype.
TOLERANCE = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 1e-4}
# Reference attention runs in request chunks of about this many context tokens (bounds its memory).
_REFERENCE_TOKENS = 1 << 18


class CorrectnessError(RuntimeError):
    """A backend disagrees with kernels.reference on the step's problem."""


def roofline_bytes(problem: Problem, num_new_rows: list[int]) -> tuple[int, int]:
    """(attention, store) least HBM bytes of a decode step over every layer, from the shapes
    alone: the attention reads the context after the store (`num_new_rows` a request)."""
    g = problem.geometry
    item = g.torch_dtype.itemsize
    lens = [problem.ctx_len + n for n in num_new_rows]
    return (g.num_layers * roofline.attention_bytes(g, lens, item, problem.page_size),
            g.num_layers * roofline.store_bytes(g, num_new_rows, item))


def decode_bytes(problem: Problem, accepted: float | None = None) -> int:
    """`DecodeStep(problem, accepted=accepted).bytes_moved` without building the step."""
    return sum(roofline_bytes(problem, accepted_rows(problem.batch, problem.geometry.block_size,
                                                     accepted)))


def accepted_rows(batch: int, block_size: int, accepted: float | None = None) -> list[int]:
    """Rows stored per request (`num_new`), deterministic, with mean `accepted` (default: Qb).

    round(accepted * batch) rows are spread as evenly as possible; which requests get the extra
    row is a fixed shuffle, so neighbours differ as they would in a real batch.
    """
    if accepted is None:
        return [block_size] * batch
    if not 0 < accepted <= block_size:
        raise ValueError(f"accepted={accepted} must lie in (0, block_size={block_size}]")
    base, extra = divmod(round(accepted * batch), batch)
    order = list(range(batch))
    random.Random(batch * 1009 + block_size).shuffle(order)
    rows = [base] * batch
    for b in order[:extra]:
        rows[b] += 1
    return rows


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def _poison_allocator(like: torch.Tensor) -> None:
    """Fill the block the next same-sized allocation gets with NaN (caching allocator), so an
    output element a kernel never writes shows as NaN."""
    torch.full_like(like, float("nan"))


class DecodeStep:
    """One decode step of `problem.geometry.num_layers` layers; see the module docstring.

    `backend` is a registry name or a backend object; `params` (may be empty) are bound with
    `with_params`. `accepted` is the mean number of rows stored per request (default Qb).
    `table_capacity`: tokens the block table addresses (paged; None: fitted to the context and
    the store); `max_ctx_hint`: pass the attention `max_ctx` (see the module docstring).
    """

    def __init__(self, problem: Problem, backend="cupy", params: dict | None = None, *,
                 accepted: float | None = None, device="cuda", seed: int = 0,
                 table_capacity: int | None = None, max_ctx_hint: bool = False):
        self.problem = problem
        self.table_capacity = table_capacity
        if table_capacity is not None:
            need = problem.ctx_len + self.store_rows
            if problem.layout != "paged":
                raise ValueError("table_capacity sizes a block table: paged layout only")
            if not isinstance(table_capacity, int) or table_capacity < need:
                raise ValueError(f"table_capacity={table_capacity!r} tokens cannot hold the context "
                                 f"{problem.ctx_len} plus the {self.store_rows} stored rows")
        # The host-side bound an engine knows: the committed length plus the rows stored.
        self.max_ctx = problem.ctx_len + self.store_rows if max_ctx_hint else None
        impl = registry.get(backend) if isinstance(backend, str) else backend
        # always a bound copy: its plans (split workspaces) are this step's and go with it, where
        # the registry's shared instance would keep every measured problem's for the process
        self.backend = impl.with_params(**(params or {}))
        self.params = dict(params or {})
        self.device = torch.device(device)
        self.seed = seed
        g = problem.geometry
        self.paged = problem.layout == "paged"
        self.num_new_rows = accepted_rows(problem.batch, g.block_size, accepted)
        self.num_new = torch.tensor(self.num_new_rows, dtype=torch.int32, device=self.device)
        if self.paged:
            self._attend_fn, self._store_fn = self.backend.paged_attention, self.backend.store_paged
        else:
            self._attend_fn, self._store_fn = self.backend.arena_attention, self.backend.store_arena

        gen = torch.Generator().manual_seed(seed)
        contexts, blocks = [], []
        for _ in range(g.num_layers):
            contexts.append(self._context(gen))
            blocks.append(self._block(gen))
        self.k_cache = [c[0] for c in contexts]
        self.v_cache = [c[1] for c in contexts]
        # One block table (or slot list) addresses every layer, as in a serving pool; the other
        # layers' tables are the same shape and discarded.
        self.table, start = contexts[0][2], contexts[0][3]
        self.q, self.k_blk, self.v_blk, self.k_new, self.v_new = (list(t) for t in zip(*blocks))
        L = g.num_layers
        self._lens_start = start.expand(L, -1).contiguous()
        self._lens_stored = (self._lens_start + self.num_new).contiguous()
        self._lens = self._lens_start.clone()
        self.ctx_lens = list(self._lens.unbind(0))  # per-layer views, each contiguous [B]

    # -- building -------------------------------------------------------------------------------
    @property
    def store_rows(self) -> int:
        """Rows per request each store writes (k_new's T): the block's Qb in a decode step."""
        return self.problem.geometry.block_size

    def _context(self, gen):
        """Random context of one layer -> (k, v, block_table or slots, ctx_lens), with room for a
        store of `store_rows` rows per request."""
        p, g = self.problem, self.problem.geometry
        lens = [p.ctx_len] * p.batch
        if self.paged:
            ps = p.page_size
            extra = math.ceil((p.ctx_len + self.store_rows) / ps) - math.ceil(p.ctx_len / ps)
            width = None if self.table_capacity is None else math.ceil(self.table_capacity / ps)
            return random_paged_context(g, lens, ps, self.device, gen, extra_pages=extra, max_pages=width)
        return random_arena_context(g, lens, p.ctx_len + self.store_rows, self.device, gen, extra_slots=0)

    def _block(self, gen):
        """Random q, k_blk, v_blk of the block and k_new, v_new of the rows to store."""
        p, g = self.problem, self.problem.geometry
        q_shape = (p.batch, g.block_size, g.num_q_heads, g.head_dim)
        kv_shape = (p.batch, g.block_size, g.num_kv_heads, g.head_dim)
        new_shape = (p.batch, self.store_rows, g.num_kv_heads, g.head_dim)
        return tuple(_randn(s, g, self.device, gen) for s in (q_shape, kv_shape, kv_shape, new_shape, new_shape))

    # -- the step -------------------------------------------------------------------------------
    def _store(self, layer: int) -> None:
        self._store_fn(self.k_new[layer], self.v_new[layer], self.num_new, self.k_cache[layer],
                       self.v_cache[layer], self.table, self.ctx_lens[layer])

    @property
    def _hint(self) -> dict:
        return hint_kwargs(self.max_ctx)

    def _attend(self, layer: int) -> torch.Tensor:
        g = self.problem.geometry
        return self._attend_fn(self.q[layer], self.k_blk[layer], self.v_blk[layer], self.k_cache[layer],
                               self.v_cache[layer], self.table, self.ctx_lens[layer],
                               mask=g.mask, window=g.window, **self._hint)

    def reset(self) -> None:
        """Context lengths back to the start of the step (device copy; capturable)."""
        self._lens.copy_(self._lens_start)

    def run(self) -> list[torch.Tensor]:
        """The whole step: reset lengths, then for each layer the store, then the attention."""
        self.reset()
        outs = []
        for layer in range(self.problem.geometry.num_layers):
            self._store(layer)
            outs.append(self._attend(layer))
        return outs

    def attention_only(self) -> list[torch.Tensor]:
        """The attention of every layer over the stored context (lengths set to after the store).

        The lengths are set by eager calls only: attention never changes them, so a graph
        captured from this holds the attention kernels alone, timed as a baseline's call is
        (capture() runs the function eagerly before capturing it)."""
        if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
            self._lens.copy_(self._lens_stored)
        return [self._attend(layer) for layer in range(self.problem.geometry.num_layers)]

    def store_only(self) -> None:
        """The store of every layer (lengths reset first)."""
        self.reset()
        for layer in range(self.problem.geometry.num_layers):
            self._store(layer)

    # -- accounting -----------------------------------------------------------------------------
    @property
    def kv_bytes(self) -> int:
        """K/V bytes of the workload over all layers (memory.kv_bytes_for)."""
        return memory.kv_bytes_for(self.problem, store_rows=self.store_rows)

    @property
    def attention_bytes(self) -> int:
        """Least HBM bytes of every layer's attention (over the context after the store)."""
        return roofline_bytes(self.problem, self.num_new_rows)[0]

    @property
    def store_bytes(self) -> int:
        return roofline_bytes(self.problem, self.num_new_rows)[1]

    @property
    def bytes_moved(self) -> int:
        """Roofline bytes of the whole step (store + attention, every layer)."""
        return self.attention_bytes + self.store_bytes

    # -- correctness ----------------------------------------------------------------------------
    def check(self, seed: int | None = None) -> float:
        """One layer's store and attention against kernels.reference on fresh random inputs (same
        shapes as the step), the output poisoned with NaN first. Returns the attention's relative
        error; raises CorrectnessError when the store differs at all, or the output has NaN/inf
        or a relative error above TOLERANCE[dtype]."""
        p, g = self.problem, self.problem.geometry
        gen = torch.Generator().manual_seed(self.seed + 7919 if seed is None else seed)
        k, v, table, lens = self._context(gen)
        q, kb, vb, kn, vn = self._block(gen)
        k_ref, v_ref, lens_ref = k.clone(), v.clone(), lens.clone()
        ref_store = reference.store_paged if self.paged else reference.store_arena
        ref_attend = reference.paged_attention if self.paged else reference.arena_attention

        self._store_fn(kn, vn, self.num_new, k, v, table, lens)
        ref_store(kn, vn, self.num_new, k_ref, v_ref, table, lens_ref)
        for name, got, want in (("ctx_lens", lens, lens_ref), ("k cache", k, k_ref), ("v cache", v, v_ref)):
            if not torch.equal(got, want):
                raise CorrectnessError(f"{self._name()}: the store wrote a different {name} than the reference")

        _poison_allocator(q)
        out = self._attend_fn(q, kb, vb, k, v, table, lens, mask=g.mask, window=g.window, **self._hint)
        # The reference in request chunks: its memory grows with batch x capacity.
        capacity = (table.shape[1] * p.page_size) if self.paged else k.shape[1]
        chunk = max(1, _REFERENCE_TOKENS // max(1, capacity))
        want = torch.cat([
            ref_attend(q[b:b + chunk], kb[b:b + chunk], vb[b:b + chunk], k_ref, v_ref,
                       table[b:b + chunk], lens_ref[b:b + chunk], mask=g.mask, window=g.window)
            for b in range(0, p.batch, chunk)
        ])
        if out.shape != want.shape:
            raise CorrectnessError(f"{self._name()}: attention output has shape {tuple(out.shape)}, "
                                   f"expected {tuple(want.shape)}")
        if not bool(torch.isfinite(out).all()):
            raise CorrectnessError(f"{self._name()}: attention output has NaN/inf "
                                   f"(elements left unwritten, or an overflow)")
        err = relative_error(out, want)
        tol = TOLERANCE[g.dtype]
        if not err <= tol:
            raise CorrectnessError(f"{self._name()}: attention relative error {err:.3e} exceeds {tol:.0e}")
        return err

    def _name(self) -> str:
        p = self.problem
        layout = f"paged(page_size={p.page_size})" if self.paged else "arena"
        table = "" if self.table_capacity is None else f" table={self.table_capacity}"
        hint = "" if self.max_ctx is None else f" max_ctx={self.max_ctx}"
        return f"backend {self.backend.name!r} {layout} B={p.batch} ctx={p.ctx_len}{table}{hint}"
