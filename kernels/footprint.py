"""The memory model: bytes of the K/V caches, the block table and the split-KV partials, from the
layout definitions (docs/design.md, "The two layouts"). Pure arithmetic: no GPU, no torch.

The one place these formulas live. `kernels.cache` sizes its pools with `kv_bytes`, the cupy
backend its split workspace with `partial_elems`, `kernels.auto` weighs layouts with
`arena_bytes` / `paged_bytes`, `tuner.memory` models a workload's K/V and what measuring it
needs, `tuner.roofline` the bytes a step moves, and `bench memory` / `bench decode` print
`footprint`.

For a drafter geometry (layers L, KV heads Hkv, head dim D, dtype of `e` bytes, block size Qb),
`concurrency` requests and a maximum context `max_ctx` (tokens one request may hold, the block's
store included):

  K+V of n tokens, all layers    kv_bytes = 2 * L * n * Hkv * D * e
  K+V of one token               t = 2 * L * Hkv * D * e                        (token_bytes)
  arena (dense)                  concurrency * max_ctx * t
                                 (one slot of max_ctx tokens per request, whatever its length)
  paged, n tokens a request      concurrency * ceil(n / S) * S * t              (page size S:
                                 whole pages)
                               + concurrency * ceil(max_ctx / S) * 4            (the int32 block
                                 table, sized for max_ctx, one table shared by all layers)
  a footprint at context P       the paged bytes of n = P + Qb tokens (the context plus room for
                                 the store's Qb rows); P + Qb <= max_ctx
  split-KV partials (splits s>1) s * B * Hkv * R float32 log-sum-exps, and D times as many
                                 float32 partial outputs (R = Qb * G query rows of a KV head);
                                 none without a split
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TABLE_ENTRY_BYTES = 4  # int32 page ids
PARTIAL_BYTES = 4  # float32 partial outputs and log-sum-exps
DEFAULT_PAGES = (16, 32, 64, 128)


def kv_bytes(tokens: int, num_kv_heads: int, head_dim: int, num_layers: int = 1,
             elem_bytes: int = 2) -> int:
    """K and V bytes of `tokens` token rows (page slots or arena rows) over `num_layers` layers."""
    return 2 * num_layers * tokens * num_kv_heads * head_dim * elem_bytes


def token_bytes(geometry) -> int:
    """K and V bytes of one token over all layers."""
    g = geometry
    return kv_bytes(1, g.num_kv_heads, g.head_dim, g.num_layers, DTYPE_BYTES[g.dtype])


def pages_for(tokens: int, page_size: int) -> int:
    """Whole pages that hold `tokens` tokens."""
    return math.ceil(tokens / page_size)


def arena_bytes(geometry, concurrency: int, max_ctx: int) -> int:
    """Dense arena: one slot of `max_ctx` tokens per request, every layer."""
    return concurrency * max_ctx * token_bytes(geometry)


def block_table_bytes(concurrency: int, max_ctx: int, page_size: int) -> int:
    """The int32 block table: a row of ceil(max_ctx / page_size) page ids per request."""
    return concurrency * pages_for(max_ctx, page_size) * TABLE_ENTRY_BYTES


def paged_kv_bytes(geometry, concurrency: int, tokens: int, page_size: int) -> int:
    """The pages of `tokens` tokens per request (rounded up to whole pages), every layer."""
    return concurrency * pages_for(tokens, page_size) * page_size * token_bytes(geometry)


def paged_bytes(geometry, concurrency: int, tokens: int, page_size: int, max_ctx: int) -> int:
    """Pages for `tokens` tokens per request plus the block table sized for `max_ctx`."""
    return (paged_kv_bytes(geometry, concurrency, tokens, page_size)
            + block_table_bytes(concurrency, max_ctx, page_size))


def partial_elems(batch: int, num_kv_heads: int, rows: int, head_dim: int,
                  splits: int) -> tuple[int, int]:
    """float32 elements of the split-KV partials, (partial outputs, log-sum-exps): one row of
    `head_dim` outputs and one log-sum-exp per split, request, KV head and query row (`rows` =
    Qb * G); (0, 0) without a split."""
    if splits <= 1:
        return 0, 0
    lse = splits * batch * num_kv_heads * rows
    return lse * head_dim, lse


def partials_bytes(batch: int, num_kv_heads: int, rows: int, head_dim: int, splits: int) -> int:
    """Bytes of the split-KV workspace (`partial_elems`, float32)."""
    return PARTIAL_BYTES * sum(partial_elems(batch, num_kv_heads, rows, head_dim, splits))


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
    per_req = pages_for(ctx + qb, page_size)
    kv = paged_kv_bytes(geometry, concurrency, ctx + qb, page_size)
    table = block_table_bytes(concurrency, max_ctx, page_size)
    return Footprint(ctx, page_size, concurrency, max_ctx, per_req, concurrency * per_req, kv, table,
                     kv + table, arena_bytes(geometry, concurrency, max_ctx))


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

