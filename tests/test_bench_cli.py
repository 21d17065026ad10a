"""The `bench` command on the CPU: option parsing, every error message, and `bench decode` /
`bench prefill` / `bench report` end to end with the GPU and the measurements faked (the real
measurements run in tests/test_bench_gpu.py)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

from drafter_attn.bench import cli, decode, gpu, options
from drafter_attn.bench.steps import ContextStep
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.tuner.db import ProfileDB

H200 = gpu.GpuInfo(0, "NVIDIA H200", 90, 132, 141 * 2**30)
B200 = gpu.GpuInfo(1, "NVIDIA B200", 100, 148, 180 * 2**30)
ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Option values


def test_sizes():
    assert options.sizes("2k,8k,32k") == [2048, 8192, 32768]
    assert options.sizes("1M, 128k ,7") == [1 << 20, 131072, 7]
    assert options.sizes("1.5k") == [1536]
    assert options.sizes("64,64,128") == [64, 128]
    assert options.contexts("0,8k") == [0, 8192]
    assert options.max_ctx("1M") == 1 << 20


@pytest.mark.parametrize("fn, text, message", [
    (options.batches, "abc", "cannot read 'abc'"),
    (options.batches, "1.7", "not a whole number"),
    (options.batches, "0", "at least 1"),
    (options.batches, "", "expected comma-separated"),
    (options.pages, "100", "powers of two"),
    (options.contexts, "2g", "cannot read '2g'"),
    (options.max_ctx, "1k,2k", "expected one"),
    (options.heads, "32/5", "not a multiple of KV heads 5"),
    (options.heads, "a/b", "expected query/KV heads"),
    (options.sm, "hopper", "expected an SM number"),
    (options.positive_float, "-1", "positive number"),
])
def test_bad_values_say_what_was_expected(fn, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        fn(text)


def test_heads_and_sm():
    assert options.heads("32/8") == (32, 8)
    assert options.heads("16") == (16, 16)
    for text in ("90", "sm90", "sm_90", "sm_90a", "SM_90", "9.0"):
        assert options.sm(text) == 90
    assert options.sm("107") == 107 and options.sm("sm_100a") == 100


def _decode_args(argv):
    return cli.build_parser().parse_args(["decode", *argv])


def test_decode_defaults_measure_the_main_preset_at_pages_64_and_128_against_arena():
    args = _decode_args([])
    assert (args.page, args.batch, args.ctx, args.impl, args.sm) == ([64, 128], [1, 8, 32], [2048, 8192, 32768], "auto", None)
    geometry, label = options.geometry_from_args(args)
    assert label == MAIN_PRESET and geometry == get_preset(MAIN_PRESET)
    p = decode.plan("decode", geometry, label, label, pages=args.page, batches=args.batch, ctxs=args.ctx,
                    impls=["auto"], baseline="none")
    assert len(p.jobs) == 3 * 3 * 3
    assert {(j.layout, j.page) for j in p.jobs} == {("paged", 64), ("paged", 128), ("arena", None)}
    assert {j.step for j in p.jobs} == {"decode"} and p.rows_stored is None


def test_explicit_geometry_overrides_the_preset():
    args = _decode_args(["--heads", "32/8", "--head-dim", "128", "--block", "16", "--mask", "sliding",
                         "--window", "512", "--layers", "3"])
    geometry, label = options.geometry_from_args(args)
    assert geometry == Geometry(32, 8, 128, 16, "sliding", 512, num_layers=3)
    assert label == "custom:32/8 d128 b16 sliding512 L3 bf16"
    # The same fields as the preset: still the preset
    args = _decode_args(["--heads", "32/8", "--head-dim", "128", "--block", "16", "--mask", "full", "--layers", "5"])
    assert options.geometry_from_args(args) == (get_preset(MAIN_PRESET), MAIN_PRESET)
    args = _decode_args(["--preset", "laguna-dflash", "--layers", "1"])
    g, label = options.geometry_from_args(args)
    assert (g.num_q_heads, g.mask, g.window, g.num_layers) == (72, "sliding_causal", 512, 1)


def test_accepted_sets_the_rows_stored():
    g = get_preset(MAIN_PRESET)
    assert decode.rows_stored_for(3.4, 16) == pytest.approx(4.4)
    assert decode.rows_stored_for(None, 16) is None
    p = decode.plan("decode", g, MAIN_PRESET, MAIN_PRESET, pages=[64], batches=[1], ctxs=[8], impls=["reference"],
                    accepted=3.4, baseline="none")
    assert p.rows_stored == pytest.approx(4.4) and p.accepted == 3.4


# ---------------------------------------------------------------------------------------------
# Error messages (exit code 2)


@pytest.fixture
def fake_h200(monkeypatch):
    monkeypatch.setattr(gpu, "probe", lambda: [H200])


def _err(capsys, argv) -> str:
    rc = cli.main(argv)
    assert rc == 2
    return capsys.readouterr().err


def _argparse_err(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_sm_mismatch_names_the_gpu_and_what_to_do(fake_h200, capsys):
    err = _err(capsys, ["decode", "--sm", "107", "--page", "128"])
    assert "--sm 107 does not match the GPU here" in err
    assert "NVIDIA H200" in err and "SM 90" in err
    assert "run without --sm, or with --sm 90" in err
    # nothing measured on SM 107 (the shipped profile is sm90's): how to project it
    assert "project SM 107 from another SM's measurements: tuner predict --sm 107" in err
    assert "bench report --sm 107" not in err


def test_sm_mismatch_known_sm_is_named(fake_h200, capsys):
    err = _err(capsys, ["decode", "--sm", "100"])
    assert "SM 100 (B200 / GB200 (Blackwell))" in err


def test_sm_picks_the_matching_gpu_of_several():
    assert gpu.require_gpu(100, gpus=[H200, B200]) is B200
    assert gpu.require_gpu(None, gpus=[H200, B200]) is H200
    with pytest.raises(options.BenchError, match="cuda:0 NVIDIA H200 .*cuda:1 NVIDIA B200"):
        gpu.require_gpu(103, gpus=[H200, B200])


def test_no_gpu_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu, "probe", lambda: [])
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "none.db"))
    err = _err(capsys, ["decode", "--sm", "107", "--page", "128"])
    assert "bench decode: no CUDA GPU found" in err
    assert "torch.cuda.is_available() = False" in err
    assert "bench memory" in err and "bench report" in err
    # --sm N: what is recorded for SM N (nothing here: how to project it)
    assert "project SM 107 from another SM's measurements: tuner predict --sm 107" in err
    assert not (tmp_path / "none.db").exists()
    monkeypatch.delenv("DRAFTER_DB")  # the shipped sm90 profile: measured, so report it
    err = _err(capsys, ["decode", "--sm", "90"])
    assert "see what was measured on SM 90: bench report --sm 90" in err and "tuner predict" not in err
    err = _err(capsys, ["decode", "--sm", "9000"])
    assert "nothing is recorded for SM 9000" in err and "tuner predict --sm" not in err
    err = _err(capsys, ["prefill"])
    assert "bench prefill: no CUDA GPU found" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the real no-GPU path")
def test_no_gpu_real_process():
    proc = subprocess.run([sys.executable, "-m", "drafter_attn.bench.cli", "decode", "--sm", "107", "--page", "128"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["decode", "--accepted", "16"], "--accepted 16: a step stores accepted + 1 = 17 rows"),
    (["decode", "--impl", "triton"], "--impl triton: unknown implementation 'triton'; known: auto, "),
    (["decode", "--mask", "sliding"], "--mask sliding needs --window W"),
    (["decode", "--mask", "full", "--window", "64"], "--window applies to the sliding masks only"),
    (["decode", "--heads", "32/8", "--block", "0"], None),  # argparse: positive integer
    (["decode", "--ctx", "32k", "--max-ctx", "32k"], "--max-ctx 32768: the largest context 32768 plus the 16 rows"),
    (["decode", "--baseline", "flashinfer", "--preset", "dflash2-w2048"], None),
    (["prefill", "--chunk", "4k", "--ctx", "8k", "--max-ctx", "10k"], "plus the 4096 rows a context step stores"),
])
def test_option_errors(fake_h200, capsys, argv, message, monkeypatch):
    from drafter_attn.kernels import baselines

    monkeypatch.setattr(baselines, "flashinfer_available", lambda: True)
    if message is None:
        rc = None
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
        assert rc == 2
        return
    assert message in _err(capsys, argv)


def test_baseline_errors(fake_h200, capsys, monkeypatch):
    from drafter_attn.kernels import baselines

    monkeypatch.setattr(baselines, "flashinfer_available", lambda: False)
    assert "FlashInfer is not installed" in _err(capsys, ["decode", "--baseline", "flashinfer"])
    monkeypatch.setattr(baselines, "flashinfer_available", lambda: True)
    assert "covers mask 'full' only" in _err(capsys, ["decode", "--baseline", "flashinfer", "--preset", "mimo-dflash"])


@pytest.mark.parametrize("argv, option", [
    (["decode", "--page", "100"], "--page"),
    (["decode", "--batch", "0"], "--batch"),
    (["decode", "--ctx", "lots"], "--ctx"),
    (["decode", "--sm", "hopper"], "--sm"),
    (["decode", "--heads", "32/5"], "--heads"),
    (["decode", "--preset", "nope"], "--preset"),
    (["decode", "--accepted", "-1"], "--accepted"),
    (["decode", "--baseline", "vllm"], "--baseline"),
    (["prefill", "--chunk", "0"], "--chunk"),
])
def test_argparse_errors_name_the_option(capsys, argv, option):
    assert f"argument {option}" in _argparse_err(capsys, argv)


def test_report_without_database(tmp_path, capsys):
    err = _err(capsys, ["report", "--db", str(tmp_path / "none.db")])
    assert "no profile database at" in err
    ProfileDB(tmp_path / "empty.db").close()
    err = _err(capsys, ["report", "--db", str(tmp_path / "empty.db"), "--sm", "107"])
    assert "no measured (ok) results for SM 107" in err


# ---------------------------------------------------------------------------------------------
# Which implementation: auto


class _FakeDispatcher:
    loaded = None

    def __init__(self, fail=False):
        self.fail = fail

    @classmethod
    def load(cls, path, env=None, regime="burst"):
        d = cls()
        d.loaded, d.env, d.regime = path, env, regime
        return d

    def pick(self, problem, sm):
        if self.fail:
            raise RuntimeError("broken")
        return types.SimpleNamespace(impl="reference", params={}, tier="exact",
                                     reason=f"exact: measured at this exact problem on sm{sm}")


def test_auto_uses_the_dispatcher(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "drafter_attn.kernels.dispatcher",
                        types.SimpleNamespace(Dispatcher=_FakeDispatcher, CURRENT="current"))
    monkeypatch.delenv("DRAFTER_TUNED_TABLE", raising=False)
    d, note = decode.load_dispatcher(str(tmp_path / "none.db"))
    assert d.loaded is None and note.startswith("kernels.dispatch, default heuristic")
    (tmp_path / "t.json").write_text("{}")
    monkeypatch.setenv("DRAFTER_TUNED_TABLE", str(tmp_path / "t.json"))
    d, note = decode.load_dispatcher(str(tmp_path / "none.db"))
    assert d.loaded == str(tmp_path / "t.json") and note == f"kernels.dispatch over {tmp_path / 't.json'}"
    assert d.env == "current"  # entries are checked against this process's GPU and sources
    problem = Problem(get_preset(MAIN_PRESET), "arena", None, 1, 128)
    pick = decode.resolve_impl("auto", problem, dispatcher=d, dispatcher_note=note, sm=90)
    assert (pick.impl, pick.params) == ("reference", {})
    assert pick.note.endswith("picked reference, exact: measured at this exact problem on sm90")
    assert pick.summary == f"auto: {note}, tier exact"
    pick = decode.resolve_impl("auto", problem, dispatcher=_FakeDispatcher(fail=True), dispatcher_note=note)
    assert pick.impl == "cupy" and "RuntimeError: broken" in pick.note


def test_auto_with_the_real_dispatch_and_an_empty_database(monkeypatch, tmp_path):
    monkeypatch.delenv("DRAFTER_TUNED_TABLE", raising=False)
    ProfileDB(tmp_path / "p.db").close()
    d, note = decode.load_dispatcher(str(tmp_path / "p.db"))
    problem = Problem(get_preset(MAIN_PRESET), "paged", 64, 8, 8192)
    pick = decode.resolve_impl("auto", problem, dispatcher=d, dispatcher_note=note, sm=90)
    assert pick.impl in ("cupy", "reference") and "tier default" in pick.summary


def test_auto_without_db_reads_what_the_runtime_reads(monkeypatch, tmp_path):
    """No $DRAFTER_TUNED_TABLE and no --db: the table shipped for the SM (as kernels.Runtime
    reads it), not the database bench records into, which may hold only bench's own rows."""
    from drafter_attn.kernels.shipped import find_default

    monkeypatch.delenv("DRAFTER_TUNED_TABLE", raising=False)
    monkeypatch.delenv("DRAFTER_DB", raising=False)
    shipped = find_default(90)
    assert shipped is not None and shipped.name == "sm90.json"
    d, note = decode.load_dispatcher(None, sm=90)
    assert note == f"kernels.dispatch over {shipped}"
    d, note = decode.load_dispatcher(None, sm=1)  # no table shipped for that SM
    assert note == "kernels.dispatch, default heuristic" and not d.entries
    ProfileDB(tmp_path / "p.db").close()  # --db given: its entries (none: the heuristic answers)
    d, note = decode.load_dispatcher(str(tmp_path / "p.db"), sm=90)
    assert note == f"kernels.dispatch over {tmp_path / 'p.db'}" and not d.entries


