"""AUTO (kernels.auto): paged or arena with measured reasons, and the page-rounding cost, checked
against hand-computed numbers."""

from __future__ import annotations

import json

import pytest

from drafter_attn.kernels import auto
from drafter_attn.kernels.auto import Deployment, hidden_tokens, page_rounding, recommend
from drafter_attn.kernels.dispatch import Dispatcher
from profile_fakes import H200, MAIN, build_db
from drafter_attn.tuner.cli import main

PRESET = "qwen3-8b-dflash-b16"


def entries(tmp_path, overhead=0.005, paged_syncs=0, arena_syncs=0, batches=(16, 32), ctxs=(2048, 8192)):
    """Measured winners on sm90: arena at 100 us x batch/16 x ctx/2048; paged `overhead` slower."""
    rows = []
    for b in batches:
        for c in ctxs:
            base = 100.0 * b / 16 * c / 2048
            rows.append(dict(layout="arena", batch=b, ctx=c, median_us=base, syncs_debug=arena_syncs,
                             workspace_bytes=1 << 20))
            rows.append(dict(layout="paged", page=64, batch=b, ctx=c, median_us=base * (1 + overhead),
                             syncs_debug=paged_syncs, workspace_bytes=2 << 20))
    path = tmp_path / f"auto-{overhead}-{paged_syncs}-{arena_syncs}.db"
    build_db(path, {"h": (H200, rows)})
    return Dispatcher.load(path).entries


def dep(**kw):
    base = dict(preset=PRESET, page_size=64, max_ctx=8192, concurrency=32, prefix_hit=0.0, serving="agg")
    base.update(kw)
    return Deployment(**base)


def test_latency_decides_when_nothing_else_does(tmp_path):
    rec = recommend(dep(), entries(tmp_path, overhead=0.005))
    assert rec.layout == "paged" and rec.decided_by == "latency" and rec.sm == 90
    lat = next(r for r in rec.reasons if r.kind == "latency")
    assert lat.basis == "measured" and lat.data["batch"] == 32
    assert lat.data["median_overhead"] == pytest.approx(0.005)
    assert [p["ctx_len"] for p in lat.data["pairs"]] == [2048, 8192]

    rec = recommend(dep(), entries(tmp_path, overhead=0.03))
    assert rec.layout == "arena" and rec.decided_by == "latency"
    # a looser tolerance accepts the 3%
    assert recommend(dep(), entries(tmp_path, overhead=0.03), latency_tolerance=0.05).layout == "paged"


def test_contexts_beyond_max_ctx_are_left_out_and_nearest_batch_used(tmp_path):
    rec = recommend(dep(max_ctx=4096, concurrency=20), entries(tmp_path))
    lat = next(r for r in rec.reasons if r.kind == "latency")
    # log2(20) = 4.32 is nearer 16 (4) than 32 (5)
    assert lat.data["batch"] == 16 and [p["ctx_len"] for p in lat.data["pairs"]] == [2048]
    assert "nearest measured batch to concurrency 20" in lat.text


def test_a_batch_measured_only_past_max_ctx_does_not_decide(tmp_path):
    """The batch nearest the concurrency is chosen among those measured within max_ctx: a batch
    measured only at a longer context (4 at 128k, paged ahead there) does not outvote its
    neighbours measured at the deployment's contexts (arena ahead); the shortest measured
    context stands in, said so, only where no batch is measured within max_ctx."""
    rows = []
    for b, c, over in ((1, 8192, 0.05), (8, 8192, 0.05), (4, 131072, -0.01)):
        rows += [dict(layout="arena", batch=b, ctx=c, median_us=100.0),
                 dict(layout="paged", page=64, batch=b, ctx=c, median_us=100.0 * (1 + over))]
    path = tmp_path / "mixed.db"
    build_db(path, {"h": (H200, rows)})
    ents = Dispatcher.load(path).entries
    rec = recommend(dep(max_ctx=32768, concurrency=4), ents)
    lat = next(r for r in rec.reasons if r.kind == "latency")
    assert rec.layout == "arena" and lat.data["batch"] == 8
    assert [p["ctx_len"] for p in lat.data["pairs"]] == [8192] and "stands in" not in lat.text
    rec = recommend(dep(max_ctx=4096, concurrency=4), ents)  # nothing measured that short
    lat = next(r for r in rec.reasons if r.kind == "latency")
    assert [p["ctx_len"] for p in lat.data["pairs"]] == [8192] and lat.data["batch"] == 8
    assert "no pair measured at max_ctx 4096 or shorter: the shortest measured stands in" in lat.text


