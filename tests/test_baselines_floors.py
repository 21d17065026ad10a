"""CPU tests of the baselines' selection, the read floor (its arithmetic and its kernels'
compilation) and the bench table's width."""
import argparse
import io

import pytest

from drafter_attn.bench import decode, options, output
from drafter_attn.bench.options import BenchError
from drafter_attn.kernels import baselines
from drafter_attn.kernels.presets import get_preset
from drafter_attn.tuner import floors
from drafter_attn.tuner.sizes import parse_size, parse_sizes

MAIN = get_preset("qwen3-8b-dflash-b16")
SLIDING = get_preset("dflash2-w2048")


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(baselines, "flashinfer_available", lambda: True)


def test_baseline_reasons(installed, monkeypatch):
    assert baselines.reason(baselines.FA2, MAIN, 64) is None
    assert baselines.reason(baselines.FA2_GRAPH, MAIN, 16) is None
    assert "mask 'full' only" in baselines.reason(baselines.FA2, SLIDING, 64)
    assert "page sizes" in baselines.reason(baselines.XQA, MAIN, 256)
    assert baselines.reason(baselines.XQA, MAIN, 128, sm=90) is None
    assert "SM 90/120" in baselines.reason(baselines.XQA, MAIN, 128, sm=100)
    assert "unknown baseline" in baselines.reason("vllm", MAIN, 64)
    monkeypatch.setattr(baselines, "flashinfer_available", lambda: False)
    assert "not installed" in baselines.reason(baselines.FA2, MAIN, 64)


def test_a_baseline_of_several_layers_plans_once_and_attends_each_layer_in_one_call(monkeypatch):
    """`bench decode` times a baseline over the step's layers in one call (one launch, as the
    step pays): one plan, and run() attends every layer's own queries and pages in turn."""
    import sys
    import types

    import torch

    planned, ran = [], []

    class Wrapper:
        def __init__(self, workspace, layout, use_cuda_graph=False, backend="fa2", **buffers):
            pass

        def plan(self, *args, **kwargs):
            planned.append(args)

        def run(self, q, kv):
            ran.append((q, kv))
            return q

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=Wrapper))
    g = MAIN.with_(num_layers=1)
    base = baselines.build(baselines.FA2, g, 64, [100, 300], "cpu", torch.Generator().manual_seed(0), layers=3)
    one = baselines.build(baselines.FA2, g, 64, [100, 300], "cpu", torch.Generator().manual_seed(0))
    assert len(planned) == 2 and base.kv_bytes == 3 * one.kv_bytes
    ran.clear()
    out = base.run()
    assert [id(q) for q, _ in ran] == [id(q) for q, _ in base.layers]
    assert len({kv[0].data_ptr() for _, kv in ran}) == 3  # each layer its own pages
    assert out is base.layers[-1][0]
    with pytest.raises(ValueError, match="layers must be at least 1"):
        baselines.build(baselines.FA2, g, 64, [100], "cpu", layers=0)


def test_is_baseline_knows_relabelled_rows():
    assert baselines.is_baseline("flashinfer-fa2") and baselines.is_baseline("trtllm-xqa (attention only)")
    assert not baselines.is_baseline("cupy") and not baselines.is_baseline("flashinfer-fa3")


def test_auto_runs_every_baseline_that_takes_the_geometry(installed):
    names, notes = decode.baselines_wanted("auto", MAIN)
    assert names == [baselines.FA2, baselines.FA2_GRAPH, baselines.XQA] and notes == []
    names, notes = decode.baselines_wanted("auto", SLIDING)
    assert names == [] and len(notes) == 3 and all("mask 'full' only" in n for n in notes)
    assert decode.baselines_wanted("flashinfer", MAIN)[0] == [baselines.FA2, baselines.FA2_GRAPH]
    assert decode.baselines_wanted("none", MAIN) == ([], [])


def test_a_named_baseline_that_cannot_run_is_an_error(installed):
    with pytest.raises(BenchError, match="trtllm-xqa covers mask 'full' only"):
        decode.baselines_wanted("trtllm-xqa", SLIDING)