def test_explicit_impl_gets_its_full_default_params():
    problem = Problem(get_preset(MAIN_PRESET), "paged", 64, 1, 128)
    pick = decode.resolve_impl("reference", problem)
    assert (pick.impl, pick.params, pick.note) == ("reference", {}, "--impl reference")


# ---------------------------------------------------------------------------------------------
# bench decode / prefill / report end to end, GPU and measurements faked


def _fake_env(g):
    return dict(gpu_name=g.name, sm=g.sm, sm_count=g.sm_count, driver="580.95", cuda="13.0", torch="fake",
                cupy=None, cutlass=None, nvrtc=None, sources_hash="0" * 16)


def _fake_decode(wire, reps=0, nsys=False):
    p = wire["problem"]
    base = 10 + p["batch"] * p["ctx_len"] / 1000
    t = base * (1.005 if p["layout"] == "paged" else 1.0)  # paged: +0.5%
    return dict(status="ok", median_us=t, p10_us=t * 0.99, p90_us=t * 1.02, attention_median_us=0.8 * t,
                store_median_us=0.2 * t, syncs_debug=0, syncs_profiler=0, rel_err=2e-3, bytes_moved=1000,
                bandwidth_gbs=3000.0, roofline_fraction=0.7, kv_bytes=123, graph_capturable=True)


