"""KV-cache footprint of a deployment, arena against paged: pure arithmetic, no GPU.

For a drafter geometry (layers L, KV heads Hkv, head dim D, dtype of `e` bytes, block size Qb),
`concurrency` requests and a maximum context `max_ctx` (tokens one request may hold, the block's
store included):

  K+V of one token, all layers   t = 2 * L * Hkv * D * e
  arena (dense)                  concurrency * max_ctx * t
                                 (one slot of max_ctx tokens per request, whatever its length)
  paged, at expected context P   concurrency * ceil((P + Qb) / S) * S * t       (page size S:
                                 the context plus room for the store's Qb rows, rounded up to pages)
                               + concurrency * ceil(max_ctx / S) * 4             (the int32 block
                                 table, sized for max_ctx, one table shared by all layers)

A request at P tokens must leave room for the store: P + Qb <= max_ctx.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TABLE_ENTRY_BYTES = 4  # int32 page ids
DEFAULT_PAGES = (16, 32, 64, 128)


def token_bytes(geometry) -> int:
    """K and V bytes of one token over all layers."""
    g = geometry
    return 2 * g.num_layers * g.num_kv_heads * g.head_dim * DTYPE_BYTES[g.dtype]


def arena_bytes(geometry, concurrency: int, max_ctx: int) -> int:
    """Dense arena: one slot of `max_ctx` tokens per request, every layer."""
    return concurrency * max_ctx * token_bytes(geometry)


def block_table_bytes(concurrency: int, max_ctx: int, page_size: int) -> int:
    return concurrency * math.ceil(max_ctx / page_size) * TABLE_ENTRY_BYTES


@dataclass(frozen=True)
class Footprint:
    """Paged and arena bytes of one deployment at one expected context and page size."""

    ctx: int
    page_size: int
    concurrency: int
    max_ctx: int
    pages_per_request: int
    pages: int
    paged_kv_bytes: int
    table_bytes: int
    paged_bytes: int  # KV + block table
    arena_bytes: int

    @property
    def paged_over_arena(self) -> float:
        return self.paged_bytes / self.arena_bytes

    @property
    def arena_over_paged(self) -> float:
        return self.arena_bytes / self.paged_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "paged_over_arena": self.paged_over_arena,
                "arena_over_paged": self.arena_over_paged}


def footprint(geometry, concurrency: int, ctx: int, page_size: int, max_ctx: int,
              store_rows: int | None = None) -> Footprint:
    """Paged against arena bytes for `concurrency` requests at `ctx` committed tokens each, with
    room for a store of `store_rows` rows (default Qb; a context step stores a prompt chunk)."""
    qb = geometry.block_size if store_rows is None else store_rows
    for name, value in (("concurrency", concurrency), ("max_ctx", max_ctx), ("page_size", page_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if ctx < 0:
        raise ValueError(f"context length must be non-negative, got {ctx}")
    if ctx + qb > max_ctx:
        raise ValueError(f"context {ctx} + the store's {qb} rows = {ctx + qb} tokens exceeds "
                         f"max context {max_ctx}; raise --max-ctx or lower the context")
    per_req = math.ceil((ctx + qb) / page_size)
    pages = concurrency * per_req
    kv = pages * page_size * token_bytes(geometry)
    table = block_table_bytes(concurrency, max_ctx, page_size)
    return Footprint(ctx, page_size, concurrency, max_ctx, per_req, pages, kv, table, kv + table,
                     arena_bytes(geometry, concurrency, max_ctx))


def default_contexts(geometry, max_ctx: int) -> list[int]:
    """Expected contexts when none are given: an eighth full, half full, full (max_ctx - Qb)."""
    full = max_ctx - geometry.block_size
    if full < 0:
        return []
    return sorted({c for c in (max_ctx // 8, max_ctx // 2) if c <= full} | {full})


def footprints(geometry, concurrency: int, max_ctx: int, ctxs: list[int],
               page_sizes=DEFAULT_PAGES) -> list[Footprint]:
    return [footprint(geometry, concurrency, c, s, max_ctx) for c in ctxs for s in page_sizes]


def fmt_bytes(n: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------------------------
# What a measurement allocates on the GPU (bench decode / prefill and the attention table refuse,
# before measuring, a row that would not fit)

USABLE_FRACTION = 0.92  # of the GPU's memory: the CUDA context, cubins, allocator slack
_OVERHEAD_BYTES = 1 << 30
_REFERENCE_TOKENS = 1 << 18  # tuner.step's chunk of the reference check (tokens of capacity)
_MAX_SPLITS = 64


def _layer_token_bytes(geometry) -> int:
    """K and V bytes of one token of one layer."""
    return 2 * geometry.num_kv_heads * geometry.head_dim * DTYPE_BYTES[geometry.dtype]


def measurement_bytes(geometry, layout: str, page_size: int | None, batch: int, ctx: int, rows: int,
                      table_capacity: int | None = None) -> int:
    """Peak GPU bytes of measuring one step (tuner.step.DecodeStep through tuner.measure), an
    estimate from the sizes alone:

      the step's caches       every layer: the pages the context and the stored rows need (the
                              pool holds no more, whatever the table's width), or a dense arena
                              slot of ctx + rows per request
      + the larger of         the correctness check: one more layer's cache and its copy for the
                              reference, and the reference's float32 temporaries over one chunk
                              of requests gathered to the table's capacity
                              the read floor: a buffer of the step's bytes (every layer's K/V)
      + split-KV partials (at most 64 splits) and 1 GiB for the rest.
    """
    g = geometry
    e = DTYPE_BYTES[g.dtype]
    t = _layer_token_bytes(g)
    tokens = ctx + rows
    if layout == "paged":
        layer = (batch * math.ceil(tokens / page_size) + 1) * page_size * t
        capacity = table_capacity or math.ceil(tokens / page_size) * page_size
    else:
        layer = batch * tokens * t
        capacity = tokens
    caches = g.num_layers * layer
    chunk = min(batch, max(1, _REFERENCE_TOKENS // max(1, capacity)))
    per_token = g.num_kv_heads * g.head_dim * (4 * e + 8) + g.num_q_heads * g.block_size * 12
    check = 2 * layer + chunk * (capacity + g.block_size) * per_token
    floor = g.num_layers * batch * tokens * t
    partials = _MAX_SPLITS * batch * g.num_q_heads * g.block_size * (g.head_dim + 1) * 4
    return caches + max(check, floor) + partials + _OVERHEAD_BYTES


def baseline_bytes(geometry, page_size: int, batch: int, ctx: int) -> int:
    """Peak GPU bytes of measuring a baseline (kernels.baselines: one layer's pages holding the
    context and the block, a 256 MiB workspace) and its read floor."""
    g = geometry
    t = _layer_token_bytes(g)
    pages = batch * math.ceil((ctx + g.block_size) / page_size) * page_size * t
    return 2 * pages + (256 << 20) + _OVERHEAD_BYTES
