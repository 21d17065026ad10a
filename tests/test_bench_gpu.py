"""`bench` on a GPU (marker `gpu`): small `bench decode` / `bench prefill` runs end to end, the
--sm check against the real device, and pytest-benchmark benchmarks of the main preset's decode
step whose JSON (`--benchmark-json`) carries the GPU metrics in `extra_info`.

    python -m pytest -m gpu tests/test_bench_gpu.py --benchmark-json bench.json
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from drafter_attn.bench import cli
from drafter_attn.kernels import registry
from drafter_attn.kernels.baselines import flashinfer_available
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import measure, timing
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import Candidate
from drafter_attn.tuner.step import DecodeStep

pytestmark = pytest.mark.gpu

# A small geometry: 8/2 heads (group 4), head_dim 64, blocks of 4, 2 layers.
SMALL = ["--heads", "8/2", "--head-dim", "64", "--block", "4", "--layers", "2"]


def _sm() -> int:
    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


def test_bench_decode_small_end_to_end(tmp_path, capsys):
    db, out = tmp_path / "p.db", tmp_path / "out"
    rc = cli.main(["decode", "--sm", str(_sm()), *SMALL, "--batch", "2", "--ctx", "256,1k", "--page", "16,64",
                   "--impl", "cupy", "--accepted", "1.5", "--baseline", "none", "--context-chunk", "128",
                   "--reps", "20", "--db", str(db), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "impl picked: cupy (--impl cupy)" in text
    df = pd.read_csv(out / "decode.csv")
    assert len(df) == 2 * 1 * 2 * 3  # (decode, context) x batch x ctx x (paged 16, paged 64, arena)
    assert set(df.status) == {"ok"}, df[["step", "layout", "page_size", "ctx", "reason"]].to_string()
    assert (df.rel_err < 1e-2).all()
    # host syncs per step: measured, and zero for the project's kernels (store included)
    assert (df.syncs_debug == 0).all() and (df.syncs_profiler == 0).all() and (df.syncs == 0).all()
    assert df.graph_capturable.astype(bool).all()
    assert ((df.p10_us <= df.median_us) & (df.median_us <= df.p90_us)).all()
    assert ((df.attention_median_us > 0) & (df.store_median_us > 0)).all()
    assert ((df.roofline_fraction > 0) & (df.bandwidth_gbs > 0)).all()
    paged = df[df.layout == "paged"]
    assert paged.overhead_pct.notna().all() and df[df.layout == "arena"].overhead_pct.isna().all()
    assert (df[df.step == "decode"].rows_stored == 2.5).all()  # accepted 1.5 + 1
    assert (df[df.step == "context"].rows_stored == 128).all()
    assert (df.kv_model_bytes > 0).all() and (df.peak_bytes > 0).all()
    doc = json.loads((out / "decode.json").read_text())
    env = doc["environment"]
    assert env["gpu_name"] == torch.cuda.get_device_name(0) and env["sm"] == _sm()
    assert env["torch"] == torch.__version__ and env["commit"] and env["command"].startswith("bench decode")
    assert env["copy_bandwidth_gbs"] > 0
    assert (out / "decode.png").stat().st_size > 0
    with ProfileDB(db, create=False) as pdb:
        assert pdb.count() == len(df)
        assert {r["status"] for r in pdb.query("SELECT status FROM results")} == {"ok"}
    # and the report of that database
    assert cli.main(["report", "--db", str(db), "--out", str(tmp_path / "rep")]) == 0
    assert "Paged over arena" in (tmp_path / "rep" / "report.md").read_text()


def test_bench_prefill_small(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["prefill", *SMALL, "--batch", "1", "--ctx", "0,512", "--page", "64", "--chunk", "256",
                   "--impl", "cupy", "--reps", "20", "--db", str(tmp_path / "p.db"), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    df = pd.read_csv(out / "prefill.csv")
    assert len(df) == 2 * 2 and set(df.status) == {"ok"} and (df.step == "context").all()
    assert (df.syncs == 0).all()


def test_bench_decode_auto_impl_says_what_it_picked(tmp_path, capsys):
    rc = cli.main(["decode", *SMALL, "--batch", "1", "--ctx", "256", "--page", "64", "--baseline", "none",
                   "--reps", "10", "--db", str(tmp_path / "p.db"), "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "impl picked: " in text


def test_sm_mismatch_on_this_gpu(tmp_path, capsys):
    present = {torch.cuda.get_device_capability(i)[0] * 10 + torch.cuda.get_device_capability(i)[1]
               for i in range(torch.cuda.device_count())}
    other = next(sm for sm in (107, 90, 100) if sm not in present)
    rc = cli.main(["decode", "--sm", str(other), "--page", "128", "--db", str(tmp_path / "p.db"),
                   "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--sm {other} does not match the GPU here" in err and torch.cuda.get_device_name(0) in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "p.db").exists()


@pytest.mark.skipif(not flashinfer_available(), reason="FlashInfer is not installed")
def test_bench_decode_with_every_baseline(tmp_path, capsys):
    """Both FlashInfer plans and XQA beside the kernels, labelled, each timed over every layer in
    one call, with the read floor of its bytes."""
    out = tmp_path / "out"
    rc = cli.main(["decode", *SMALL, "--batch", "2", "--ctx", "1k", "--page", "16", "--impl", "cupy",
                   "--baseline", "flashinfer-fa2,flashinfer-fa2-graph,trtllm-xqa", "--reps", "20",
                   "--db", str(tmp_path / "p.db"), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc in (0, 1), text
    df = pd.read_csv(out / "decode.csv")
    for name in ("flashinfer-fa2", "flashinfer-fa2-graph"):
        base = df[df.impl == name]
        assert len(base) == 1 and base.status.iloc[0] == "ok" and base.scope.iloc[0] == "attention, 2 layers"
        assert base.read_floor_us.iloc[0] > 0
    xqa = df[df.impl == "trtllm-xqa"]
    assert len(xqa) == 1  # a row, ok or with its failure's reason
    ours = df[df.impl == "cupy"]
    assert (ours.status == "ok").all() and (ours.read_floor_us > 0).all()
    assert (ours.read_floor_us < ours.median_us).all()  # nothing beats streaming its own bytes


# ---------------------------------------------------------------------------------------------
# pytest-benchmark: the main preset's decode step (B=8, ctx 8k). The benchmark's own timing is
# host wall time of a graph replay plus a synchronize; extra_info holds the device measurements
# (CUDA events, L2 flushed): latency, split, syncs, roofline, memory, overhead over arena.

BATCH, CTX = 8, 8192
METRICS = ("median_us", "p10_us", "p90_us", "count", "repeat_median_us", "attention_median_us",
           "store_median_us", "syncs_debug", "syncs_profiler", "sync_host_us", "graph_capturable",
           "bytes_moved", "bandwidth_gbs", "copy_bandwidth_gbs", "roofline_fraction", "rel_err",
           "kv_bytes", "workspace_bytes", "peak_bytes")


def _candidate(layout: str, page: int | None) -> Candidate:
    problem = Problem(get_preset(MAIN_PRESET), layout, page, BATCH, CTX)
    params = registry.get("cupy").default_params(problem)
    return Candidate(problem, "cupy", tuple(sorted(params.items())), None, MAIN_PRESET)


@pytest.fixture(scope="module")
def arena_row() -> dict:
    row = measure.measure_candidate(_candidate("arena", None).to_wire(), reps=100)
    assert row["status"] == "ok", row.get("reason")
    return row


@pytest.mark.parametrize("layout, page", [("arena", None), ("paged", 64), ("paged", 128)])
def test_benchmark_decode_step(benchmark, arena_row, layout, page):
    cand = _candidate(layout, page)
    row = arena_row if layout == "arena" else measure.measure_candidate(cand.to_wire(), reps=100)
    assert row["status"] == "ok", row.get("reason")
    step = DecodeStep(cand.problem, "cupy", cand.params_dict)
    graph = timing.capture(step.run)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    benchmark.pedantic(replay, rounds=50, warmup_rounds=5, iterations=1)
    major, minor = torch.cuda.get_device_capability(0)
    benchmark.extra_info.update(
        gpu=torch.cuda.get_device_name(0), sm=major * 10 + minor, preset=MAIN_PRESET, impl="cupy",
        params=cand.params_dict, layout=layout, page_size=page, batch=BATCH, ctx=CTX,
        overhead_pct=(row["median_us"] / arena_row["median_us"] - 1) * 100 if layout == "paged" else None,
        **{k: row.get(k) for k in METRICS})
    assert row["syncs_debug"] == 0 and row["syncs_profiler"] == 0


def test_attention_table_small(tmp_path):
    """The one-layer table end to end: every row checked against the reference and timed, the
    CSV written row by row and the markdown at the end; a failing spec is a row, not a crash."""
    from drafter_attn.bench import attention_table

    out = tmp_path / "t"
    db = tmp_path / "p.db"
    rc = attention_table.main(["--preset", MAIN_PRESET, "--batch", "1", "--ctx", "1k", "--page", "64",
                               "--impl", "cupy;cupy:tile_n=7;cupy:skip_compute=1", "--baseline", "none",
                               "--reps", "5", "--sustain", "0.05", "--db", str(db), "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out / "attention.csv")
    ok = df[df.impl == "cupy"]
    assert sorted(ok.layout) == ["arena", "paged"] and (ok.rel_err < 2e-2).all()
    assert (ok.attn_us > ok.read_floor_us).all() and (ok.read_floor_us > 0).all()
    bad = df[df.impl == "cupy:tile_n=7"]
    assert len(bad) == 2 and (bad.status != "ok").all() and bad.reason.str.contains("tile_n").all()
    assert "cupy:tile_n=7" in (out / "attention.md").read_text()
    loads = df[df.impl == "cupy:skip_compute=1"]  # timed for the limiter, never ok
    assert (loads.status == "failed_correctness").all() and (loads.attn_us > 0).all()
    # one measurement path: every point is a profile-database row, as a sweep's would be
    with ProfileDB(db, create=False) as pdb:
        rows = pdb.query("SELECT impl, status, read_floor_us, num_layers FROM results")
    assert len(rows) == 6 and {r["num_layers"] for r in rows} == {1}
    assert all(r["read_floor_us"] > 0 for r in rows if r["status"] == "ok")
    # the SM clock of each timing, where NVML answers (a column of the table and of the database)
    if timing.sm_clock_mhz() is not None:
        assert (ok.sm_mhz > 100).all()
        with ProfileDB(db, create=False) as pdb:
            clocks = [r["sm_clock_mhz"] for r in pdb.query("SELECT sm_clock_mhz FROM results WHERE status = 'ok'")]
        assert clocks and all(c > 100 for c in clocks)
    # every kernel row is a sustained candidate, recorded with its load (never a burst's row)
    with ProfileDB(db, create=False) as pdb:
        assert {r["sustain_s"] for r in pdb.query("SELECT sustain_s FROM results")} == {0.05}


def test_attention_table_under_a_co_runners_load(tmp_path):
    """--sustain-load gemm: each kernel row timed after the co-runner's matmuls and with one
    before every replay, checked and recorded as a candidate of that load; the GEMMs between the
    replays stay outside the events (the row's time is the kernel's, not the co-runner's 1.6 ms)."""
    from drafter_attn.bench import attention_table

    out, db = tmp_path / "t", tmp_path / "p.db"
    rc = attention_table.main(["--preset", MAIN_PRESET, "--batch", "1", "--ctx", "2k", "--page", "64",
                               "--impl", "cupy", "--baseline", "none", "--reps", "5", "--sustain", "0.05",
                               "--sustain-load", "gemm", "--db", str(db), "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out / "attention.csv")
    assert len(df) == 2 and (df.status == "ok").all() and (df.rel_err < 2e-2).all()
    assert (df.attn_us < 500).all()  # one GEMM of the load alone takes over 1 ms
    with ProfileDB(db, create=False) as pdb:
        rows = pdb.query("SELECT sustain_s, sustain_load FROM results")
    assert rows and all(r == {"sustain_s": 0.05, "sustain_load": "gemm"} for r in rows)
    assert "co-runner's load (gemm)" in (out / "attention.md").read_text()


def test_attention_table_auto_runs_the_runtime_pick(tmp_path):
    """--impl auto: each layout's row runs what the runtime's dispatcher picks there, checked
    against the reference and timed, and its `pick` column is a spec that names that kernel."""
    from drafter_attn.bench import attention_table, decode

    out = tmp_path / "t"
    rc = attention_table.main(["--preset", MAIN_PRESET, "--shapes", "1x2k,8x1k", "--page", "64",
                               "--impl", "auto;auto:sustained", "--baseline", "none", "--reps", "5",
                               "--db", str(tmp_path / "p.db"), "--out", str(out)])
    assert rc == 0
    df = pd.read_csv(out / "attention.csv")
    assert len(df) == 8 and set(df.impl) == {"auto", "auto:sustained"} and (df.status == "ok").all()
    assert (df.rel_err < 2e-2).all() and (df.attn_us > 0).all()
    major, minor = torch.cuda.get_device_capability(0)
    geometry = get_preset(MAIN_PRESET)
    for r in df.itertuples():  # each row runs its regime's pick (auto: the default, burst)
        dispatcher, _ = decode.load_dispatcher(None, major * 10 + minor, attention_table.auto_regime(r.impl))
        page = int(r.page) or None
        assert r.pick == attention_table.pick_spec(dispatcher, geometry, r.layout, page, r.batch, r.ctx,
                                                   major * 10 + minor)
        assert registry.parse_spec(r.pick)[0] == dispatcher.pick(
            Problem(geometry.with_(num_layers=1), r.layout, page, r.batch, r.ctx), major * 10 + minor).impl
    assert "auto:" in (out / "attention.md").read_text()


def test_read_floor_streams_at_hbm_speed():
    """The read floor reads its bytes at least as fast as a device copy moves them (a copy also
    writes), and its bulk-copy and plain-load kernels both run."""
    from drafter_attn.tuner import floors, roofline

    nbytes = 1 << 30
    f = floors.read_floor(nbytes)
    assert f.ld_us is not None and f.ld_us > 0
    if torch.cuda.get_device_capability(0)[0] >= 9:
        assert f.bulk_us is not None and f.bulk_us > 0
    assert f.bandwidth_gbs * 1e9 > 0.9 * roofline.copy_bandwidth()
    assert floors.empty_graph_us() > 0