def _fake_context(wire, chunk, reps=0):
    row = _fake_decode(wire)
    row["syncs_profiler"] = 1  # as if a host copy had slipped into the context store
    return row


def _fake_baseline(name, geometry, page, batch, ctx, layers=1, reps=0, sustain_s=0.0, sustain_load="self"):
    """A baseline whose calls cost 4 us of launch and 6 us a layer."""
    us = 4.0 + 6.0 * layers
    return dict(status="ok", median_us=us, p10_us=us - 0.5, p90_us=us + 1.0, attention_median_us=us,
                read_floor_us=2.0 * layers)


def _apply_fakes(mp) -> None:
    """The GPU, its environment, the measurements and FlashInfer faked on `mp` (a MonkeyPatch)."""
    from drafter_attn.kernels import baselines

    mp.setattr(gpu, "probe", lambda: [H200])
    mp.setattr(decode, "gpu_environment", _fake_env)
    mp.setattr(decode, "default_measures", lambda: (_fake_decode, _fake_context, _fake_baseline))
    mp.setattr(decode, "default_floor", lambda: lambda nbytes: None)
    mp.setattr(baselines, "flashinfer_available", lambda: True)
    mp.delenv("DRAFTER_TUNED_TABLE", raising=False)


@pytest.fixture
def fake_bench(monkeypatch):
    _apply_fakes(monkeypatch)