def test_the_workspace_line_names_the_context_of_its_numbers(tmp_path):
    rows = [dict(layout="arena", batch=8, ctx=2048, median_us=100.0, workspace_bytes=1 << 20),
            dict(layout="paged", page=64, batch=8, ctx=2048, median_us=100.0, workspace_bytes=2 << 20),
            dict(layout="arena", batch=8, ctx=8192, median_us=400.0),
            dict(layout="paged", page=64, batch=8, ctx=8192, median_us=400.0)]
    path = tmp_path / "ws.db"
    build_db(path, {"h": (H200, rows)})
    rec = recommend(dep(concurrency=8), Dispatcher.load(path).entries)
    ws = next(r for r in rec.reasons if r.kind == "workspace")
    assert "measured step workspace at ctx 2048: paged 2.0 MiB, arena 1.0 MiB" in ws.text


def test_prefix_hits_choose_paged_despite_latency(tmp_path):
    rec = recommend(dep(prefix_hit=0.3), entries(tmp_path, overhead=0.03))
    assert rec.layout == "paged" and rec.decided_by == "prefix_reuse"
    kinds = {r.kind: r for r in rec.reasons}
    assert kinds["latency"].favors == "arena"  # the cost is still reported
    assert kinds["prefix_reuse"].favors == "paged" and "30%" in kinds["prefix_reuse"].text
    assert kinds["page_rounding"].data["bound"] == 63


def test_disaggregated_serving_needs_paged(tmp_path):
    rec = recommend(dep(serving="disagg"), entries(tmp_path, overhead=0.03, paged_syncs=1))
    assert rec.layout == "paged" and rec.decided_by == "serving"


def test_host_syncs(tmp_path):
    rec = recommend(dep(prefix_hit=0.5), entries(tmp_path, paged_syncs=2, arena_syncs=0))
    assert rec.layout == "arena" and rec.decided_by == "host_syncs"
    s = next(r for r in rec.reasons if r.kind == "host_syncs")
    assert s.basis == "measured" and s.data == {"paged": 2, "arena": 0}


def test_missing_measurements_are_said_not_guessed(tmp_path):
    rec = recommend(dep(), [], sm=90)
    assert rec.layout is None and rec.decided_by is None
    assert any("not measured" in m or "none measured" in m for m in rec.missing)
    assert "missing" in rec.to_text() and "none: the measurement that would decide is missing" in rec.to_text()
    # another page size than the measured one: also missing
    rec = recommend(dep(page_size=16), entries(tmp_path))
    assert rec.layout is None and any("page 16" in m for m in rec.missing)
    # structural reasons still decide, and the missing latency is listed
    rec = recommend(dep(prefix_hit=0.2), [], sm=90)
    assert rec.layout == "paged" and rec.missing


def test_several_sms_need_one_chosen(tmp_path):
    both = entries(tmp_path) + [dict(e, sm=100) for e in entries(tmp_path)]
    rec = recommend(dep(), both)
    assert rec.sm is None and rec.layout is None
    assert rec.missing[0] == "no SM chosen (the measurements hold SMs [90, 100]): give one"
    assert "latency" not in {r.kind for r in rec.reasons}
    assert recommend(dep(), both, sm=100).layout == "paged"


def test_measured_workspace_is_reported(tmp_path):
    rec = recommend(dep(), entries(tmp_path))
    ws = next(r for r in rec.reasons if r.kind == "workspace")
    # the fake rows: arena 1 MiB, paged 2 MiB; the largest compared context speaks
    assert ws.basis == "measured" and ws.favors is None
    assert ws.data == {"paged": 2 << 20, "arena": 1 << 20}
    assert "ctx 8192: paged 2.0 MiB, arena 1.0 MiB" in ws.text


def test_host_syncs_missing_for_some_pairs(tmp_path):
    rows = [dict(e, syncs=None) if e["layout"] == "paged" and e["ctx_len"] == 2048 else e
            for e in entries(tmp_path, arena_syncs=1)]
    rec = recommend(dep(), rows)
    assert any("not measured for every pair" in m for m in rec.missing)
    s = next(r for r in rec.reasons if r.kind == "host_syncs")
    assert s.data == {"paged": 0, "arena": 1} and rec.decided_by == "host_syncs" and rec.layout == "paged"