def test_baseline_jobs_follow_each_baselines_page_sizes(installed):
    p = decode.plan("decode", MAIN, "main", "main", pages=[64, 256], batches=[1], ctxs=[1024],
                    impls=["cupy"], baseline="auto")
    jobs = p.baseline_jobs(sm=90)
    assert (baselines.XQA, 1, 1024, 64) in jobs and (baselines.XQA, 1, 1024, 256) not in jobs
    assert (baselines.FA2_GRAPH, 1, 1024, 256) in jobs
    assert p.total == len(p.jobs) + 5


def test_baseline_option_is_checked_by_argparse():
    assert options.baseline_option("flashinfer-fa2,trtllm-xqa") == "flashinfer-fa2,trtllm-xqa"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown baseline vllm"):
        options.baseline_option("flashinfer-fa2,vllm")


def test_read_floor_row():
    f = floors.ReadFloor(nbytes=4_000_000_000, median_us=1000.0, way="bulk", bulk_us=1000.0, ld_us=1100.0)
    assert f.bandwidth_gbs == pytest.approx(4000.0)
    row = f.row(median_us=1250.0)
    assert row == dict(read_floor_us=1000.0, read_bandwidth_gbs=pytest.approx(4000.0),
                       read_roofline_fraction=pytest.approx(0.8))


@pytest.mark.parametrize("sm", [90, 100, 120])
def test_read_floor_kernels_compile(sm):
    """The streaming kernels compile for each target; on sm_90 and up the bulk kernel drives the
    copy engine (UBLKCP) and waits on mbarriers, and nothing spills."""
    pytest.importorskip("cuda.bindings")
    from drafter_attn.kernels.nvrtc import arch_for_sm, compile_cubin
    from test_cutlass_compile import _sass as sass

    result = compile_cubin(floors.SOURCE, dict(STAGES=floors.STAGES, CHUNK=floors.CHUNK), arch_for_sm(sm))
    assert set(result.resources) == {"read_floor_bulk", "read_floor_ld"}
    assert result.spills == 0
    text = sass(result.cubin_path)
    assert "UBLKCP" in text and "SYNCS" in text and "LDG.E" in text


def test_floor_args_match_the_kernels_parameters():
    """FloorArgs, passed field by field to both streaming kernels, follows their parameter lists
    in read_floor.cu: a pointer, a 64-bit count, a pointer."""
    import ctypes
    import re

    from drafter_attn.kernels.nvrtc import CUDA_SRC_DIR

    text = (CUDA_SRC_DIR / floors.SOURCE).read_text()
    found = dict(re.findall(r'__global__ void (?:__launch_bounds__\(\d+\) )?(read_floor_\w+)\('
                            r'([^)]*)\)', text))
    assert set(found) == {"read_floor_bulk", "read_floor_ld"}
    for name, params in found.items():
        kinds = ["ptr" if "*" in p else p.split()[0] for p in params.split(",")]
        assert kinds == ["ptr", "u64", "ptr"], name
    assert [(n, getattr(floors.FloorArgs, n).offset) for n, _ in floors.FloorArgs._fields_] == \
        [("src", 0), ("n", 8), ("sink", 16)]
    assert ctypes.sizeof(floors.FloorArgs) == 24


