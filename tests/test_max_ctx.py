"""The host-side `max_ctx` hint and engine-sized block tables, CPU only (issue 12): validation,
the split count and the dispatch bucket planned from the hint instead of the table's width, the
`bench decode --table-capacity` / `--max-ctx-hint` / long `--ctx` options, the GPU memory a
measurement needs, and AUTO's long-context rows. The kernels themselves on a GPU:
tests/test_long_ctx_gpu.py."""

from __future__ import annotations

import argparse
import json
import types

import numpy as np
import pytest
import torch

from drafter_attn.bench import cli, decode, gpu
from drafter_attn.bench import options
from drafter_attn.kernels import contract, ops, reference
from drafter_attn.kernels.auto import LONG_CTX, Deployment, merge_entries, recommend
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.dispatch import Dispatcher, Runtime
from drafter_attn.kernels.dispatcher import reference_pick
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.tuner import memory as step_memory
from drafter_attn.tuner.db import ProfileDB
from profile_fakes import H200 as H200_ENV
from profile_fakes import build_db

MAIN = get_preset(MAIN_PRESET)  # 32/8 x 128, Qb 16, 5 layers, bf16
H200 = gpu.GpuInfo(0, "NVIDIA H200", 90, 132, 141 * 2**30)


def _paged(lens=(100, 300), page=64, widen=16, seed=0):
    """CPU inputs of the main preset; the block table `widen` times wider than it needs (the
    extra columns garbage, as an engine's unused columns)."""
    gen = torch.Generator().manual_seed(seed)
    kp, vp, table, ctx = random_paged_context(MAIN, list(lens), page, "cpu", gen)
    wide = torch.cat([table, torch.full((len(lens), table.shape[1] * (widen - 1)), -5, dtype=torch.int32)], 1)
    q = torch.randn(len(lens), 16, 32, 128, generator=gen).bfloat16()
    kb = torch.randn(len(lens), 16, 8, 128, generator=gen).bfloat16()
    return q, kb, kb.clone(), kp, vp, table, wide, ctx


# ---------------------------------------------------------------------------------------------
# the hint: validation and the planned context


def test_round_ctx_hint_grid():
    # exact on the grid (8..15 x a power of two) and below 16; at most 12.5% above elsewhere
    for n in (1, 15, 16, 2048, 8192, 9216, 131072, 524288):
        assert contract.round_ctx_hint(n) == n
    assert contract.round_ctx_hint(8208) == 9216 and contract.round_ctx_hint(131088) == 147456
    values = set()
    for n in range(17, 70000, 7):
        r = contract.round_ctx_hint(n)
        assert n <= r <= n * 1.125 and contract.round_ctx_hint(r) == r
        values.add(r)
    # eight planned contexts per doubling at most: a growing context plans few times
    assert len({v for v in values if 16384 < v <= 32768}) == 8


def test_plan_ctx_checks_the_hint():
    assert contract.plan_ctx(None, 131072) == 131072
    assert contract.plan_ctx(8208, 131072) == 9216
    assert contract.plan_ctx(np.int64(8208), 131072) == 9216  # numpy integers welcome
    assert contract.plan_ctx(8256, 8256) == 8256  # rounded, never above the capacity
    for bad in (0, -3, True, 8.5, "8k", [8192]):
        with pytest.raises(ValueError, match="max_ctx must be a positive integer"):
            contract.plan_ctx(bad, 131072)
    with pytest.raises(ValueError, match=r"max_ctx=131073 exceeds the capacity of block_table \(131072"):
        contract.plan_ctx(131073, 131072)


