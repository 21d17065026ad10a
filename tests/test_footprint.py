"""The memory model (kernels.footprint) against numbers computed by hand from the layout
definitions (docs/design.md, "The two layouts"): pages, arena, block table, split-KV partials;
and every user of the model (caches, AUTO, the tuner's workload bytes, bench) gets its numbers
from it."""

from __future__ import annotations

import pytest
import torch

from drafter_attn.kernels import auto, cache
from drafter_attn.kernels import footprint as kvmem
from drafter_attn.kernels.presets import get_preset
from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.tuner import memory as tuner_memory

MAIN = get_preset("qwen3-8b-dflash-b16")  # 5 layers, 8 KV heads x 128, bf16, Qb 16
LAGUNA = get_preset("laguna-dflash")  # 6 layers, 72 Q / 8 KV heads x 128 (G 9), Qb 16


def test_token_bytes_by_hand():
    # K and V (2) x 5 layers x 8 heads x 128 dims x 2 bytes
    assert kvmem.token_bytes(MAIN) == 2 * 5 * 8 * 128 * 2 == 20480
    # gpt-oss: 8 layers, 8 KV heads x 64
    assert kvmem.token_bytes(get_preset("gpt-oss-20b-dflash")) == 2 * 8 * 8 * 64 * 2 == 16384
    assert kvmem.token_bytes(Geometry(4, 2, 64, 4, num_layers=3, dtype="float32")) == 2 * 3 * 2 * 64 * 4


def test_arena_by_hand():
    # 16 slots x 1M tokens x 20 KiB: 320 GiB, whatever the real lengths
    assert kvmem.arena_bytes(MAIN, 16, 1 << 20) == 343_597_383_680 == 320 * 2**30


def test_paged_by_hand():
    fp = kvmem.footprint(MAIN, concurrency=16, ctx=100_000, page_size=64, max_ctx=1 << 20)
    # (100000 + 16 store rows) / 64 = 1562.75 -> 1563 pages per request
    assert fp.pages_per_request == 1563
    assert fp.pages == 16 * 1563 == 25008
    assert fp.paged_kv_bytes == 25008 * 64 * 20480 == 32_778_485_760
    # block table: 16 requests x (1M / 64 = 16384 entries) x 4 bytes
    assert fp.table_bytes == 16 * 16384 * 4 == 1_048_576
    assert fp.paged_bytes == 32_778_485_760 + 1_048_576
    assert fp.arena_bytes == 343_597_383_680
    assert fp.paged_over_arena == pytest.approx(32_779_534_336 / 343_597_383_680)
    assert fp.arena_over_paged == pytest.approx(343_597_383_680 / 32_779_534_336)


def test_partial_pages_round_up_and_page_sizes_differ():
    g = Geometry(4, 1, 64, 8, num_layers=1)  # 2 * 1 * 64 * 2 = 256 bytes per token
    assert kvmem.token_bytes(g) == 256
    small = kvmem.footprint(g, 2, ctx=9, page_size=16, max_ctx=64)  # 17 tokens -> 2 pages
    big = kvmem.footprint(g, 2, ctx=9, page_size=128, max_ctx=128)  # 17 tokens -> 1 page of 128
    assert (small.pages_per_request, small.paged_kv_bytes, small.table_bytes) == (2, 2 * 2 * 16 * 256, 2 * 4 * 4)
    assert (big.pages_per_request, big.paged_kv_bytes, big.table_bytes) == (1, 2 * 1 * 128 * 256, 2 * 1 * 4)


def test_full_context_costs_the_table_over_the_arena():
    fp = kvmem.footprint(MAIN, 4, ctx=4096 - 16, page_size=128, max_ctx=4096)
    assert fp.paged_kv_bytes == fp.arena_bytes
    assert fp.paged_bytes - fp.arena_bytes == 4 * 32 * 4


def test_store_rows_override_and_errors():
    fp = kvmem.footprint(MAIN, 1, ctx=0, page_size=64, max_ctx=4096, store_rows=1000)
    assert fp.pages_per_request == 16  # ceil(1000 / 64)
    with pytest.raises(ValueError, match=r"context 4090 \+ the store's 16 rows = 4106 tokens exceeds max context 4096"):
        kvmem.footprint(MAIN, 1, ctx=4090, page_size=64, max_ctx=4096)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        kvmem.footprint(MAIN, 1, ctx=0, page_size=48, max_ctx=4096)
    with pytest.raises(ValueError, match="concurrency must be a positive integer"):
        kvmem.footprint(MAIN, 0, ctx=0, page_size=64, max_ctx=4096)


def test_default_contexts():
    assert kvmem.default_contexts(MAIN, 1 << 20) == [131072, 524288, (1 << 20) - 16]
    assert kvmem.default_contexts(MAIN, 20) == [2, 4]  # half full (10) leaves no room for Qb rows
    assert kvmem.default_contexts(MAIN, 8) == []


def test_fmt_bytes():
    assert kvmem.fmt_bytes(320 * 2**30) == "320.00 GiB"
    assert kvmem.fmt_bytes(1536) == "1.50 KiB"
    assert kvmem.fmt_bytes(12) == "12 B"


# ---------------------------------------------------------------------------------------------
# The layout definitions, one at a time


