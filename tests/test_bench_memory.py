"""`bench memory`: the arena / paged footprint model against numbers computed by hand."""

from __future__ import annotations

import json

import pytest

from drafter_attn.bench import cli
from drafter_attn.bench import memory as kvmem
from drafter_attn.kernels.presets import get_preset
from drafter_attn.kernels.spec import Geometry

MAIN = get_preset("qwen3-8b-dflash-b16")  # 5 layers, 8 KV heads x 128, bf16, Qb 16


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


def test_cli_memory_json_matches_the_model(capsys):
    rc = cli.main(["memory", "--preset", "qwen3-8b-dflash-b16", "--max-ctx", "1M", "--concurrency", "16",
                   "--ctx", "100000", "--page", "64,128", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["arena_bytes"] == 343_597_383_680
    assert doc["token_bytes"] == 20480
    rows = {r["page_size"]: r for r in doc["rows"]}
    assert rows[64]["paged_bytes"] == 32_779_534_336
    # page 128: ceil(100016 / 128) = 782 pages per request; table 16 x 8192 x 4
    assert rows[128]["paged_kv_bytes"] == 16 * 782 * 128 * 20480
    assert rows[128]["table_bytes"] == 16 * 8192 * 4


def test_cli_memory_table(capsys):
    rc = cli.main(["memory", "--preset", "qwen3-8b-dflash-b16", "--max-ctx", "1M", "--concurrency", "16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "arena (dense: 16 slots x 1,048,576 tokens): 320.00 GiB" in out
    for page in ("16", "32", "64", "128"):
        assert f" {page} " in out
    assert "131,072" in out and "8.00x" in out  # an eighth full: 1/8 of the arena


def test_cli_memory_explicit_geometry(capsys):
    rc = cli.main(["memory", "--heads", "32/8", "--head-dim", "128", "--block", "16", "--layers", "1",
                   "--max-ctx", "128k", "--concurrency", "2", "--ctx", "1k", "--page", "16", "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["arena_bytes"] == 2 * 131072 * 4096
    assert doc["rows"][0]["paged_kv_bytes"] == 2 * 65 * 16 * 4096  # (1024 + 16) / 16 = 65 pages


def test_cli_memory_errors(capsys):
    assert cli.main(["memory", "--max-ctx", "1k", "--ctx", "1k"]) == 2
    assert "exceeds max context 1024" in capsys.readouterr().err
    assert cli.main(["memory", "--max-ctx", "8"]) == 2
    assert "smaller than the block size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["memory", "--max-ctx", "1G"])
    assert e.value.code == 2
    assert "argument --max-ctx" in capsys.readouterr().err
