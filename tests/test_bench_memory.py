"""`bench memory`: the command prints the footprint model (kernels.footprint, tested in
test_footprint.py) for a deployment."""

from __future__ import annotations

import json

import pytest

from drafter_attn.bench import cli


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