def test_pages_by_hand():
    # 3 requests of 100 committed tokens + 16 store rows = 116 tokens -> 2 pages of 64 each;
    # a page holds 64 tokens x 8 KV heads x 128 x 2 bytes for K and for V, in each of 5 layers
    assert kvmem.pages_for(116, 64) == 2
    assert kvmem.pages_for(128, 64) == 2 and kvmem.pages_for(129, 64) == 3 and kvmem.pages_for(0, 64) == 0
    assert kvmem.paged_kv_bytes(MAIN, 3, 116, 64) == 3 * 2 * (2 * 5 * 64 * 8 * 128 * 2) == 7_864_320
    assert kvmem.kv_bytes(64, 8, 128, 5, 2) == 2 * 5 * 64 * 8 * 128 * 2  # one page, every layer


def test_arena_slots_by_hand():
    # laguna: 6 layers x 8 KV heads x 128 x bf16 = 24576 bytes a token; 4 slots of 8192 tokens
    assert kvmem.token_bytes(LAGUNA) == 2 * 6 * 8 * 128 * 2 == 24576
    assert kvmem.arena_bytes(LAGUNA, 4, 8192) == 4 * 8192 * 24576 == 805_306_368


def test_block_table_by_hand():
    # int32 page ids: ceil(max_ctx / page) per request; 100000 / 16 = 6250, 100000 / 128 = 781.25
    assert kvmem.block_table_bytes(16, 100_000, 16) == 16 * 6250 * 4 == 400_000
    assert kvmem.block_table_bytes(16, 100_000, 128) == 16 * 782 * 4 == 50_048
    assert kvmem.paged_bytes(MAIN, 3, 116, 64, 4096) == 7_864_320 + 3 * 64 * 4


def test_split_partials_by_hand():
    # main preset: Qb 16 x G 4 = 64 query rows per KV head; 2 requests, 8 KV heads, 4 splits:
    # one float32 log-sum-exp per (split, request, head, row) and 128 float32 outputs beside it
    assert kvmem.partial_elems(2, 8, 16 * 4, 128, 4) == (4 * 2 * 8 * 64 * 128, 4 * 2 * 8 * 64)
    assert kvmem.partials_bytes(2, 8, 64, 128, 4) == 4 * (524_288 + 4_096) == 2_113_536
    # laguna's 144 rows (Qb 16 x G 9), batch 1, 32 splits
    assert kvmem.partials_bytes(1, 8, 16 * 9, 128, 32) == 4 * 32 * 8 * 144 * 129 == 19_021_824
    # no split, no partials: the attention kernel writes the output itself
    assert kvmem.partial_elems(64, 8, 64, 128, 1) == (0, 0)
    assert kvmem.partials_bytes(64, 8, 64, 128, 0) == 0


# ---------------------------------------------------------------------------------------------
# Every user gets the model's numbers


def test_caches_allocate_what_the_model_says():
    pool = cache.PagedKVPool(7, 32, 2, 64, num_layers=3, dtype=torch.float16)
    assert pool.kv_bytes() == cache.PagedKVPool.bytes_for(7, 32, 2, 64, 3, torch.float16) \
        == kvmem.kv_bytes(7 * 32, 2, 64, 3, 2) == 2 * 3 * 7 * 32 * 2 * 64 * 2
    tables = cache.BlockTables(pool, 5, kvmem.pages_for(1000, 32))
    assert tables.block_table.numel() * tables.block_table.element_size() \
        == kvmem.block_table_bytes(5, 1000, 32) == 5 * 32 * 4
    arena = cache.ArenaKVCache(3, 100, 2, 64, num_layers=2, dtype=torch.float32)
    g = Geometry(4, 2, 64, 4, num_layers=2, dtype="float32")
    assert arena.kv_bytes() == cache.ArenaKVCache.bytes_for(3, 100, 2, 64, 2, torch.float32) \
        == kvmem.arena_bytes(g, 3, 100) == 3 * 100 * 2 * 2 * 2 * 64 * 4


@pytest.mark.parametrize("layout,page", [("paged", 16), ("paged", 128), ("arena", None)])
def test_tuner_workload_bytes_are_the_model(layout, page):
    p = Problem(MAIN, layout, page, 8, 8192)
    fp = kvmem.footprint(MAIN, 8, 8192, page or 64, 8192 + 16)
    want = fp.paged_kv_bytes if layout == "paged" else fp.arena_bytes
    assert tuner_memory.kv_bytes_for(p) == want
    if layout == "paged":  # (8192 + 16) / 16 = 513 pages; / 128 = 64.1 -> 65 pages
        assert want == 8 * (513 * 16 if page == 16 else 65 * 128) * 20480


def test_auto_weighs_the_model():
    d = auto.Deployment("qwen3-8b-dflash-b16", 128, 32768, 16, mean_ctx=5000)
    mem = next(r for r in auto.recommend(d, [], sm=90).reasons if r.kind == "memory").data
    assert mem["arena_bytes"] == kvmem.arena_bytes(MAIN, 16, 32768)
    # at max ctx the pages hold max_ctx tokens: footprint at P = max_ctx - Qb
    assert mem["paged_bytes_at_max_ctx"] == kvmem.footprint(MAIN, 16, 32768 - 16, 128, 32768).paged_bytes
    assert mem["paged_bytes_at_mean_ctx"] == kvmem.footprint(MAIN, 16, 5000, 128, 32768).paged_bytes
