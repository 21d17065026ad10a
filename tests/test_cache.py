"""Page allocator, block tables, arena slots, byte accounting and the random-context helpers."""

import re

import pytest
import torch

from helpers import make_generator, naive_attention_f64, random_block
from drafter_attn.kernels import reference
from drafter_attn.kernels.cache import (
    ArenaKVCache, BlockTables, PagedKVPool, PoolExhausted, arena_to_dense, paged_to_dense,
    random_arena_context, random_paged_context,
)
from drafter_attn.kernels.spec import Geometry


def _pool(num_pages=8, **kw):
    return PagedKVPool(num_pages, 16, 2, 64, **kw)


def test_alloc_and_free():
    pool = _pool()
    a = pool.alloc(3)
    b = pool.alloc(2)
    assert len(set(a + b)) == 5 and pool.num_free == 3
    assert all(pool.refcount(p) == 1 for p in a + b)
    pool.free(a)
    assert pool.num_free == 6 and all(pool.refcount(p) == 0 for p in a)
    assert sorted(pool.alloc(6)) == sorted(set(range(8)) - set(b))
    assert pool.alloc(0) == []


def test_shared_pages_are_freed_by_their_last_user():
    pool = _pool()
    pages = pool.alloc(2)
    pool.incref(pages)
    assert [pool.refcount(p) for p in pages] == [2, 2]
    pool.free(pages)
    assert pool.num_free == 6 and [pool.refcount(p) for p in pages] == [1, 1]
    pool.free(pages)
    assert pool.num_free == 8


def test_exhaustion_and_misuse():
    pool = _pool(4)
    pool.alloc(2)
    with pytest.raises(PoolExhausted, match=re.escape("asked for 5 pages but only 2 of 4 are free")):
        pool.alloc(5)
    assert isinstance(PoolExhausted("x"), RuntimeError) and pool.num_free == 2
    free_page = pool.alloc(1)[0]
    pool.free([free_page])
    with pytest.raises(ValueError, match=f"page {free_page} has reference count 0"):
        pool.free([free_page])
    with pytest.raises(ValueError, match=f"page {free_page} has reference count 0"):
        pool.incref([free_page])
    with pytest.raises(ValueError, match=r"page 9 is not a page id in \[0, 4\)"):
        pool.free([9])
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        PagedKVPool(4, 24, 2, 64)


def test_block_tables_reserve_share_release():
    pool = _pool(10)
    tables = BlockTables(pool, max_batch=3, max_pages_per_req=4)
    r0 = tables.add_request()
    tables.reserve(r0, 40)  # 3 pages of 16
    assert len(tables.pages(r0)) == 3 and pool.num_free == 7
    assert tables.block_table[r0].tolist() == tables.pages(r0) + [0]
    tables.reserve(r0, 33)  # already covered: no allocation
    assert pool.num_free == 7

    prefix = tables.pages(r0)[:2]
    r1 = tables.add_request(prefix_pages=prefix)
    assert r1 == 1 and int(tables.ctx_lens[r1]) == 32 and int(tables.ctx_lens[r0]) == 0
    assert [pool.refcount(p) for p in prefix] == [2, 2]
    tables.reserve(r1, 50)  # two more pages after the shared ones
    assert tables.pages(r1)[:2] == prefix and pool.num_free == 5
    assert tables.block_table[r1].tolist() == tables.pages(r1)

    tables.release(r0)
    assert [pool.refcount(p) for p in prefix] == [1, 1] and pool.num_free == 6
    assert tables.block_table[r0].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="req=0 is not an active request"):
        tables.reserve(r0, 1)
    with pytest.raises(ValueError, match="upto_tokens=65 needs 5 pages, more than max_pages_per_req=4"):
        tables.reserve(r1, 65)
    tables.release(r1)
    assert pool.num_free == 10

    for _ in range(3):
        tables.add_request()
    with pytest.raises(PoolExhausted, match="all 3 request rows are in use"):
        tables.add_request()