@pytest.fixture(scope="module")
def faked_decode(tmp_path_factory):
    """One faked `bench decode` (pages 64 and 128, batches 1 and 8, contexts 2k and 8k), run once for
    the tests below: its exit status, console text, database, results folder and CSV."""
    import contextlib
    import io

    tmp = tmp_path_factory.mktemp("faked_decode")
    db, out = tmp / "p.db", tmp / "out"
    argv = ["decode", "--sm", "90", "--page", "64,128", "--batch", "1,8", "--ctx", "2k,8k", "--accepted", "3.4",
            "--db", str(db), "--out", str(out)]
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        _apply_fakes(mp)
        rc = cli.main(argv)
    df = pd.read_csv(out / "decode.csv") if (out / "decode.csv").exists() else None
    return types.SimpleNamespace(rc=rc, text=stdout.getvalue(), db=db, out=out, df=df)


def test_decode_faked_console_output(faked_decode):
    assert faked_decode.rc == 0
    text = faked_decode.text
    assert f"impl picked: cupy (auto: kernels.dispatch over {faked_decode.db}, tier default)" in text
    assert "paged over arena median +0.500%" in text
    for name in ("decode.csv", "decode.json", "decode.png"):
        assert (faked_decode.out / name).stat().st_size > 0


def test_decode_faked_csv_rows(faked_decode):
    df = faked_decode.df
    ours = df[df.impl == "cupy"]
    base = df[df.impl == "flashinfer-fa2"]
    assert len(ours) == 2 * 2 * 3 and len(base) == 2 * 2 * 2
    assert set(ours.status) == {"ok"} and (ours.syncs == 0).all()
    paged = ours[ours.layout == "paged"]
    assert paged.overhead_pct.round(6).eq(0.5).all()
    assert ours[ours.layout == "arena"].overhead_pct.isna().all()
    assert (ours.rows_stored.round(3) == 4.4).all() and (ours.accepted == 3.4).all()


def test_decode_faked_csv_baseline_times_every_layer_in_one_call(faked_decode):
    df = faked_decode.df
    base = df[df.impl == "flashinfer-fa2"]
    # the baseline: 5 layers' attention in one call (one launch), as measured: not one layer x 5
    assert (base.median_us == 4.0 + 5 * 6.0).all() and (base.scope == "attention, 5 layers").all()
    assert (base.read_floor_us == 10.0).all()  # the floor of the same five layers' bytes
    assert base.impl_note.str.contains("5 layers in one graph").all()


def test_decode_faked_csv_kv_memory_model(faked_decode):
    df = faked_decode.df
    ours = df[df.impl == "cupy"]
    # KV model: concurrency = batch, max ctx = 8k + 16; arena dense, paged by pages
    row = ours[(ours.layout == "paged") & (ours.page_size == 64) & (ours.batch == 8) & (ours.ctx == 2048)].iloc[0]
    assert row.kv_max_ctx == 8192 + 16
    assert row.kv_arena_model_bytes == 8 * (8192 + 16) * 20480
    assert row.kv_model_bytes == 8 * 33 * 64 * 20480 + 8 * 129 * 4  # ceil(2064/64)=33, ceil(8208/64)=129


def test_decode_faked_json(faked_decode):
    doc = json.loads((faked_decode.out / "decode.json").read_text())
    env = doc["environment"]
    assert env["gpu_name"] == "NVIDIA H200" and env["sm"] == 90 and env["driver"] == "580.95"
    assert env["command"].startswith("bench decode --sm 90 --page 64,128") and env["commit"]
    assert doc["settings"]["rows_stored"] == pytest.approx(4.4)
    assert len(doc["rows"]) == len(faked_decode.df)


def test_decode_faked_database_rows(faked_decode):
    with ProfileDB(faked_decode.db, create=False) as pdb:
        rows = pdb.query("SELECT impl, layout, num_layers, accepted, sweep_id, worker FROM results")
    assert len(rows) == len(faked_decode.df)
    assert {r["worker"] for r in rows} == {"bench"} and all(r["sweep_id"].startswith("bench-decode-") for r in rows)
    assert {r["num_layers"] for r in rows if r["impl"] == "flashinfer-fa2"} == {5}
    assert {round(r["accepted"], 3) for r in rows if r["impl"] == "cupy"} == {4.4}


def test_decode_faked_database_baseline_has_no_step_latency(faked_decode):
    with ProfileDB(faked_decode.db, create=False) as pdb:
        base_db = pdb.query("SELECT median_us, attention_median_us, reason FROM results WHERE impl = 'flashinfer-fa2'")
    # no step latency for the baseline (dispatch ranks by it): its layers' attention is in attention_*
    assert all(r["median_us"] is None and r["attention_median_us"] == 34.0 for r in base_db)
    assert "the layers' attention only" in base_db[0]["reason"]