def test_sizes():
    assert parse_sizes("2k, 8k,1M,4096") == [2048, 8192, 1 << 20, 4096]
    assert parse_size("1.5k") == 1536
    for bad in ("1.3k", "lots", "-1", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def _row(**kw):
    row = dict(step="decode", impl="cupy", impl_option="cupy", layout="paged", page_size=128, batch=32,
               ctx=32768, chunk=None, status="ok", median_us=1459.3, p10_us=1450.1, p90_us=1470.2,
               attention_median_us=1300.0, store_median_us=150.0, overhead_pct=-0.5, syncs=0,
               kv_model_bytes=123 << 30, bandwidth_gbs=3900.0, roofline_fraction=0.91, rel_err=3e-3,
               read_floor_us=1200.0, layers=5)
    row.update(kw)
    return row


def test_bench_table_fits_120_columns_and_wide_shows_everything():
    from rich.console import Console

    rows = [_row(), _row(layout="arena", page_size=None),
            _row(impl="flashinfer-fa2-graph", impl_option="flashinfer-fa2-graph", scope="attention, 5 layers"),
            _row(status="failed_runtime", reason="CUDA error: an illegal memory access was encountered")]
    narrow = Console(file=io.StringIO(), width=120, record=True)
    output.print_table(rows, "t", narrow)
    text = narrow.export_text()
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "x floor" in text and "1.216x" in text and "p10-p90" not in text and "flashinfer-fa" in text
    wide = Console(file=io.StringIO(), width=260, record=True)
    output.print_table(rows, "t", wide, wide=True)
    text = wide.export_text()
    assert "p10-p90" in text and "copy roofline" in text and "read floor us" in text


def test_attention_table_baseline_option(installed):
    from drafter_attn.bench import attention_table

    assert attention_table.baseline_names("auto", MAIN) == list(baselines.NAMES)
    assert attention_table.baseline_names("auto", SLIDING) == []
    assert attention_table.baseline_names("none", MAIN) == []
    assert attention_table.baseline_names("trtllm-xqa", MAIN) == ["trtllm-xqa"]
    with pytest.raises(SystemExit, match="unknown"):
        attention_table.baseline_names("vllm", MAIN)
    assert attention_table.shapes("1x2k, 8x32k") == [(1, 2048), (8, 32768)]
    with pytest.raises(argparse.ArgumentTypeError):
        attention_table.shapes("8by32k")


def test_attention_table_rounds_take_ratios_within_a_round():
    """--rounds: paged over arena is taken within each round, then summarized per point; a drift
    between rounds that moves both layouts leaves the ratio alone."""
    import pandas as pd

    from drafter_attn.bench import attention_table as at

    rows = []
    for rnd, drift in enumerate((1.0, 1.10, 0.95)):  # the machine runs 10% slower in round 1
        rows += [dict(impl="cupy", layout="paged", page=16, batch=8, ctx=8192, round=rnd,
                      attn_us=103.0 * drift),
                 dict(impl="cupy", layout="arena", page=0, batch=8, ctx=8192, round=rnd,
                      attn_us=100.0 * drift),
                 dict(impl="flashinfer-fa2", layout="paged", page=16, batch=8, ctx=8192, round=rnd,
                      attn_us=120.0 * drift)]
    df = at.with_overheads(pd.DataFrame(rows))
    paged = df[(df.layout == "paged") & (df.impl == "cupy")]
    assert list(paged.over_arena.round(6)) == [1.03] * 3
    assert df[df.impl == "flashinfer-fa2"].over_arena.isna().all()
    s = at.rounds_summary(df).set_index(["impl", "layout"])
    cupy = s.loc[("cupy", "paged")]
    assert cupy.rounds == 3 and cupy.attn_us == 103.0 and cupy.attn_max_us == pytest.approx(113.3)
    assert cupy.over_arena == pytest.approx(1.03) and cupy.over_arena_min == pytest.approx(1.03)
    # a ratio that moves between rounds shows its range
    rows[0]["attn_us"] = 106.0
    s = at.rounds_summary(at.with_overheads(pd.DataFrame(rows))).set_index(["impl", "layout"])
    assert s.loc[("cupy", "paged")].over_arena_max == pytest.approx(1.06)
    assert s.loc[("cupy", "paged")].over_arena_min == pytest.approx(1.03)
    # one round (the default): the table's ratio is the same as before rounds existed
    one = at.with_overheads(pd.DataFrame([{k: v for k, v in r.items() if k != "round"}
                                          for r in rows[3:6]]))
    assert one[(one.layout == "paged") & (one.impl == "cupy")].over_arena.iloc[0] == pytest.approx(1.03)


def test_attention_table_floors_take_the_lowest_timing_of_their_bytes():
    """Every row of the same bytes, or of bytes within 0.5% (paged and arena differ by the block
    table), gets the lowest floor timed for them, and x_floor follows it; other sizes (here 1%
    apart) keep their own."""
    import pandas as pd

    from drafter_attn.bench import attention_table as at

    rows = [dict(impl="cupy", layout="paged", round=0, bytes=8_716_416, attn_us=17.4, read_floor_us=19.8),
            dict(impl="cupy", layout="paged", round=1, bytes=8_716_416, attn_us=18.0, read_floor_us=6.3),
            dict(impl="cupy", layout="arena", round=0, bytes=8_716_288, attn_us=18.4, read_floor_us=10.1),
            dict(impl="cupy", layout="paged", round=0, bytes=33_882_624, attn_us=22.2, read_floor_us=20.2),
            dict(impl="cupy", layout="arena", round=0, bytes=33_882_112, attn_us=23.1, read_floor_us=11.5),
            dict(impl="cupy", layout="paged", round=0, bytes=34_221_450, attn_us=24.0, read_floor_us=11.9),
            dict(impl="cupy:tile_n=7", layout="paged", round=0, bytes=None, attn_us=None,
                 read_floor_us=None)]  # a failed point: no floor, no bytes
    df = at.lowest_floors(pd.DataFrame(rows))
    assert list(df.read_floor_us[:6]) == [6.3, 6.3, 6.3, 11.5, 11.5, 11.9]
    assert df.x_floor[0] == pytest.approx(17.4 / 6.3) and df.x_floor[3] == pytest.approx(22.2 / 11.5)
    assert df.x_floor[5] == pytest.approx(24.0 / 11.9)
    assert pd.isna(df.read_floor_us[6]) and pd.isna(df.x_floor[6])
    no_floor = pd.DataFrame([dict(impl="cupy", status="failed_unsupported")])
    assert at.lowest_floors(no_floor).equals(no_floor)


def test_attention_table_rounds_option():
    import pandas as pd

    from drafter_attn.bench import attention_table as at

    assert at.parse_args([]).rounds == 1 and at.parse_args(["--rounds", "5"]).rounds == 5
    failed = pd.DataFrame([dict(impl="cupy:tile_n=7", layout="paged", page=64, batch=1, ctx=1024,
                                round=r, status="failed_unsupported") for r in range(2)])
    assert at.rounds_summary(at.with_overheads(failed)).empty
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit):
            at.parse_args(["--rounds", bad])