def test_memory_by_hand():
    # qwen3-8b-dflash-b16: 5 layers x 8 KV heads x 128 x bf16: 2*5*8*128*2 = 20480 bytes a token
    d = dep(max_ctx=1000, concurrency=4, mean_ctx=100)
    assert auto.token_bytes(MAIN) == 20480
    rec = recommend(d, [], sm=90)
    mem = next(r for r in rec.reasons if r.kind == "memory").data
    assert mem["arena_bytes"] == 4 * 1000 * 20480
    # ceil(1000 / 64) = 16 pages of 64 tokens per request, plus a 16-entry int32 table each
    assert mem["paged_bytes_at_max_ctx"] == 4 * 16 * 64 * 20480 + 4 * 16 * 4
    # mean ctx 100 + Qb 16 = 116 tokens: 2 pages
    assert mem["paged_bytes_at_mean_ctx"] == 4 * 2 * 64 * 20480 + 4 * 16 * 4


def test_json_and_text(tmp_path):
    rec = recommend(dep(prefix_hit=0.1), entries(tmp_path), hit_lengths=[1, 64, 100])
    doc = json.loads(rec.to_json())
    assert doc["recommendation"] == "paged" and doc["deployment"]["page_size"] == 64
    assert {r["kind"] for r in doc["reasons"]} >= {"latency", "memory", "prefix_reuse", "serving",
                                                    "host_syncs", "page_rounding"}
    rounding = next(r for r in doc["reasons"] if r["kind"] == "page_rounding")
    assert rounding["data"]["distribution"]["64"]["max"] == 63  # JSON keys are strings
    text = rec.to_text()
    assert text.startswith("AUTO for qwen3-8b-dflash-b16 on sm90") and "recommendation: paged" in text


def test_deployment_validation():
    with pytest.raises(ValueError, match="page_size"):
        dep(page_size=48)
    with pytest.raises(ValueError, match="prefix_hit"):
        dep(prefix_hit=1.5)
    with pytest.raises(ValueError, match="serving"):
        dep(serving="split")
    with pytest.raises(ValueError, match="unknown preset"):
        dep(preset="nope")


# ---------------------------------------------------------------------------------------------
# page rounding


def test_hidden_tokens_by_hand():
    # a hit of L tokens: the first stored position is L rounded up to a page, ceil(L/S)*S
    assert [hidden_tokens(L, 64) for L in (0, 1, 63, 64, 65, 100)] == [0, 63, 1, 0, 63, 28]
    assert [hidden_tokens(L, 16) for L in (0, 1, 63, 64, 65, 100)] == [0, 15, 1, 0, 15, 12]
    for S in (8, 16, 32, 64, 128, 256):
        for L in range(0, 600):
            h = hidden_tokens(L, S)
            assert 0 <= h <= S - 1 and (L + h) % S == 0


def test_page_rounding_distribution_by_hand():
    hits = [0, 1, 63, 64, 65, 100]  # 293 hit tokens
    stats = page_rounding(hits, (16, 64))
    s64 = stats[64]  # hidden 0, 63, 1, 0, 63, 28 -> sorted 0 0 1 28 63 63
    assert s64["total_hidden"] == 155 and s64["mean"] == pytest.approx(155 / 6)
    assert s64["p50"] == 1  # nearest rank: ceil(0.5 * 6) = 3rd value
    assert s64["p90"] == 63  # ceil(0.9 * 6) = 6th value
    assert s64["max"] == 63 and s64["bound"] == 63
    assert s64["zero_fraction"] == pytest.approx(2 / 6)
    assert s64["hidden_fraction"] == pytest.approx(155 / 293)
    assert s64["histogram"] == {0: 2, 1: 1, 28: 1, 63: 2}
    s16 = stats[16]  # hidden 0, 15, 1, 0, 15, 12 -> sorted 0 0 1 12 15 15
    assert s16["total_hidden"] == 43 and s16["p50"] == 1 and s16["p90"] == 15 and s16["max"] == 15
    # uniform residues: the mean is (S - 1) / 2
    assert page_rounding(range(1024), (128,))[128]["mean"] == pytest.approx(127 / 2)
    with pytest.raises(ValueError):
        page_rounding([], (16,))
    with pytest.raises(ValueError):
        page_rounding([5], (24,))


# ---------------------------------------------------------------------------------------------
# the CLI