def test_check_paged_and_arena_take_the_hint():
    q, kb, vb, kp, vp, table, wide, lens = _paged()
    dims = contract.check_paged(q, kb, vb, kp, vp, wide, lens, max_ctx=316)
    assert (dims.capacity, dims.max_ctx, dims.plan_ctx) == (wide.shape[1] * 64, 316, 320)
    assert contract.check_paged(q, kb, vb, kp, vp, wide, lens).plan_ctx == wide.shape[1] * 64
    # ctx_lens above the hint break the contract: a value check, so CPU tensors only
    with pytest.raises(ValueError, match=r"ctx_lens\[1\]=300 exceeds max_ctx=299"):
        contract.check_paged(q, kb, vb, kp, vp, wide, lens, max_ctx=299)
    with pytest.raises(ValueError, match="exceeds the capacity of block_table"):
        contract.check_paged(q, kb, vb, kp, vp, table, lens, max_ctx=table.shape[1] * 64 + 1)
    gen = torch.Generator().manual_seed(1)
    ka, va, slots, alens = random_arena_context(MAIN, [100, 300], 4096, "cpu", gen)
    assert contract.check_arena(q, kb, vb, ka, va, slots, alens, max_ctx=316).plan_ctx == 320
    with pytest.raises(ValueError, match="exceeds the capacity of k_arena"):
        contract.check_arena(q, kb, vb, ka, va, slots, alens, max_ctx=4097)


def test_reference_and_ops_give_the_same_answer_with_a_wide_table_and_the_hint():
    q, kb, vb, kp, vp, table, wide, lens = _paged()
    want = reference.paged_attention(q, kb, vb, kp, vp, table, lens)
    for out in (reference.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=316),
                ops.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=316),
                ops.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=316, out=torch.empty_like(q))):
        torch.testing.assert_close(out.float(), want.float(), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="max_ctx must be a positive integer"):
        ops.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=-1)


# ---------------------------------------------------------------------------------------------
# the cupy backend: the split count and the plan key (no GPU: a module of fixed resources)


class _Family:
    """A kernel family whose module has the resources of the main preset's sm_90a variant
    (98 KB of stages, 4 warps, 255 registers: two CTAs per SM)."""

    def module_for(self, *args, **kwargs):
        from drafter_attn.kernels.cupy_backend import _Module

        return _Module(attention=None, combine=None, store=None, smem=96 * 1024, regs=255, threads=128)


@pytest.fixture
def h200_backend(monkeypatch):
    pytest.importorskip("cupy")
    from drafter_attn.kernels import cupy_backend as cb

    monkeypatch.setattr(cb, "device_info", lambda index: (132, 90))
    backend = cb.CupyBackend()
    object.__setattr__(backend, "family", _Family())  # frozen dataclass: an instance attribute
    return backend


def _dims(batch, capacity, max_ctx=None, mask="full", window=None):
    return contract.Dims(batch, 16, 32, 8, 128, 4, 64, capacity, mask, window, 128**-0.5, torch.bfloat16,
                         max_ctx)


@pytest.mark.parametrize("batch, fitted_splits, wide_splits",
                         [(1, 33, 33), (4, 8, 8), (6, 5, 11), (8, 4, 4), (32, 1, 1)])
def test_splits_follow_the_hint_not_the_table_width(h200_backend, batch, fitted_splits,
                                                    wide_splits):
    from drafter_attn.kernels.cupy_backend import Params

    dev, p = torch.device("cuda", 0), Params()
    fitted = h200_backend.plan_splits(_dims(batch, 8256), p, dev)  # ctx 8k + 16 rows, page 64
    wide = h200_backend.plan_splits(_dims(batch, 131072), p, dev)  # 2048 columns of page 64
    hinted = h200_backend.plan_splits(_dims(batch, 131072, max_ctx=8208), p, dev)
    assert fitted == hinted == fitted_splits
    # the capacity's 2048 tiles plan as a 128k context does. Since the split model charges the
    # partial rows beyond one wave, that is mostly one wave of the fitted count (before: 33
    # splits at every batch, +60-69% measured at ctx 8k); B=6 still takes twice the splits
    assert wide == wide_splits
    # windows cap the planned context as before; a tuned split count wins over both
    assert h200_backend.plan_splits(_dims(batch, 131072, 8208, "sliding", 2048), p, dev) == \
        h200_backend.plan_splits(_dims(batch, 2048, None, "sliding", 2048), p, dev)
    assert h200_backend.plan_splits(_dims(batch, 131072, 8208), Params(num_splits=7), dev) == 7