def test_attention_table_sustain_option():
    from drafter_attn.bench import attention_table as at

    assert at.parse_args([]).sustain == 0.0 and at.parse_args(["--sustain", "1.5"]).sustain == 1.5
    for bad in ("-1", "nan", "long"):
        with pytest.raises(SystemExit):
            at.parse_args(["--sustain", bad])
    assert at.parse_args(["--sustain", "0.75"]).sustain_load == "self"
    assert at.parse_args(["--sustain", "0.75", "--sustain-load", "gemm"]).sustain_load == "gemm"
    for bad in (["--sustain-load", "gemm"], ["--sustain", "1", "--sustain-load", "heavy"]):
        with pytest.raises(SystemExit):  # a load without the seconds, a load it does not know
            at.parse_args(bad)


def test_time_first_times_each_size_once_and_names_a_failure():
    from drafter_attn.tuner import floors

    timed, said = [], []

    def floor(nbytes):
        timed.append(nbytes)
        if nbytes == 2:
            raise RuntimeError("CUDA out of memory")

    floors.time_first([3, 2, 3, 1], said.append, floor)
    assert timed == [3, 2, 1]
    assert said == ["read floor of 2 bytes not timed first: RuntimeError: CUDA out of memory"]


def test_attention_table_auto_names_the_runtime_pick(monkeypatch):
    """--impl auto: each point runs the spec of the runtime dispatcher's pick, written in
    registry.parse_spec's form with the parameters at their default left out, so the `pick`
    column reproduces exactly what ran; the table comes from where kernels.Runtime reads it."""
    from pathlib import Path

    from drafter_attn.bench import attention_table as at
    from drafter_attn.kernels import registry
    from drafter_attn.kernels.dispatcher import Dispatcher
    from drafter_attn.kernels.spec import Problem

    shipped = Path(__file__).resolve().parents[1] / "profiles" / "sm90.json"
    table = Dispatcher.load(shipped)
    laguna = get_preset("laguna-dflash")
    specs = set()
    for geometry, layout, page, batch, ctx in [(MAIN, "paged", 64, 1, 2048), (MAIN, "arena", None, 1, 8192),
                                               (MAIN, "paged", 128, 32, 8192), (laguna, "paged", 64, 32, 8192)]:
        pick = table.pick(Problem(geometry.with_(num_layers=1), layout, page, batch, ctx), 90)
        spec = at.pick_spec(table, geometry, layout, page, batch, ctx, 90)
        specs.add(spec)
        name, params = registry.parse_spec(spec)
        defaults = {k: v[1] for k, v in registry.param_schema(registry.get(name)).items()}
        assert name == pick.impl and {**defaults, **params} == {**defaults, **dict(pick.params)}
        assert all(defaults[k] != v for k, v in params.items())
    assert len(specs) >= 2  # the table picks differently by batch and preset
    # the heuristic's pick is a spec too
    assert registry.parse_spec(at.pick_spec(Dispatcher(), MAIN, "paged", 64, 1, 2048, 90))[0] == "cupy"
    monkeypatch.setenv("DRAFTER_TUNED_TABLE", str(shipped))
    assert str(shipped) in decode.load_dispatcher(None, 90)[1]
    monkeypatch.setenv("DRAFTER_TUNED_TABLE", "/nonexistent/table.json")
    dispatcher, note = decode.load_dispatcher(None, 90)
    assert "default heuristic" in note and "does not exist" in note and not dispatcher.entries