def test_cli_auto_and_rounding(tmp_path, capsys, monkeypatch):
    path = tmp_path / "auto.db"
    rows = [dict(layout=lay, page=64, batch=32, ctx=8192, median_us=100.0 * (1.002 if lay == "paged" else 1),
                 syncs_debug=0) for lay in ("paged", "arena")]
    build_db(path, {"h": (H200, rows)})
    argv = ["auto", "--preset", PRESET, "--page", "64", "--max-ctx", "32768", "--concurrency", "64",
            "--prefix-hit", "0", "--serving", "agg", "--db", str(path)]
    assert main(argv + ["--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"] == "paged" and doc["decided_by"] == "latency" and doc["sm"] == 90
    assert main(argv) == 0
    assert "recommendation: paged (decided by latency)" in capsys.readouterr().out
    # no measurements at all where the default source points: said, not guessed
    monkeypatch.delenv("DRAFTER_TUNED_TABLE", raising=False)
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "none.db"))
    assert main(argv[:-2] + ["--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"] is None and "no tuned table or profile database" in doc["missing"][0]

    hits = tmp_path / "hits.txt"
    hits.write_text("0 1 63\n64, 65 100\n")
    assert main(["rounding", "--hits", f"@{hits}", "--pages", "64", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["64"]["total_hidden"] == 155


def test_cli_auto_refuses_a_named_source_that_is_not_there(tmp_path, capsys):
    argv = ["auto", "--preset", PRESET, "--page", "64", "--max-ctx", "8192", "--concurrency", "8"]
    for option in ("--table", "--db"):
        assert main([*argv, option, str(tmp_path / "typo.json")]) == 2
        assert f"no tuned table or profile database at {tmp_path / 'typo.json'}" in capsys.readouterr().err


def test_cli_auto_with_a_named_source_says_nothing_is_missing(tmp_path, capsys, monkeypatch):
    """Where the default source is missing but --with brings the measurements, the answer comes
    from them, without a "nothing measured" line beside it."""
    path = tmp_path / "more.db"
    rows = [dict(layout=lay, page=64, batch=8, ctx=8192, median_us=100.0) for lay in ("paged", "arena")]
    build_db(path, {"h": (H200, rows)})
    monkeypatch.delenv("DRAFTER_TUNED_TABLE", raising=False)
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "none.db"))
    argv = ["auto", "--preset", PRESET, "--page", "64", "--max-ctx", "8192", "--concurrency", "8",
            "--with", str(path), "--format", "json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommendation"] == "paged" and not any("nothing measured" in m for m in doc["missing"])


def _two_gpus(tmp_path, other: str) -> list[str]:
    """`tuner auto`'s argv over a database of GPU `other` (arena faster) and the H200 (paged
    faster), both sm90, one problem each."""
    pair = lambda paged, arena: [dict(layout="paged", page=64, batch=8, ctx=4096, median_us=paged),  # noqa: E731
                                 dict(layout="arena", batch=8, ctx=4096, median_us=arena)]
    db = tmp_path / "p.db"
    build_db(db, {"other": (dict(H200, gpu_name=other), pair(60.0, 40.0)), "h200": (H200, pair(40.0, 60.0))})
    return ["auto", "--preset", "qwen3-8b-dflash-b16", "--page", "64", "--max-ctx", "4096",
            "--concurrency", "8", "--db", str(db), "--format", "json"]


def test_cli_auto_decides_on_one_gpus_measurements(tmp_path, capsys):
    """A database of an H100 and an H200 (both sm90): the H100 measures arena faster, the H200
    paged; `--gpu` names whose measurements decide, and without it (no GPU here) auto asks."""
    argv = _two_gpus(tmp_path, "NVIDIA H100 80GB HBM3")
    for gpu, layout in (("H100", "arena"), ("H200", "paged")):
        assert main(argv + ["--gpu", gpu]) == 0
        assert json.loads(capsys.readouterr().out)["recommendation"] == layout
    assert main(argv) == 2
    assert "several GPUs (NVIDIA H100 80GB HBM3, NVIDIA H200): give --gpu" in capsys.readouterr().err


def test_cli_auto_gpu_takes_an_exact_name_before_a_part(tmp_path, capsys):
    """--gpu "NVIDIA H200" is the H200, not also the H200 NVL whose name contains it."""
    argv = _two_gpus(tmp_path, "NVIDIA H200 NVL")
    for gpu, layout in (("NVIDIA H200", "paged"), ("nvl", "arena")):
        assert main(argv + ["--gpu", gpu]) == 0
        assert json.loads(capsys.readouterr().out)["recommendation"] == layout
