"""The `tuner` command (CPU): show in every format, compile, merge, sweep's spec handling."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest

from drafter_attn.tuner import cli
from drafter_attn.tuner.db import ProfileDB

from test_tuner_db import FP, _row


@pytest.fixture
def db_path(tmp_path):
    path = tmp_path / "p.db"
    with ProfileDB(path) as db:
        env = db.add_environment(FP)
        db.add_result(_row(env, 0))
        db.add_result(_row(env, 1, preset="gpt-oss-20b-dflash", status="failed_timeout",
                           reason="no result within 600 s", median_us=None))
        db.add_result(_row(env, 2, status="unsupported", reason="head_dim 96 not compiled"))
        other = db.add_environment({**FP, "gpu_name": "NVIDIA B200", "sm": 100})
        db.add_result(_row(other, 3, syncs_debug=5, syncs_profiler=6))
    return path


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_formats(capsys, db_path):
    rc, out, _ = _run(capsys, "show", "--db", db_path, "--format", "csv")
    df = pd.read_csv(io.StringIO(out))
    assert rc == 0 and len(df) == 4
    assert {"median_us", "p10_us", "p90_us", "count", "status", "gpu_name", "params", "syncs"} <= set(df.columns)
    assert df["syncs"].tolist() == [0, 0, 0, 6]

    rc, out, _ = _run(capsys, "show", "--db", db_path, "--format", "json", "--sm", 90)
    records = json.loads(out)
    assert rc == 0 and len(records) == 3 and {r["gpu_name"] for r in records} == {"NVIDIA H200"}

    rc, out, _ = _run(capsys, "show", "--db", db_path)
    assert rc == 0 and "qwen3-8b-dflash-b16" in out and "4 results" in out
    assert "stages=3,tile_n=64" in out  # params in compact form


@pytest.mark.parametrize("argv,expected", [
    (["--status", "failed"], {"failed_timeout"}),
    (["--status", "unsupported"], {"unsupported"}),
    (["--preset", "gpt-oss-20b-dflash"], {"failed_timeout"}),
    (["--gpu", "B200"], {"ok"}),
    (["--impl", "nope"], set()),
    (["--ctx-len", 2050, "--batch", 8, "--layout", "paged", "--page-size", 64], {"unsupported"}),
])
def test_show_filters(capsys, db_path, argv, expected):
    rc, out, _ = _run(capsys, "show", "--db", db_path, "--format", "json", *argv)
    assert rc == 0 and {r["status"] for r in json.loads(out)} == expected


def test_show_refuses_missing_and_foreign_databases(capsys, tmp_path):
    rc, _, err = _run(capsys, "show", "--db", tmp_path / "none.db")
    assert rc == 2 and "no profile database at" in err
    junk = tmp_path / "junk.db"
    junk.write_text("x" * 1000)
    rc, _, err = _run(capsys, "show", "--db", junk)
    assert rc == 2 and "not a readable SQLite" in err


def _fake_rows(spill: int):
    return [dict(sm=90, arch="sm_90a", backend="cupy", variant="cupy:arena:bf16:x", kernel=k, registers=100,
                 spill_bytes=spill if k == "drafter_attention" else 0, stack_bytes=0, smem_static=0,
                 smem_dynamic=4096, compile_s=1.0, cached=False, cubin="/x") for k in ("drafter_attention",
                                                                                     "drafter_store")]


@pytest.mark.parametrize("spill,rc_expected", [(0, 0), (64, 1)])
def test_compile_stores_rows_and_fails_on_spills(capsys, monkeypatch, tmp_path, spill, rc_expected):
    from drafter_attn.kernels import static_profile

    seen = {}

    def fake_compile(sms, variants, workers=None):
        seen.update(sms=sms, n=len(variants))
        return _fake_rows(spill)

    monkeypatch.setattr(static_profile, "compile_variants", fake_compile)
    path = tmp_path / "c.db"
    rc, out, err = _run(capsys, "compile", "--sm", "90,100", "--presets", "gpt-oss-20b-dflash", "--db", path)
    assert rc == rc_expected and seen["sms"] == (90, 100) and seen["n"] >= 2
    assert "static compile profile" in out and "2 kernel profiles stored" in err
    assert ("spill registers" in err) == bool(spill)
    rc, out, _ = _run(capsys, "show", "--compile", "--db", path, "--format", "json")
    assert [r["kernel"] for r in json.loads(out)] == ["drafter_attention", "drafter_store"]


def test_compile_one_real_variant(capsys, monkeypatch, tmp_path):
    """One NVRTC compile (no GPU): gpt-oss arena variant for sm_100 (plain: mma.sync only)."""
    from drafter_attn.kernels import nvrtc

    try:
        nvrtc.cuda_include_dir()
        nvrtc.nvrtc_version()
    except nvrtc.CompileError as exc:
        pytest.skip(f"no NVRTC toolchain here: {exc}")
    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "c.db"
    rc, out, _ = _run(capsys, "compile", "--sm", "100", "--presets", "gpt-oss-20b-dflash", "--pages", "",
                      "--workers", "1", "--db", path)
    assert rc == 0 and "static compile profile" in out
    with ProfileDB(path, create=False) as db:
        rows = db.query("SELECT * FROM compile_profiles")
    kernels = {r["kernel"] for r in rows}
    assert "drafter_attention" in kernels and all(r["arch"] == "sm_100" for r in rows)
    assert all(r["registers"] > 0 and r["spill_bytes"] == 0 for r in rows)
    assert rows[0]["sources_hash"] == nvrtc.sources_digest()


def test_compile_rejects_unknown_presets(capsys):
    rc, _, err = _run(capsys, "compile", "--presets", "gpt-5", "--no-db")
    assert rc == 2 and "unknown preset(s) gpt-5" in err


def test_merge(capsys, db_path, tmp_path):
    out_path = tmp_path / "merged.db"
    rc, _, err = _run(capsys, "merge", out_path, db_path)
    assert rc == 0 and "4 results" in err and "2 environments" in err
    rc, _, err = _run(capsys, "merge", out_path, db_path)
    assert "0 results" in err


def test_sweep_dry_run_bad_spec_and_no_gpu(capsys, monkeypatch, tmp_path):
    rc, out, err = _run(capsys, "sweep", "default", "--dry-run")
    assert rc == 0 and "36 candidates" in err and "qwen3-8b-dflash-b16 page16 B=1 ctx=8192 cupy" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[sweep]\nbackends = ['cupy']\npresets = ['qwen3-8b-dflash-b16']\narena = true\n"
                   "batches = [1, -8]\nctx_lens = [1]\n")
    rc, _, err = _run(capsys, "sweep", bad, "--db", tmp_path / "s.db")
    assert rc == 2 and "sweep.batches[1]" in err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    rc, _, err = _run(capsys, "sweep", "default", "--db", tmp_path / "s.db", "--no-progress")
    assert rc == 2 and "no CUDA GPU is visible" in err


def test_help_documents_the_default_database(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "x.db"))
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "$DRAFTER_DB" in out and "profiles/profile.db" in out and ".local/share/drafter-attn" in out
    assert str(tmp_path / "x.db") in out