def test_bench_table_tells_auto_rows_from_the_impl_they_picked():
    """`--impl auto,cupy`: both run cupy, so the table and the plot legend name the option that
    chose it (`auto->cupy`); a row run by its own name stays as it is."""
    from rich.console import Console

    rows = [_row(impl_option="auto"), _row()]
    console = Console(file=io.StringIO(), width=120, record=True)
    output.print_table(rows, "t", console)
    lines = [line for line in console.export_text().splitlines() if "decode" in line]
    assert len(lines) == 2 and "auto->cupy" in lines[0] and "auto" not in lines[1]
    assert output.series_label(rows[0]) == "auto->cupy paged 128" and output.series_label(rows[1]) == "cupy paged 128"


def test_ratios_print_with_the_digits_their_targets_need():
    """Paged over arena is judged against 1.01 and x_floor against 1.05: 1.0104 (a miss) and
    1.0095 (a pass) must not both print as 1.01, in the markdown tables or the terminal."""
    import pandas as pd

    df = pd.DataFrame({"impl": ["cupy", "cupy"], "attn_us": [12.3456, 7.0], "over_arena": [1.0104, 1.0095],
                       "x_floor": [1.0549, float("nan")]})
    md, text = output.markdown_table(df), output.text_table(df)
    for shown in (md, text):
        assert "1.0104" in shown and "1.0095" in shown and "1.0549" in shown and "12.35" in shown
    assert "| cupy | 7 | 1.0095 |  |" in md


def test_a_kernel_points_floor_is_sized_for_what_its_attention_reads(monkeypatch):
    """The step's attention runs after its store, over ctx + Qb context rows a request: the
    read floor beside it is sized for those bytes (the step's own roofline), not for ctx."""
    import types

    import torch

    from drafter_attn.bench import attention_table
    from drafter_attn.tuner import floors, measure, roofline, step
    from drafter_attn.kernels.spec import Problem

    timed = dict(status="ok", attention_median_us=10.0, attention_p10_us=9.0, attention_p90_us=11.0)
    monkeypatch.setattr(measure, "measure_candidate", lambda wire, reps: timed)
    monkeypatch.setattr(floors, "read_floor", lambda n: types.SimpleNamespace(median_us=n / 1e6))
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    row = attention_table.measure_kernel("cupy", MAIN, "paged", 64, 2, 2048, reps=3, preset="p",
                                         record=lambda cand, result: None)
    one = Problem(MAIN.with_(num_layers=1), "paged", 64, 2, 2048)
    assert row["bytes"] == step.roofline_bytes(one, [MAIN.block_size] * 2)[0]
    assert row["bytes"] > roofline.call_bytes(MAIN, 2, 2048, 64)
    assert row["x_floor"] == pytest.approx(10.0 / (row["bytes"] / 1e6))