def test_the_hint_is_checked_on_every_call_before_any_kernel(h200_backend):
    """Plans are keyed by the planned context: hints on one grid step share a plan, and a hint
    is validated on every call, also on a plan hit."""
    from drafter_attn.kernels.cupy_backend import call_key

    q, kb, vb, kp, vp, _, wide, lens = _paged()
    args = (q, kb, vb, kp, vp, wide, lens, None)
    cap = wide.shape[1] * 64
    ran = []
    plan = types.SimpleNamespace(run=lambda *a: ran.append(a) or "planned")
    h200_backend._plans[call_key("paged", args, ("full", None, None, 320))] = plan
    assert h200_backend.paged_attention(*args[:7], max_ctx=316) == "planned"
    assert h200_backend.paged_attention(*args[:7], max_ctx=305) == "planned"  # same grid step
    for bad, what in ((cap + 1, "exceeds the capacity"), (0, "positive integer"), (2.5, "positive integer")):
        with pytest.raises(ValueError, match=what):
            h200_backend.paged_attention(*args[:7], max_ctx=bad)
    assert len(ran) == 2


# ---------------------------------------------------------------------------------------------
# Runtime: the dispatch bucket


class _RecordingDispatcher:
    def __init__(self):
        self.problems = []

    def pick(self, problem, sm):
        self.problems.append(problem)
        return reference_pick("recorded")


def test_runtime_buckets_by_the_hint():
    q, kb, vb, kp, vp, _, wide, lens = _paged()
    cap = wide.shape[1] * 64
    d = _RecordingDispatcher()
    rt = Runtime(Dispatcher(), sm=90)
    rt.dispatcher = d
    want = rt.paged_attention(q, kb, vb, kp, vp, wide, lens)
    got = rt.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=316)
    rt.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=318)  # same grid step: no new pick
    assert [p.ctx_len for p in d.problems] == [cap, 320]
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="exceeds the capacity of block_table"):
        rt.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=cap + 64)
    with pytest.raises(ValueError, match=r"ctx_lens\[1\]=300 exceeds max_ctx=200"):
        rt.paged_attention(q, kb, vb, kp, vp, wide, lens, max_ctx=200)


# ---------------------------------------------------------------------------------------------
# the measured step: a wide table, the pool sized to the pages needed