def test_report_from_faked_decode(faked_decode, fake_bench, tmp_path, capsys):
    db, rep = faked_decode.db, tmp_path / "rep"
    assert cli.main(["report", "--db", str(db), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "## SM 90, NVIDIA H200: qwen3-8b-dflash-b16" in md
    assert "| decode 4.4 rows | cupy | 64 | 0.5 |" in md  # --accepted 3.4: 4.4 rows stored a step
    assert "flashinfer-fa2 (attention only) page 64" in md
    assert (rep / "report-sm90-qwen3-8b-dflash-b16.png").stat().st_size > 0
    assert _err(capsys, ["report", "--db", str(db), "--sm", "100"]).count("no measured (ok) results for SM 100") == 1


def test_report_of_a_tuning_sweep_compares_each_impls_fastest_set(tmp_path):
    """A database with several parameter sets per problem (a tuning sweep, the shipped sm90.db):
    one row per implementation and problem, its fastest, on each side of paged over arena."""
    from profile_fakes import H200, build_db

    rows = []
    for layout, page in (("paged", 64), ("arena", None)):
        for params, us in (({"tile_n": 64}, 100.0), ({"tile_n": 32}, 90.0 if page else 120.0)):
            rows.append(dict(layout=layout, page=page, batch=8, ctx=2048, params=params, median_us=us))
    db, rep = tmp_path / "p.db", tmp_path / "rep"
    build_db(db, {"h": (H200, rows)})
    assert cli.main(["report", "--db", str(db), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "0 measured" not in md and "2 measured rows" in md
    assert "| decode | cupy | 64 | -10 |" in md  # paged's 90 over arena's 100


def test_report_takes_a_candidates_newest_row_across_environments(tmp_path):
    """Kernel sources changed and some candidates were measured again (a new environment): each
    candidate enters the report once, as its newest measurement, so paged over arena compares
    one row each (two arena rows of one problem once made the report fail)."""
    from profile_fakes import H200, build_db

    def rows(arena_us):
        return [dict(layout="paged", page=64, batch=8, ctx=2048, params={"tile_n": 64}, median_us=90.0),
                dict(layout="arena", page=None, batch=8, ctx=2048, params={"tile_n": 64},
                     median_us=arena_us)]

    db, rep = tmp_path / "p.db", tmp_path / "rep"
    build_db(db, {"old": (H200, rows(80.0)), "new": ({**H200, "sources_hash": "src-b"}, rows(100.0))})
    assert cli.main(["report", "--db", str(db), "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert "2 measured rows" in md
    assert "| decode | cupy | 64 | -10 |" in md  # the newer arena row (100), not the older (80)


def test_report_of_the_shipped_profile(tmp_path):
    from drafter_attn.kernels.shipped import find_default

    shipped = find_default(90, ("db",))
    if shipped is None:
        pytest.skip("no shipped profiles/sm90.db")
    assert cli.main(["report", "--sm", "90", "--db", str(shipped), "--out", str(tmp_path)]) == 0
    assert "## SM 90, NVIDIA H200" in (tmp_path / "report.md").read_text()


def test_report_sections_per_geometry(faked_decode, fake_bench, tmp_path):
    # a sliding-window preset and a custom geometry in the same database: sections of their own
    db, rep = tmp_path / "p.db", tmp_path / "rep"
    db.write_bytes(faked_decode.db.read_bytes())  # a copy: the shared database stays as decoded
    for extra in (["--preset", "dflash2-w2048"], ["--heads", "16/4", "--layers", "2"]):
        assert cli.main(["decode", *extra, "--batch", "1", "--ctx", "2k", "--page", "64", "--db", str(db),
                         "--out", str(tmp_path / "out2")]) == 0
    assert cli.main(["report", "--db", str(db), "--sm", "90", "--out", str(rep)]) == 0
    md = (rep / "report.md").read_text()
    assert md.count("## SM 90, NVIDIA H200") == 3
    assert "## SM 90, NVIDIA H200: dflash2-w2048 (32/8 d128 b16 sliding2048 L5 bf16)" in md
    assert "## SM 90, NVIDIA H200: 16/4 d128 b16 full L2 bf16" in md
    assert "flashinfer-fa2 (attention only)" in md  # the baseline of the custom full-mask geometry
    assert len(list(rep.glob("report-sm90-*.png"))) == 3
    assert cli.main(["report", "--db", str(db), "--preset", "dflash2-w2048", "--out", str(tmp_path / "r2")]) == 0
    assert (tmp_path / "r2" / "report.md").read_text().count("## SM 90") == 1


def test_decode_with_context_chunk_and_prefill_faked(fake_bench, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["decode", "--impl", "reference", "--batch", "2", "--ctx", "1k", "--page", "16", "--baseline", "none",
            "--context-chunk", "512", "--db", str(tmp_path / "p.db"), "--out", str(out)]
    assert cli.main(argv) == 0
    df = pd.read_csv(out / "decode.csv")
    assert sorted(df.step) == ["context", "context", "decode", "decode"]
    ctx = df[df.step == "context"]
    assert (ctx.chunk == 512).all() and (ctx.rows_stored == 512).all() and (ctx.syncs == 1).all()
    assert "blocking host syncs inside the step" in capsys.readouterr().out
    assert cli.main(["prefill", "--impl", "reference", "--batch", "1", "--ctx", "0", "--page", "64",
                     "--chunk", "2k", "--db", str(tmp_path / "p.db"), "--out", str(out)]) == 0
    df = pd.read_csv(out / "prefill.csv")
    assert list(df.step) == ["context", "context"] and (df.chunk == 2048).all()
    assert (out / "prefill.png").exists() and (out / "prefill.json").exists()
    row = df[df.layout == "paged"].iloc[0]
    assert row.kv_model_bytes == 1 * 32 * 64 * 20480 + 1 * 32 * 4  # 2048 rows in 64-token pages


def test_decode_sustained_regime_times_and_records_sustained(fake_bench, monkeypatch, tmp_path):
    """--regime sustained: every step and baseline is measured as a sustained candidate (its wire
    carries the load) and recorded with it, so that a burst table never takes those rows."""
    seen = []

    def measure(wire, reps=0, nsys=False):
        seen.append(wire["sustain_s"])
        return _fake_decode(wire)

    def base(name, geometry, page, batch, ctx, layers=1, reps=0, sustain_s=0.0, sustain_load="self"):
        seen.append(sustain_s)
        return _fake_baseline(name, geometry, page, batch, ctx)

    monkeypatch.setattr(decode, "default_measures", lambda: (measure, _fake_context, base))
    db = tmp_path / "p.db"
    argv = ["decode", "--batch", "1", "--ctx", "1k", "--page", "64", "--regime", "sustained",
            "--db", str(db), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    assert len(seen) >= 3 and set(seen) == {0.75}  # paged, arena, and each baseline
    with ProfileDB(db, readonly=True) as d:
        assert {r["sustain_s"] for r in d.query("SELECT sustain_s FROM results")} == {0.75}


def test_decode_under_a_co_runners_load(fake_bench, monkeypatch, tmp_path, capsys):
    """--sustain-load gemm: steps and baselines measured as candidates of that load (the wire
    carries it, the rows record it, the notes say it); without a sustained timing it is refused
    before anything is measured."""
    seen = []

    def measure(wire, reps=0, nsys=False):
        seen.append((wire["sustain_s"], wire["sustain_load"]))
        return _fake_decode(wire)

    def base(name, geometry, page, batch, ctx, layers=1, reps=0, sustain_s=0.0, sustain_load="self"):
        seen.append((sustain_s, sustain_load))
        return _fake_baseline(name, geometry, page, batch, ctx)

    monkeypatch.setattr(decode, "default_measures", lambda: (measure, _fake_context, base))
    db = tmp_path / "p.db"
    argv = ["decode", "--batch", "1", "--ctx", "1k", "--page", "64", "--regime", "sustained",
            "--sustain-load", "gemm", "--db", str(db), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    assert len(seen) >= 3 and set(seen) == {(0.75, "gemm")}
    assert "co-runner's load (gemm)" in capsys.readouterr().out
    with ProfileDB(db, readonly=True) as d:
        assert {r["sustain_load"] for r in d.query("SELECT sustain_load FROM results")} == {"gemm"}
    seen.clear()
    assert cli.main(["decode", "--batch", "1", "--ctx", "1k", "--sustain-load", "gemm",
                     "--db", str(db)]) == 2
    assert "needs a sustained timing" in capsys.readouterr().err and not seen


def test_failed_measurement_exits_1(fake_bench, monkeypatch, tmp_path, capsys):
    def broken(wire, reps=0, nsys=False):
        if wire["problem"]["layout"] == "paged":
            return dict(status="failed_correctness", reason="attention relative error 3e-01 [at drafter.cu:12]")
        return _fake_decode(wire)

    monkeypatch.setattr(decode, "default_measures", lambda: (broken, _fake_context, _fake_baseline))
    argv = ["decode", "--batch", "1", "--ctx", "1k", "--page", "64", "--baseline", "none",
            "--db", str(tmp_path / "p.db"), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 1
    text = capsys.readouterr().out
    assert "1 of 2 measurements failed" in text
    assert "[at drafter.cu:12]" in text  # reasons are shown as text, not read as rich markup
    df = pd.read_csv(tmp_path / "out" / "decode.csv")
    assert set(df.status) == {"ok", "failed_correctness"}


def test_interrupt_keeps_and_writes_the_rows_so_far(fake_bench, monkeypatch, tmp_path, capsys):
    calls = []

    def interrupted(wire, reps=0, nsys=False):
        calls.append(wire)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return _fake_decode(wire)

    monkeypatch.setattr(decode, "default_measures", lambda: (interrupted, _fake_context, _fake_baseline))
    db, out = tmp_path / "p.db", tmp_path / "out"
    argv = ["decode", "--batch", "1", "--ctx", "1k,2k", "--page", "64", "--baseline", "none",
            "--db", str(db), "--out", str(out)]
    assert cli.main(argv) == 130
    assert "1 of 4 rows measured" in capsys.readouterr().out
    assert len(pd.read_csv(out / "decode.csv")) == 1
    with ProfileDB(db, create=False) as pdb:
        assert pdb.count() == 1


def test_sigterm_keeps_and_writes_the_rows_so_far(fake_bench, monkeypatch, tmp_path, capsys):
    """A scheduler's or `timeout`'s SIGTERM stops a measurement as Ctrl-C does: the rows so far
    are recorded and written, exit 130, and the previous handler is back afterwards."""
    import os
    import signal

    calls = []

    def terminated(wire, reps=0, nsys=False):
        calls.append(wire)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return _fake_decode(wire)

    monkeypatch.setattr(decode, "default_measures", lambda: (terminated, _fake_context, _fake_baseline))
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    argv = ["decode", "--batch", "1", "--ctx", "1k,2k", "--page", "64", "--baseline", "none",
            "--db", str(tmp_path / "p.db"), "--out", str(out)]
    assert cli.main(argv) == 130
    assert "2 of 4 rows measured" in capsys.readouterr().out
    assert len(pd.read_csv(out / "decode.csv")) == 2
    assert signal.getsignal(signal.SIGTERM) is before


def test_every_row_is_on_disk_the_moment_it_is_measured(fake_bench, monkeypatch, tmp_path):
    """A run that dies without any chance to clean up (here: an error no handler expects) leaves
    decode.csv holding every row measured before it, --table-capacity rows (never recorded in
    the database) included."""
    calls = []

    class Fatal(BaseException):
        pass

    def dies(wire, reps=0, nsys=False, **step_options):
        calls.append(step_options)
        if len(calls) == 3:
            raise Fatal
        return _fake_decode(wire)

    monkeypatch.setattr(decode, "default_measures", lambda: (dies, _fake_context, _fake_baseline))
    out = tmp_path / "out"
    argv = ["decode", "--batch", "1", "--ctx", "1k", "--page", "64", "--baseline", "none",
            "--table-capacity", "128k", "--db", str(tmp_path / "p.db"), "--out", str(out)]
    with pytest.raises(Fatal):
        cli.main(argv)
    df = pd.read_csv(out / "decode.csv")
    assert len(df) == 2 and set(df.status) == {"ok"}
    assert calls[1] == {"table_capacity": 128 * 1024}
    assert df.table_capacity.iloc[1] == 128 * 1024
    assert not (out / "decode.json").exists()


def test_default_results_folder(fake_bench, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert decode.results_dir(90, date=dt.date(2026, 11, 30)) == Path("results/sm90-2026-11-30")
    assert cli.main(["decode", "--batch", "1", "--ctx", "64", "--page", "16", "--impl", "reference",
                     "--baseline", "none", "--db", str(tmp_path / "p.db")]) == 0
    folder = tmp_path / "results" / f"sm90-{dt.date.today():%Y-%m-%d}"
    assert sorted(p.name for p in folder.iterdir()) == ["decode.csv", "decode.json", "decode.png"]


# ---------------------------------------------------------------------------------------------
# The context step itself (CPU, reference backend)


@pytest.mark.parametrize("layout", ["paged", "arena"])
@pytest.mark.parametrize("ctx", [0, 13])
def test_context_step_stores_the_chunk(layout, ctx):
    g = Geometry(8, 2, 64, 4, "sliding", 6, num_layers=2, dtype="float32")
    step = ContextStep(Problem(g, layout, 8 if layout == "paged" else None, 3, ctx), "reference", chunk=20,
                       device="cpu")
    first = torch.stack(step.run())
    assert step._lens.tolist() == [[ctx + 20] * 3] * 2
    assert torch.equal(torch.stack(step.run()), first)  # re-runnable: lengths reset first
    assert torch.equal(torch.stack(step.attention_only()), first)
    assert step.check() < 1e-5
    assert step.num_new_rows == [20] * 3 and step.k_new[0].shape == (3, 20, 2, 64)
    if layout == "arena":
        s = int(step.table[0])
        assert torch.equal(step.k_cache[1][s, ctx:ctx + 20], step.k_new[1][0])
        assert step.kv_bytes == 2 * 2 * 3 * (ctx + 20) * 2 * 64 * 4
    else:
        assert step.kv_bytes == 2 * 2 * 3 * -(-(ctx + 20) // 8) * 8 * 2 * 64 * 4
    assert step.store_bytes == 2 * 2 * 60 * 2 * 2 * 64 * 4  # layers x (read+write) x rows x K,V x Hkv x D x 4 B


def test_decode_times_every_step_floor_before_any_measurement(monkeypatch, tmp_path):
    """The read floor of each decode step's and baseline's bytes is timed first, once a size,
    before the first measurement (floors timed between measurements read high on the H200), and
    the sizes are the ones the measurements time their floors with."""
    from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner.roofline import call_bytes
    from drafter_attn.tuner.step import decode_bytes

    _apply_fakes(monkeypatch)
    events = []

    def measure(wire, reps=0, nsys=False):
        events.append(("measure", wire["problem"]["batch"]))
        return _fake_decode(wire, reps, nsys)

    def baseline(name, geometry, page, batch, ctx, layers=1, reps=0, sustain_s=0.0, sustain_load="self"):
        events.append(("baseline", batch))
        return _fake_baseline(name, geometry, page, batch, ctx, layers, reps)

    monkeypatch.setattr(decode, "default_measures", lambda: (measure, _fake_context, baseline))
    monkeypatch.setattr(decode, "default_floor", lambda: lambda nbytes: events.append(("floor", nbytes)))
    argv = ["decode", "--sm", "90", "--page", "64", "--batch", "1,8", "--ctx", "2k", "--accepted", "3.4",
            "--baseline", "flashinfer-fa2", "--db", str(tmp_path / "p.db"), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    kinds = [kind for kind, _ in events]
    n_floor = kinds.count("floor")
    assert kinds[:n_floor] == ["floor"] * n_floor and "floor" not in kinds[n_floor:]
    assert kinds.count("measure") == 4 and kinds.count("baseline") == 2
    g = get_preset(MAIN_PRESET)
    stored = decode.rows_stored_for(3.4, g.block_size)  # what each step stores: the accepted + 1
    want = {decode_bytes(Problem(g, layout, page, b, 2048), stored)
            for b in (1, 8) for layout, page in (("paged", 64), ("arena", None))}
    want |= {g.num_layers * call_bytes(g, b, 2048, 64) for b in (1, 8)}  # every layer's attention
    assert sorted(n for kind, n in events if kind == "floor") == sorted(want)


def test_decode_goes_on_when_a_floor_fails_first(monkeypatch, tmp_path, capsys):
    """A read floor that cannot be timed up front (out of memory, say) does not stop the run:
    it is named, and every row is still measured."""
    _apply_fakes(monkeypatch)

    def floor(nbytes):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(decode, "default_floor", lambda: floor)
    argv = ["decode", "--sm", "90", "--page", "64", "--batch", "1", "--ctx", "2k", "--baseline", "none",
            "--db", str(tmp_path / "p.db"), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "not timed first: RuntimeError: CUDA out of memory" in out
    assert len(pd.read_csv(tmp_path / "out" / "decode.csv")) == 2  # paged and arena


def test_report_takes_a_baseline_measured_over_every_layer_before_one_layer_scaled(tmp_path):
    """A baseline measured over the step's layers in one call stands as measured; one layer's
    row (the attention table's, or bench decode's before 2026-12-04) stands in, times the layer
    count and labelled so, only for a shape that has none."""
    from profile_fakes import H200, MAIN, build_db

    from drafter_attn.bench import report

    one = MAIN.with_(num_layers=1)
    base = dict(impl="flashinfer-fa2", median_us=None)
    rows = [dict(batch=1, ctx=2048, median_us=50.0), dict(batch=8, ctx=2048, median_us=90.0),
            dict(base, batch=1, ctx=2048, attention_median_us=40.0),  # 5 layers in one call
            dict(base, batch=1, ctx=2048, geometry=one, attention_median_us=10.0),  # left out
            dict(base, batch=8, ctx=2048, geometry=one, attention_median_us=15.0)]  # x5
    db = tmp_path / "p.db"
    build_db(db, {"h": (H200, rows)})
    df = report.load(db)
    fa2 = df[df["impl"].str.startswith("flashinfer-fa2")].set_index("batch")
    assert len(fa2) == 2
    assert fa2.loc[1, "impl"] == "flashinfer-fa2 (attention only)" and fa2.loc[1, "median_us"] == 40.0
    assert fa2.loc[8, "impl"] == "flashinfer-fa2 (attention, 1 layer x5)" and fa2.loc[8, "median_us"] == 75.0
    assert set(fa2["num_layers"]) == {5}


def test_report_keeps_steps_that_store_different_rows_apart(tmp_path):
    """Decode steps storing the whole block and steps storing fewer rows (`--accepted`) are
    different workloads: each keeps its own row in the latency table and its own overhead."""
    from profile_fakes import H200, build_db

    from drafter_attn.bench import report

    rows = [dict(layout="arena", page=None, batch=1, ctx=2048, median_us=100.0),
            dict(layout="paged", page=64, batch=1, ctx=2048, median_us=101.0),
            dict(layout="arena", page=None, batch=1, ctx=2048, median_us=60.0, accepted=4.4),
            dict(layout="paged", page=64, batch=1, ctx=2048, median_us=90.0, accepted=4.4)]
    db = tmp_path / "p.db"
    build_db(db, {"h": (H200, rows)})
    df = report.load(db)
    assert sorted(df["step"].unique()) == ["decode", "decode 4.4 rows"]
    ov = report.overheads(df).set_index("step")["overhead_pct"]
    assert ov["decode"] == pytest.approx(1.0) and ov["decode 4.4 rows"] == pytest.approx(50.0)


def test_no_gpu_is_said_before_what_else_the_options_need(monkeypatch, capsys, tmp_path):
    """Without a GPU nothing can run: that comes first, not a missing FlashInfer or nsys (which
    said the other sync layers ran)."""
    from drafter_attn.bench import decode
    from drafter_attn.tuner import nsys as nsys_tool

    monkeypatch.setattr(gpu, "probe", lambda: [])
    for extra in (["--baseline", "flashinfer"], ["--syncs", "all"]):
        err = _err(capsys, ["decode", "--db", str(tmp_path / "p.db"), *extra])
        assert err.startswith("bench decode: no CUDA GPU found")
    missing = nsys_tool.NsysInstall(None, None, None, None, (), searched=("$PATH",))
    with pytest.raises(options.BenchError, match=r"--syncs all needs Nsight Systems, and nsys was "
                                                 r"not found \(\$PATH\); nothing was measured"):
        decode.require_nsys(lambda: missing)


def test_decode_takes_backend_specs_with_parameters(fake_bench, monkeypatch, tmp_path, capsys):
    """`--impl auto,cupy:tile_n=32,stages=4`: a spec's parameters stay with it (the comma before
    `stages=4` is the spec's own) and reach the measurement; a bad one is refused by name."""
    seen = []

    def measure(wire, reps=0, nsys=False):
        seen.append((wire["impl"], dict(wire["params"])))
        return _fake_decode(wire)

    monkeypatch.setattr(decode, "default_measures", lambda: (measure, _fake_context, _fake_baseline))
    argv = ["decode", "--page", "64", "--batch", "1", "--ctx", "2k", "--baseline", "none",
            "--impl", "auto,cupy:tile_n=32,stages=4", "--db", str(tmp_path / "p.db"), "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 0
    df = pd.read_csv(tmp_path / "o" / "decode.csv")
    assert set(df.impl_option) == {"auto", "cupy:tile_n=32,stages=4"}
    spec = [p for impl, p in seen if p.get("tile_n") == 32]
    assert spec and all(p["stages"] == 4 for p in spec)
    err = _err(capsys, argv[:-6] + ["--impl", "cupy:tile_n=31", "--db", str(tmp_path / "p.db")])
    assert "--impl cupy:tile_n=31: backend 'cupy': parameter tile_n=31 must be a power of two" in err
