"""KV caches of the two layouts (docs/design.md, "The two layouts"), their allocators, and test-data helpers.

Host-side bookkeeping (page allocation, table rows, slot assignment) happens here, between steps.
A decode step itself only reads the device tensors `block_table`, `ctx_lens`, `slots` and the
pages; the store advances `ctx_lens` on the device, so the host never has to read it back.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from drafter_attn.kernels.footprint import kv_bytes
from drafter_attn.kernels.spec import Geometry, check_positive_int, is_power_of_two


class PoolExhausted(RuntimeError):
    """No free page (or arena slot) is left for a request."""


def _kv_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PagedKVPool:
    """Per-layer HND pages `k_pages[l], v_pages[l] : [num_pages, Hkv, page_size, D]` and a
    reference-counted page allocator shared by all layers (one page id addresses every layer).

    Reference counts let a prefix cache share full pages between requests: a page returns to the
    free list when its last user frees it.
    """

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim, num_layers=1, dtype=torch.bfloat16, device="cpu"):
        for name, value in (("num_pages", num_pages), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_layers", num_layers)):
            check_positive_int(name, value)
        if not is_power_of_two(page_size):
            raise ValueError(f"page_size must be a power of two, got page_size={page_size!r}")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        # Uninitialised like a serving engine's pool: every read is of a page a store has written.
        self.k_pages = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_pages = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        """Take `n` free pages, each with reference count 1."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        if n > len(self._free):
            raise PoolExhausted(
                f"asked for {n} pages but only {len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check_allocated(self, pages, needed: Counter) -> None:
        # Checked in full before any change, so a bad call leaves the counts as they were.
        for p, count in needed.items():
            if not isinstance(p, int) or not 0 <= p < self.num_pages:
                raise ValueError(f"page {p!r} is not a page id in [0, {self.num_pages})")
            if self._refs[p] < count:
                raise ValueError(f"page {p} has reference count {self._refs[p]}, cannot release it {count} time(s)")

    def incref(self, pages) -> None:
        """Share already allocated pages with one more user."""
        pages = list(pages)
        self._check_allocated(pages, Counter({p: 1 for p in pages}))
        for p in pages:
            self._refs[p] += 1

    def free(self, pages) -> None:
        """Drop one reference to each page; pages nobody holds go back to the free list."""
        pages = list(pages)
        self._check_allocated(pages, Counter(pages))
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def kv_bytes(self) -> int:
        """Bytes of K and V storage over all layers."""
        return _kv_bytes(self.k_pages + self.v_pages)

    @staticmethod
    def bytes_for(num_pages, page_size, num_kv_heads, head_dim, num_layers=1, dtype=torch.bfloat16) -> int:
        """What `kv_bytes()` of such a pool would be, without allocating it (kernels.footprint)."""
        return kv_bytes(num_pages * page_size, num_kv_heads, head_dim, num_layers, dtype.itemsize)


class BlockTables:
    """Per-request page lists of a `PagedKVPool` for up to `max_batch` requests, mirrored into the
    device tensors `block_table : int32 [max_batch, max_pages_per_req]` and `ctx_lens : int32 [max_batch]`.

    Unused table entries hold page 0 (a valid id), so even a kernel that reads past a request's
    pages cannot fault; the contract's kernels must not read them in any case.
    """

    def __init__(self, pool: PagedKVPool, max_batch: int, max_pages_per_req: int):
        check_positive_int("max_batch", max_batch)
        check_positive_int("max_pages_per_req", max_pages_per_req)
        self.pool = pool
        self.max_pages_per_req = max_pages_per_req
        self.block_table = torch.zeros((max_batch, max_pages_per_req), dtype=torch.int32, device=pool.device)
        self.ctx_lens = torch.zeros(max_batch, dtype=torch.int32, device=pool.device)
        self._pages: list[list[int] | None] = [None] * max_batch

    def pages(self, req: int) -> list[int]:
        pages = self._pages[req] if 0 <= req < len(self._pages) else None
        if pages is None:
            raise ValueError(f"req={req} is not an active request")
        return pages

    def _write_row(self, req: int) -> None:
        row = torch.zeros(self.max_pages_per_req, dtype=torch.int32)
        row[: len(self._pages[req])] = torch.tensor(self._pages[req], dtype=torch.int32)
        self.block_table[req].copy_(row)

    def add_request(self, prefix_pages=None) -> int:
        """Start a request on the lowest free row. `prefix_pages` are full, already written pages
        shared with a prefix cache (read-only: the store writes only after them); its context
        length starts at their token count."""
        try:
            req = self._pages.index(None)
        except ValueError:
            raise PoolExhausted(f"all {len(self._pages)} request rows are in use") from None
        prefix = list(prefix_pages or [])
        if len(prefix) > self.max_pages_per_req:
            raise ValueError(f"prefix_pages has {len(prefix)} pages, more than max_pages_per_req={self.max_pages_per_req}")
        self.pool.incref(prefix)
        self._pages[req] = prefix
        self._write_row(req)
        self.ctx_lens[req] = len(prefix) * self.pool.page_size
        return req

    def reserve(self, req: int, upto_tokens: int) -> None:
        """Before a step: give request `req` the pages to hold `upto_tokens` tokens (its context
        plus what the next store may write). The step itself never allocates."""
        pages = self.pages(req)
        need = math.ceil(upto_tokens / self.pool.page_size)
        if need > self.max_pages_per_req:
            raise ValueError(
                f"upto_tokens={upto_tokens} needs {need} pages, more than max_pages_per_req={self.max_pages_per_req}"
            )
        if need > len(pages):
            pages += self.pool.alloc(need - len(pages))
            self._write_row(req)

    def release(self, req: int) -> None:
        """End a request: drop its page references and clear its row."""
        self.pool.free(self.pages(req))
        self._pages[req] = None
        self.block_table[req].zero_()
        self.ctx_lens[req] = 0


class ArenaKVCache:
    """Dense per-slot buffers `k_arena[l], v_arena[l] : [num_slots, max_ctx, Hkv, D]` and a slot
    allocator. Memory is `num_slots * max_ctx` tokens whatever the real context lengths are."""

    def __init__(self, num_slots, max_ctx, num_kv_heads, head_dim, num_layers=1, dtype=torch.bfloat16, device="cpu"):
        for name, value in (("num_slots", num_slots), ("max_ctx", max_ctx), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_layers", num_layers)):
            check_positive_int(name, value)
        self.num_slots, self.max_ctx = num_slots, max_ctx
        self.device = torch.device(device)
        shape = (num_slots, max_ctx, num_kv_heads, head_dim)
        self.k_arena = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_arena = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise PoolExhausted(f"all {self.num_slots} arena slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot={slot!r} is not an acquired slot of this arena")
        self._free.append(slot)

    def kv_bytes(self) -> int:
        """Bytes of K and V storage over all layers."""
        return _kv_bytes(self.k_arena + self.v_arena)

    @staticmethod
    def bytes_for(num_slots, max_ctx, num_kv_heads, head_dim, num_layers=1, dtype=torch.bfloat16) -> int:
        """What `kv_bytes()` of such an arena would be, without allocating it (kernels.footprint)."""
        return kv_bytes(num_slots * max_ctx, num_kv_heads, head_dim, num_layers, dtype.itemsize)


# ---------------------------------------------------------------------------------------------
# Random contexts for tests and benchmarks (one layer). Data is drawn on the host from a CPU
# torch.Generator, then moved, so a seed gives the same data on every device. randn, never zeros:
# zeros hide reads of the wrong rows.


def _randn(shape, geometry: Geometry, device, generator) -> torch.Tensor:
    # Draw on the target device from a seed taken off `generator`: GB-sized benchmark caches
    # would take minutes on the CPU, and the data stays a function of the caller's seed.
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    device = torch.device(device)
    local = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=local, device=device, dtype=geometry.torch_dtype)


def random_paged_context(geometry: Geometry, ctx_lens: list[int], page_size: int, device, generator,
                         shuffle_pages: bool = True, extra_pages: int = 0, max_pages: int | None = None):
    """Random paged context for `ctx_lens` requests -> (k_pages, v_pages, block_table, ctx_lens).

    Each request owns ceil(P_b / page_size) + `extra_pages` pages (the extra ones give a store
    room to write). Pages are handed out in a random permutation so that paging bugs show; table
    columns past a request's pages hold random garbage ids (also out of range), which a correct
    kernel never dereferences. One spare page is never referenced. The pool holds only these
    pages; `max_pages` widens the block table to that many columns (an engine's table sized for
    the model's longest context), the extra columns garbage too.
    """
    if not is_power_of_two(page_size):
        raise ValueError(f"page_size must be a power of two, got page_size={page_size!r}")
    if extra_pages < 0 or any(P < 0 for P in ctx_lens):
        raise ValueError("ctx_lens and extra_pages must be non-negative")
    need = [math.ceil(P / page_size) + extra_pages for P in ctx_lens]
    num_pages = sum(need) + 1
    if max_pages is not None and max_pages < max(need + [1]):
        raise ValueError(f"max_pages={max_pages} is fewer than the {max(need + [1])} pages a request needs")
    max_pages = max(need + [1, max_pages or 1])
    order = torch.randperm(num_pages, generator=generator) if shuffle_pages else torch.arange(num_pages)
    table = torch.randint(-(1 << 20), 1 << 20, (len(ctx_lens), max_pages), generator=generator, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = order[start:start + n]
        start += n
    shape = (num_pages, geometry.num_kv_heads, page_size, geometry.head_dim)
    k_pages = _randn(shape, geometry, device, generator)
    v_pages = _randn(shape, geometry, device, generator)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return k_pages, v_pages, table.to(device), lens.to(device)


def random_arena_context(geometry: Geometry, ctx_lens: list[int], max_ctx: int, device, generator, extra_slots: int = 1):
    """Random arena context -> (k_arena, v_arena, slots, ctx_lens), with `len(ctx_lens) +
    extra_slots` slots assigned in a random permutation. Rows past each length are random too."""
    if any(not 0 <= P <= max_ctx for P in ctx_lens):
        raise ValueError(f"ctx_lens must lie in [0, max_ctx={max_ctx}], got {ctx_lens}")
    if extra_slots < 0:
        raise ValueError(f"extra_slots must be non-negative (each request needs a slot), got {extra_slots}")
    num_slots = len(ctx_lens) + extra_slots
    slots = torch.randperm(num_slots, generator=generator)[: len(ctx_lens)].to(torch.int32)
    shape = (num_slots, max_ctx, geometry.num_kv_heads, geometry.head_dim)
    k_arena = _randn(shape, geometry, device, generator)
    v_arena = _randn(shape, geometry, device, generator)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return k_arena, v_arena, slots.to(device), lens.to(device)


def paged_to_dense(k_pages, v_pages, block_table, ctx_lens):
    """Per-request context as lists of [P_b, Hkv, D] K and V tensors (host loop: for tests)."""
    ps = k_pages.shape[2]
    ks, vs = [], []
    for b, P in enumerate(ctx_lens.tolist()):
        ids = block_table[b, : math.ceil(P / ps)].long()
        for pages, out in ((k_pages, ks), (v_pages, vs)):
            out.append(pages[ids].transpose(1, 2).reshape(-1, pages.shape[1], pages.shape[3])[:P])
    return ks, vs


def arena_to_dense(k_arena, v_arena, slots, ctx_lens):
    """Per-request context as lists of [P_b, Hkv, D] K and V tensors (host loop: for tests)."""
    pairs = list(zip(slots.tolist(), ctx_lens.tolist()))
    return [k_arena[s, :P] for s, P in pairs], [v_arena[s, :P] for s, P in pairs]
