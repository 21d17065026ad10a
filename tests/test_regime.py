"""The clock regimes: sustained timings are candidates of their own, a burst table never sees
them, a sustained table prefers them key by key, and the runtime and bench pick the regime's
table (CPU only; the timings themselves run in tests/test_bench_gpu.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from drafter_attn.bench import attention_table, cli as bench_cli, decode
from drafter_attn.kernels import shipped, tuned_table
from drafter_attn.kernels.dispatch import Dispatcher, Runtime
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import export
from drafter_attn.tuner.cli import main as tuner_main
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import Candidate
from drafter_attn.tuner.sweep import result_row

from profile_fakes import H200, MAIN, build_db, row

PAIR = {"tile_n": 32, "stages": 6}  # the fast one in bursts, slow once the clock drops
TMA = {"tile_n": 64, "stages": 3}


@pytest.fixture
def db(tmp_path):
    """Key B=8 ctx 32k: PAIR 240 against TMA 250 in bursts, 290 against 255 sustained (a lead
    beyond SUSTAINED_MARGIN). Key B=8 ctx 16k: PAIR 120 against TMA 125 in bursts, 130 against
    127 sustained (within it). Key B=1 ctx 2k: bursts only (a call too light to bring the clock
    down)."""
    path = tmp_path / "p.db"
    heavy, mid, light = dict(batch=8, ctx=32768), dict(batch=8, ctx=16384), dict(batch=1, ctx=2048)
    build_db(path, {"h200": (H200, [
        dict(heavy, params=PAIR, median_us=240.0), dict(heavy, params=TMA, median_us=250.0),
        dict(heavy, params=PAIR, median_us=290.0, sustain_s=0.75),
        dict(heavy, params=TMA, median_us=255.0, sustain_s=0.75),
        dict(mid, params=PAIR, median_us=120.0), dict(mid, params=TMA, median_us=125.0),
        dict(mid, params=PAIR, median_us=130.0, sustain_s=0.75),
        dict(mid, params=TMA, median_us=127.0, sustain_s=0.75),
        dict(light, params=PAIR, median_us=10.0), dict(light, params=TMA, median_us=12.0)])})
    return path


def _winners(entries) -> dict:
    return {(e["batch"], e["ctx_len"]): (e["params"], e["provenance"]["regime"]) for e in entries}


def test_each_regime_decides_on_its_own_timings(db):
    rows = tuned_table.read_db_rows(db)
    burst = tuned_table.select_entries(rows)
    assert _winners(burst) == {(1, 2048): (PAIR, "burst"), (8, 16384): (PAIR, "burst"),
                               (8, 32768): (PAIR, "burst")}
    # a burst key never ranks a sustained row, not even as a runner-up
    heavy = next(e for e in burst if e["ctx_len"] == 32768)
    assert heavy["candidates"] == 2 and heavy["median_us"] == 240.0
    sustained = tuned_table.select_entries(rows, regime="sustained")
    # 16k: TMA's 2% lead under load is within the spread of sustained timings: PAIR stays
    assert _winners(sustained) == {(1, 2048): (PAIR, "burst"), (8, 16384): (PAIR, "sustained"),
                                   (8, 32768): (TMA, "sustained")}
    mid = next(e for e in sustained if e["ctx_len"] == 16384)
    assert mid["median_us"] == 130.0 and [a["median_us"] for a in mid["alternatives"]] == [127.0]
    heavy = next(e for e in sustained if e["ctx_len"] == 32768)
    assert heavy["median_us"] == 255.0 and heavy["provenance"]["sustain_s"] == 0.75
    assert [a["median_us"] for a in heavy["alternatives"]] == [290.0]  # sustained rows only
    with pytest.raises(ValueError, match="regime 'hot'"):
        tuned_table.select_entries(rows, regime="hot")


def test_export_and_dispatch_per_regime(db, tmp_path, capsys):
    out = tmp_path / "sm90-sustained.json"
    assert tuner_main(["export", "--db", str(db), "--regime", "sustained", "--no-commits",
                       "--out", str(out)]) == 0
    assert "2 of them timed sustained, the rest burst" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["source"]["regime"] == "sustained"
    assert _winners(doc["entries"])[(8, 32768)] == (TMA, "sustained")
    problem = Problem(MAIN.with_(num_layers=1), "paged", 64, 8, 32768)
    picks = {name: dict(d.pick(problem, 90).params) for name, d in (
        ("table", Dispatcher.load(out)), ("db sustained", Dispatcher.load(db, regime="sustained")),
        ("db burst", Dispatcher.load(db)))}
    assert picks == {"table": TMA, "db sustained": TMA, "db burst": PAIR}
    burst = export.export_table(db, resolve_commits=False)
    assert burst["source"]["regime"] == "burst" and _winners(burst["entries"])[(8, 32768)] == (PAIR, "burst")


def test_show_names_the_sustained_rows(db, capsys):
    """`tuner show` gives the regime and clock columns where the database holds sustained rows."""
    assert tuner_main(["show", "--db", str(db), "--ctx-len", "32768"]) == 0
    header = capsys.readouterr().out.splitlines()
    assert any("sustain_s" in line and "sm_clock_mhz" in line for line in header)
    assert not any("sustain_load" in line for line in header)  # own-load rows only: no column
    with ProfileDB(db) as d:
        env = d.add_environment(H200)
        d.add_result(row(env, batch=8, ctx=32768, params=TMA, median_us=260.0, sustain_s=0.75,
                         sustain_load="gemm"))
    assert tuner_main(["show", "--db", str(db), "--ctx-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert any("sustain_load" in line for line in out.splitlines()) and "gemm" in out


def test_rows_under_a_co_runner_decide_their_keys(db):
    """Key B=1 ctx 128k: PAIR wins in bursts and under its own load; under a co-runner's load
    (the target model's, `sustain_load` gemm) TMA leads it by more than the margin. A key with
    co-load rows is decided on them alone, its own-load rows out of the running (runners-up
    included); a burst table never sees either."""
    long = dict(batch=1, ctx=131072)
    with ProfileDB(db) as d:
        env = d.add_environment(H200)
        for params, own, burst, coload in ((PAIR, 130.0, 128.0, 150.0), (TMA, 134.0, 133.0, 140.0)):
            d.add_result(row(env, **long, params=params, median_us=burst))
            d.add_result(row(env, **long, params=params, median_us=own, sustain_s=0.75))
            d.add_result(row(env, **long, params=params, median_us=coload, sustain_s=0.75, sustain_load="gemm"))
    rows = tuned_table.read_db_rows(db)
    hot = next(e for e in tuned_table.select_entries(rows, regime="sustained") if e["ctx_len"] == 131072)
    assert (hot["params"], hot["median_us"], hot["provenance"]["sustain_load"]) == (TMA, 140.0, "gemm")
    assert [a["median_us"] for a in hot["alternatives"]] == [150.0]
    # its burst winner, or the own-load rows alone (the co-load rows taken out), keep PAIR
    cool = next(e for e in tuned_table.select_entries(rows) if e["ctx_len"] == 131072)
    assert cool["params"] == PAIR and cool["provenance"]["sustain_load"] is None
    own_only = [r for r in rows if r.get("sustain_load") != "gemm"]
    hot = next(e for e in tuned_table.select_entries(own_only, regime="sustained") if e["ctx_len"] == 131072)
    assert (hot["params"], hot["provenance"]["sustain_load"]) == (PAIR, "self")
    # the other keys are as before: no co-load rows there
    assert _winners(tuned_table.select_entries(rows, regime="sustained"))[(8, 32768)] == (TMA, "sustained")


def test_co_load_rows_decide_whatever_layer_counts_the_other_loads_had(tmp_path):
    """The load is chosen first, the layer count within it: co-load rows of fewer layers than the
    key's own-load rows still decide it (taking the most layers first left only own-load rows)."""
    one, path = MAIN.with_(num_layers=1), tmp_path / "p.db"
    build_db(path, {"h200": (H200, [
        dict(params=PAIR, median_us=100.0), dict(params=TMA, median_us=110.0),
        dict(params=PAIR, median_us=100.0, sustain_s=0.75), dict(params=TMA, median_us=110.0, sustain_s=0.75),
        dict(geometry=one, params=PAIR, median_us=40.0, sustain_s=0.75, sustain_load="gemm"),
        dict(geometry=one, params=TMA, median_us=30.0, sustain_s=0.75, sustain_load="gemm")])})
    (hot,) = tuned_table.select_entries(tuned_table.read_db_rows(path), regime="sustained")
    assert (hot["params"], hot["provenance"]["sustain_load"], hot["num_layers"]) == (TMA, "gemm", 1)


def test_sustained_candidates_are_recorded_with_their_load(tmp_path):
    problem = Problem(get_preset(MAIN_PRESET), "paged", 64, 8, 32768)
    burst = Candidate(problem, "cupy", tuple(sorted(PAIR.items())), None, MAIN_PRESET)
    hot = burst.sustained(0.75)
    assert hot.key() != burst.key() and hot.sustained(0) == burst
    assert Candidate.from_wire(hot.to_wire()) == hot and Candidate.from_wire(burst.to_wire()) == burst
    assert "sustained 0.75 s" in hot.label() and "sustained" not in burst.label()
    with ProfileDB(tmp_path / "r.db") as d:
        env = d.add_environment(H200)
        for c in (burst, hot):
            d.add_result(result_row(c, dict(status="ok", median_us=100.0), env, "s", "w"))
        coload = burst.sustained(0.75, "gemm")
        assert coload.key() not in (hot.key(), burst.key()) and hot.sustained(0.75, "self") == hot
        assert Candidate.from_wire(coload.to_wire()) == coload and "under gemm" in coload.label()
        assert burst.sustained(0, "gemm") == burst  # a burst has no load
        with pytest.raises(ValueError, match="not one of self, gemm"):
            burst.sustained(0.75, "heavy")
        d.add_result(result_row(coload, dict(status="ok", median_us=100.0), env, "s", "w"))
        got = d.query("SELECT candidate_key, sustain_s, sustain_load FROM results ORDER BY id")
        assert got == [{"candidate_key": burst.key(), "sustain_s": None, "sustain_load": None},
                       {"candidate_key": hot.key(), "sustain_s": 0.75, "sustain_load": None},
                       {"candidate_key": coload.key(), "sustain_s": 0.75, "sustain_load": "gemm"}]
        # a sweep of the sustained regime does not take a burst row for done, nor the reverse
        assert d.done_candidates(env) == {burst.key(), hot.key(), coload.key()}


def test_the_shipped_sustained_table_comes_first_in_its_regime(monkeypatch, tmp_path):
    for var in shipped.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(shipped, "shipped_dir", lambda: tmp_path)
    for name in ("sm90.json", "sm90.db"):
        (tmp_path / name).write_text("x")
    assert shipped.find_default(90, regime="sustained") == tmp_path / "sm90.json"  # none shipped yet
    (tmp_path / "sm90-sustained.json").write_text("x")
    assert shipped.find_default(90, regime="sustained") == tmp_path / "sm90-sustained.json"
    assert shipped.find_default(90) == tmp_path / "sm90.json"
    assert shipped.find_default(90, ("db",), regime="sustained") == tmp_path / "sm90.db"


def test_runtime_regime_from_argument_or_environment(monkeypatch, db):
    monkeypatch.delenv(tuned_table.REGIME_ENV, raising=False)
    # the fake rows' sources and versions are not this checkout's: compare nothing
    monkeypatch.setattr(tuned_table, "current_environment", lambda: tuned_table.Environment())
    problem = Problem(MAIN.with_(num_layers=1), "paged", 64, 8, 32768)
    assert Runtime(str(db)).regime == "burst"
    assert dict(Runtime(str(db), regime="sustained").dispatcher.pick(problem, 90).params) == TMA
    monkeypatch.setenv(tuned_table.REGIME_ENV, "sustained")
    rt = Runtime(str(db))
    assert rt.regime == "sustained" and dict(rt.dispatcher.pick(problem, 90).params) == TMA
    assert "sustained regime" in rt.dispatcher.pick(problem, 90).source
    with pytest.raises(ValueError, match="regime 'warm'"):
        Runtime(str(db), regime="warm")
    monkeypatch.setenv(tuned_table.REGIME_ENV, "warm")  # never fails a serving process
    with pytest.warns(RuntimeWarning, match="DRAFTER_REGIME='warm'"):
        assert Runtime(str(db)).regime == "burst"


def test_bench_regime_options(monkeypatch, db):
    monkeypatch.delenv(tuned_table.REGIME_ENV, raising=False)
    monkeypatch.setattr(tuned_table, "current_environment", lambda: tuned_table.Environment())
    g = get_preset(MAIN_PRESET)

    def plan(*argv):
        args = bench_cli.build_parser().parse_args(["decode", "--batch", "8", "--ctx", "32k", *argv])
        return bench_cli._measure_plan(args, g, MAIN_PRESET)

    assert (plan().regime, plan().sustain_s) == ("burst", 0.0)
    hot = plan("--regime", "sustained")
    assert (hot.regime, hot.sustain_s) == ("sustained", tuned_table.SUSTAIN_S)
    assert any("after 0.75 s" in n for n in hot.notes) and any("sustained regime's table" in n for n in hot.notes)
    assert not any("regime" in n for n in plan("--sustain", "0.5").notes)
    assert plan("--regime", "sustained", "--sustain", "2").sustain_s == 2.0
    assert plan("--sustain", "0.5").regime == "burst"
    monkeypatch.setenv(tuned_table.REGIME_ENV, "sustained")
    assert plan().regime == "sustained"
    with pytest.raises(SystemExit):
        plan("--regime", "hot")
    d, note = decode.load_dispatcher(str(db), sm=90, regime="sustained")
    assert note.endswith("(sustained regime)")
    assert dict(d.pick(Problem(g.with_(num_layers=1), "paged", 64, 8, 32768), 90).params) == TMA


def test_attention_table_auto_items_name_their_regime(monkeypatch):
    monkeypatch.delenv(tuned_table.REGIME_ENV, raising=False)
    assert attention_table.auto_regime("auto") == "burst"
    assert attention_table.auto_regime("auto:sustained") == "sustained"
    assert attention_table.auto_regime("cupy:ws=3") is None
    with pytest.raises(SystemExit, match="one of burst, sustained"):
        attention_table.auto_regime("auto:hot")
    monkeypatch.setenv(tuned_table.REGIME_ENV, "sustained")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert attention_table.auto_regime("auto") == "sustained"


def test_markdown_tables_need_no_tabulate():
    """The attention table and the report write markdown without pandas' optional tabulate (not
    a dependency: a fresh install's attention table failed at its very end on it)."""
    import pandas as pd

    from drafter_attn.bench.output import markdown_table

    text = markdown_table(pd.DataFrame({"impl": ["auto", "auto:sustained"], "attn_us": [261.94, float("nan")]}))
    assert text.splitlines() == ["| impl | attn_us |", "|---|---|", "| auto | 261.9 |", "| auto:sustained |  |"]
    assert markdown_table(pd.DataFrame()) == "(none)"
    assert "to_markdown" not in Path(attention_table.__file__).read_text()


def test_predictions_and_the_report_take_bursts_only(db, capsys):
    """`tuner predict` projects burst rows only (a projected sustained timing would land on the
    target as a burst's number), and `bench report` compares burst timings."""
    from drafter_attn.bench import report

    with ProfileDB(db) as d:  # predict needs the bytes each row moved
        d.conn.execute("UPDATE results SET bytes_moved = batch * ctx_len * 20480")
    assert tuner_main(["predict", "--db", str(db), "--sm", "103", "--from", "90"]) == 0
    assert "6 predicted rows written from sm90" in capsys.readouterr().err  # of 10 rows, 4 sustained
    with ProfileDB(db, readonly=True) as d:
        got = d.query("SELECT batch, ctx_len, median_us FROM results WHERE provenance = 'predicted'")
    assert len(got) == 6 and all(r["median_us"] < 250.0 for r in got)  # no projection of 255-290
    with ProfileDB(db) as d:  # a key timed sustained only: no burst row stands for it
        env = d.query("SELECT env_id FROM environments")[0]["env_id"]
        d.add_result(row(env, batch=2, ctx=4096, params=TMA, median_us=50.0, sustain_s=0.75))
    df = report.load(db, sm=90)
    assert sorted(zip(df.batch, df.ctx_len, df.median_us)) == [(1, 2048, 10.0), (8, 16384, 120.0),
                                                              (8, 32768, 240.0)]