def test_decode_step_with_a_wide_table_and_the_hint():
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner.step import DecodeStep

    g = MAIN.with_(num_layers=2)
    step = DecodeStep(Problem(g, "paged", 16, 2, 100), "reference", device="cpu",
                      table_capacity=2048, max_ctx_hint=True)
    assert step.table.shape == (2, 2048 // 16)
    # the pool holds the pages of the context and the store's rows only (plus one spare)
    assert step.k_cache[0].shape[0] == 2 * 8 + 1  # ceil(116 / 16) = 8 per request
    assert step.max_ctx == 116
    assert step.check() < 1e-2
    assert len(step.run()) == 2
    with pytest.raises(ValueError, match="cannot hold the context 100 plus the 16 stored rows"):
        DecodeStep(Problem(g, "paged", 16, 2, 100), "reference", device="cpu", table_capacity=112)
    with pytest.raises(ValueError, match="paged layout only"):
        DecodeStep(Problem(g, "arena", None, 2, 100), "reference", device="cpu", table_capacity=4096)


# ---------------------------------------------------------------------------------------------
# bench: options, plan, memory


def test_size_options():
    assert options.table_capacities("128k") == [131072]
    assert options.contexts("128k,256k,512k") == [131072, 262144, 524288]
    args = cli.build_parser().parse_args(["decode", "--table-capacity", "128k", "--ctx", "512k",
                                          "--max-ctx-hint", "on", "--batch", "1,4"])
    assert args.table_capacity == [131072] and args.ctx == [524288] and args.max_ctx_hint == "on"
    with pytest.raises(argparse.ArgumentTypeError, match="block-table capacities"):
        options.table_capacities("wide")


def _plan(**kw):
    base = dict(pages=[64], batches=[8, 32], ctxs=[8192], impls=["cupy"], baseline="none")
    base.update(kw)
    return decode.plan("decode", MAIN, MAIN_PRESET, MAIN_PRESET, **base)


def test_plan_table_capacity_rows():
    p = _plan(table_capacities=[131072])
    assert p.max_ctx_hint == "both"
    paged = [(j.batch, j.table, j.hint) for j in p.jobs if j.layout == "paged"]
    assert paged == [(8, None, False), (8, 131072, False), (8, 131072, True),
                     (32, None, False), (32, 131072, False), (32, 131072, True)]
    assert [j.step_options for j in p.jobs if j.batch == 8] == [
        {}, {"table_capacity": 131072}, {"table_capacity": 131072, "max_ctx_hint": True}, {}]
    assert [j.recorded for j in p.jobs if j.batch == 8] == [True, False, False, True]
    assert any("not recorded into the profile database" in n for n in p.notes)
    on = _plan(table_capacities=[131072], max_ctx_hint="on")
    assert [(j.table, j.hint) for j in on.jobs if j.layout == "paged" and j.batch == 8] == [
        (None, True), (131072, True)]
    off = _plan(max_ctx_hint=None)
    assert off.max_ctx_hint == "off" and all(not j.hint and j.table is None for j in off.jobs)
    # the auto pick without the hint is made at the table's width, as Runtime makes it
    wide = next(j for j in p.jobs if j.table and not j.hint)
    assert decode._pick_problem(p, wide).ctx_len == 131072
    assert decode._pick_problem(p, next(j for j in p.jobs if j.hint)).ctx_len == 8192


@pytest.mark.parametrize("kw, message", [
    (dict(table_capacities=[8192]), "--table-capacity 8192: the largest context 8192 plus the 16 rows"),
    (dict(table_capacities=[2**31 - 255]), "more than 2147483392 tokens"),
    (dict(ctxs=[2**31 - 8]), "the int32 context lengths"),
    (dict(max_ctx_hint="maybe"), "--max-ctx-hint maybe: expected one of on, off, both"),
])
def test_plan_errors(kw, message):
    with pytest.raises(decode.BenchError, match=message.replace("(", r"\(").replace("+", r"\+")):
        _plan(**kw)


def test_measurement_bytes_at_long_contexts():
    # the main preset's five layers at 512k x 4: 40 GiB of K/V, the read floor's 40 GiB beside it
    need = step_memory.measurement_bytes(MAIN, "paged", 64, 4, 512 * 1024, 16)
    kv = 5 * 4 * (512 * 1024 + 16) * 4096
    assert kv < need < kv * 2 + (2 << 30)
    assert need < 0.92 * 139 * 2**30
    arena = step_memory.measurement_bytes(MAIN, "arena", None, 4, 512 * 1024, 16)
    assert abs(arena - need) < 64 << 20  # the paged pool holds only the pages needed: as dense
    # a wide table adds columns, not pages: only the reference check gathers to its width
    fitted = step_memory.measurement_bytes(MAIN, "paged", 64, 8, 8192, 16)
    assert fitted < step_memory.measurement_bytes(MAIN, "paged", 64, 8, 8192, 16, 131072) < 12 << 30
    assert step_memory.measurement_bytes(MAIN, "paged", 64, 8, 512 * 1024, 16) > 139 * 2**30


def test_check_memory_refuses_what_does_not_fit():
    decode.check_memory(_plan(batches=[1, 4], ctxs=[131072, 524288]), H200.memory_bytes)
    with pytest.raises(decode.BenchError, match=r"decode paged page 64 B=8 ctx=524288 needs about .* GiB.*"
                                                r"Lower --batch, --ctx or --layers"):
        decode.check_memory(_plan(batches=[4, 8], ctxs=[524288]), H200.memory_bytes)
    # one layer fits where five do not
    one_layer = decode.plan("decode", MAIN.with_(num_layers=1), "custom", None, pages=[64], batches=[8],
                            ctxs=[524288], impls=["cupy"], baseline="none")
    decode.check_memory(one_layer, H200.memory_bytes)


# ---------------------------------------------------------------------------------------------
# bench decode end to end, GPU and measurements faked


def _fake_env(g):
    return dict(gpu_name=g.name, sm=g.sm, sm_count=g.sm_count, driver="580.95", cuda="13.0", torch="fake",
                cupy=None, cutlass=None, nvrtc=None, sources_hash="0" * 16)


def _fake_decode(wire, reps=0, nsys=False, table_capacity=None, max_ctx_hint=False):
    p = wire["problem"]
    t = 10 + p["batch"] * p["ctx_len"] / 1000
    if p["layout"] == "paged":
        t *= 1.005
        if table_capacity and not max_ctx_hint:
            t *= 1.6  # the capacity's split count
        elif table_capacity:
            t *= 1.01
    return dict(status="ok", median_us=t, p10_us=t * 0.99, p90_us=t * 1.02, attention_median_us=0.8 * t,
                store_median_us=0.2 * t, syncs_debug=0, syncs_profiler=0, rel_err=2e-3, read_floor_us=t / 2)


def _fakes(mp):
    mp.setattr(gpu, "probe", lambda: [H200])
    mp.setattr(decode, "gpu_environment", _fake_env)
    mp.setattr(decode, "default_measures", lambda: (_fake_decode, None, None))
    mp.delenv("DRAFTER_TUNED_TABLE", raising=False)


def test_bench_decode_table_capacity_faked(monkeypatch, tmp_path, capsys):
    _fakes(monkeypatch)
    db, out = tmp_path / "p.db", tmp_path / "out"
    rc = cli.main(["decode", "--sm", "90", "--page", "64", "--batch", "8,32", "--ctx", "8k",
                   "--table-capacity", "128k", "--baseline", "none", "--impl", "cupy",
                   "--db", str(db), "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "paged 64 t128k " in text and "paged 64 t128k+hint" in text and "vs fit" in text
    assert "block table of 131072 tokens, without a hint: over the fitted table median +60.00%" in text
    assert "block table of 131072 tokens, with the max_ctx hint: over the fitted table median +1.00%" in text
    assert "paged over arena median +0.500%" in text  # the fitted rows only
    rows = json.loads((out / "decode.json").read_text())["rows"]
    assert len(rows) == 2 * 4
    wide = [r for r in rows if r["table_capacity"]]
    assert {(r["max_ctx_hint"], round(r["over_fitted_pct"], 6)) for r in wide} == {(False, 60.0), (True, 1.0)}
    with ProfileDB(db, create=False) as pdb:  # the wide-table rows stay out of the database
        assert len(pdb.query("SELECT id FROM results")) == 2 * 2


def test_bench_decode_refuses_sizes_that_do_not_fit(monkeypatch, capsys):
    _fakes(monkeypatch)
    assert cli.main(["decode", "--sm", "90", "--batch", "16", "--ctx", "512k", "--baseline", "none"]) == 2
    err = capsys.readouterr().err
    assert "B=16 ctx=524288 needs about" in err and "Lower --batch, --ctx or --layers" in err


# ---------------------------------------------------------------------------------------------
# AUTO: measured long-context rows


def _entries(tmp_path, name, rows):
    path = tmp_path / f"{name}.db"
    build_db(path, {"h": (H200_ENV, rows)})
    return Dispatcher.load(path).entries, path


def _pairs(batches, ctxs, overhead):
    rows = []
    for b in batches:
        for c in ctxs:
            base = 100.0 * b * c / 8192
            rows += [dict(layout="arena", batch=b, ctx=c, median_us=base, syncs_debug=0),
                     dict(layout="paged", page=64, batch=b, ctx=c, median_us=base * (1 + overhead), syncs_debug=0)]
    return rows


def _dep(**kw):
    base = dict(preset=MAIN_PRESET, page_size=64, max_ctx=512 * 1024, concurrency=4)
    base.update(kw)
    return Deployment(**base)


def test_auto_long_contexts_decide_a_long_deployment(tmp_path):
    short, _ = _entries(tmp_path, "short", _pairs([4, 32], [8192, 32768], 0.005))
    long_, _ = _entries(tmp_path, "long", _pairs([1, 4], [LONG_CTX, 512 * 1024], 0.03))
    entries = merge_entries(short, long_)
    rec = recommend(_dep(), entries)
    assert rec.layout == "arena" and rec.decided_by == "long_context"
    r = next(r for r in rec.reasons if r.kind == "long_context")
    assert r.data["batch"] == 4 and [p["ctx_len"] for p in r.data["pairs"]] == [LONG_CTX, 512 * 1024]
    # a mean context below 128k: the long rows are said, the latency over all contexts decides
    rec = recommend(_dep(mean_ctx=8192), entries)
    assert rec.decided_by == "latency" and "not deciding" in next(
        r for r in rec.reasons if r.kind == "long_context").text
    # a 32k deployment has no long-context reason at all
    assert not [r for r in recommend(_dep(max_ctx=32768), entries).reasons if r.kind == "long_context"]
    # not measured: said, and the shorter contexts decide
    rec = recommend(_dep(), short)
    assert rec.decided_by == "latency" and any("long contexts" in m for m in rec.missing)


def test_merge_entries_later_sources_win(tmp_path):
    a, _ = _entries(tmp_path, "a", _pairs([4], [LONG_CTX], 0.03))
    b, _ = _entries(tmp_path, "b", _pairs([4], [LONG_CTX], 0.0))
    merged = merge_entries(a, b)
    assert len(merged) == 2 and all(any(e is x for x in b) for e in merged)


def test_tuner_auto_with_long_context_rows(tmp_path, capsys):
    from drafter_attn.tuner.cli import main

    _, short = _entries(tmp_path, "short", _pairs([4], [8192], 0.005))
    _, long_ = _entries(tmp_path, "long", _pairs([4], [LONG_CTX, 512 * 1024], 0.0))
    argv = ["auto", "--preset", MAIN_PRESET, "--page", "64", "--max-ctx", "524288",
            "--concurrency", "4", "--db", str(short), "--format", "json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decided_by"] == "latency" and any("long contexts" in m for m in doc["missing"])
    assert main(argv + ["--with", str(long_)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decided_by"] == "long_context" and doc["recommendation"] == "paged"
    assert str(long_) in doc["measurements"]
    assert main(argv + ["--with", str(tmp_path / "missing.db")]) == 2


def test_attention_table_long_contexts_and_memory():
    from drafter_attn.bench import attention_table as at

    args = at.parse_args(["--ctx", "128k,256k,512k", "--batch", "1,4", "--page", "64"])
    assert args.ctx == [131072, 262144, 524288] and args.batch == [1, 4]
    assert at.shapes("4x512k") == [(4, 524288)]
    points = [(b, c) for b in args.batch for c in args.ctx]
    at.check_memory(MAIN, points, args.page, ["flashinfer-fa2"], H200.memory_bytes)  # one layer: fits
    with pytest.raises(SystemExit, match=r"page 64 B=32 ctx=2097152 needs about .* lower --batch or --ctx"):
        at.check_memory(MAIN, [(32, 2 << 20)], [64], [], H200.memory_bytes)