def test_block_tables_drive_the_reference_like_an_arena():
    """Prompt chunk then a decode step through the pool and tables, against an arena."""
    g = Geometry(8, 2, 64, 16, "sliding", 40, dtype="float32")
    pool = PagedKVPool(32, 16, 2, 64, dtype=torch.float32)
    tables = BlockTables(pool, max_batch=4, max_pages_per_req=8)
    arena = ArenaKVCache(4, 128, 2, 64, dtype=torch.float32)
    reqs = [tables.add_request() for _ in range(3)]
    slots = torch.tensor([arena.acquire() for _ in reqs][::-1], dtype=torch.int32)
    table, lens = tables.block_table[:3], tables.ctx_lens[:3]  # views: the store advances lens
    arena_lens = torch.zeros(3, dtype=torch.int32)
    gen = make_generator(7)

    def step(T, num_new):
        for r in reqs:
            tables.reserve(r, int(lens[r]) + T)  # host work before the step
        k_new = torch.randn(3, T, 2, 64, generator=gen)
        v_new = torch.randn(3, T, 2, 64, generator=gen)
        num_new = torch.tensor(num_new, dtype=torch.int32)
        reference.store_paged(k_new, v_new, num_new, pool.k_pages[0], pool.v_pages[0], table, lens)
        reference.store_arena(k_new, v_new, num_new, arena.k_arena[0], arena.v_arena[0], slots, arena_lens)

    step(50, [50, 17, 0])  # prompt chunks
    step(16, [3, 16, 1])  # accepted rows of a decode step
    assert lens.tolist() == arena_lens.tolist() == [53, 33, 1]
    q, k_blk, v_blk = random_block(g, 3, "cpu", gen)
    k_ctx, v_ctx = paged_to_dense(pool.k_pages[0], pool.v_pages[0], table, lens)
    a_ctx = arena_to_dense(arena.k_arena[0], arena.v_arena[0], slots, arena_lens)
    for paged_rows, arena_rows in zip(k_ctx + v_ctx, a_ctx[0] + a_ctx[1]):
        assert torch.equal(paged_rows, arena_rows)
    kw = dict(mask=g.mask, window=g.window)
    out_p = reference.paged_attention(q, k_blk, v_blk, pool.k_pages[0], pool.v_pages[0], table, lens, **kw)
    out_a = reference.arena_attention(q, k_blk, v_blk, arena.k_arena[0], arena.v_arena[0], slots, arena_lens, **kw)
    want = naive_attention_f64(q, k_blk, v_blk, k_ctx, v_ctx, **kw)
    torch.testing.assert_close(out_p.double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_a, out_p, atol=1e-5, rtol=0)


def test_arena_slots():
    arena = ArenaKVCache(2, 32, 2, 64)
    a, b = arena.acquire(), arena.acquire()
    assert {a, b} == {0, 1} and arena.num_free == 0
    with pytest.raises(PoolExhausted, match="all 2 arena slots are in use"):
        arena.acquire()
    arena.release(a)
    with pytest.raises(ValueError, match=f"slot={a} is not an acquired slot"):
        arena.release(a)
    assert arena.acquire() == a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_are_exact(dtype):
    pool = PagedKVPool(7, 32, 8, 128, num_layers=3, dtype=dtype)
    assert pool.kv_bytes() == PagedKVPool.bytes_for(7, 32, 8, 128, 3, dtype) == 2 * 3 * 7 * 32 * 8 * 128 * dtype.itemsize
    arena = ArenaKVCache(3, 100, 8, 64, num_layers=2, dtype=dtype)
    assert arena.kv_bytes() == ArenaKVCache.bytes_for(3, 100, 8, 64, 2, dtype) == 2 * 2 * 3 * 100 * 8 * 64 * dtype.itemsize
    assert len(pool.k_pages) == len(pool.v_pages) == 3 and pool.k_pages[0].shape == (7, 8, 32, 128)
    assert arena.k_arena[1].shape == (3, 100, 8, 64)


def test_random_contexts_are_permuted_and_consistent():
    g = Geometry(4, 2, 64, 16)
    gen = make_generator(8)
    k_pages, v_pages, table, lens = random_paged_context(g, [0, 17, 100], 16, "cpu", gen, extra_pages=1)
    assert table.dtype == lens.dtype == torch.int32 and lens.tolist() == [0, 17, 100]
    used = torch.cat([table[0, :1], table[1, :3], table[2, :8]])
    assert used.unique().numel() == 12 and used.tolist() != sorted(used.tolist())
    assert k_pages.dtype == torch.bfloat16 and k_pages.abs().sum() > 0
    k_ctx, _ = paged_to_dense(k_pages, v_pages, table, lens)
    assert [k.shape[0] for k in k_ctx] == [0, 17, 100]
    assert torch.equal(k_ctx[1][16], k_pages[table[1, 1], :, 0])

    k_arena, v_arena, slots, lens = random_arena_context(g, [3, 50], 64, "cpu", gen)
    assert k_arena.shape == (3, 64, 2, 64) and slots.dtype == torch.int32 and len(set(slots.tolist())) == 2
    k_ctx, _ = arena_to_dense(k_arena, v_arena, slots, lens)
    assert torch.equal(k_ctx[1], k_arena[slots[1], :50])
    with pytest.raises(ValueError, match="ctx_lens must lie in"):
        random_arena_context(g, [65], 64, "cpu", gen)
    with pytest.raises(ValueError, match="extra_slots must be non-negative"):
        random_arena_context(g, [3, 50, 7], 64, "cpu", gen, extra_slots=-1)
    with pytest.raises(ValueError, match="max_pages=0 is fewer than the 1 pages"):
        random_paged_context(g, [], 16, "cpu", gen, max_pages=0)
