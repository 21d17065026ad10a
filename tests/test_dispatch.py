"""The runtime (kernels.dispatch), CPU only: every tier from a database built here, supports()
before a choice, unusable tables, the serving entry point, and the host cost of a pick."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from drafter_attn.kernels import dispatch, reference, registry, tuned_table
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.dispatch import Dispatcher, Runtime, TableError, bucket
from drafter_attn.kernels.spec import Problem
from helpers import random_block
from profile_fakes import B200, H200, MAIN, FakeBackend, build_db, small_geometry

REPO = Path(__file__).resolve().parent.parent
FAST = {"tile_n": 64, "stages": 3, "num_splits": 0}
SLOW = {"tile_n": 32, "stages": 2, "num_splits": 1}


def _p(batch=8, ctx=2048, layout="paged", page=64, geometry=MAIN):
    return Problem(geometry.with_(num_layers=1), layout, page if layout == "paged" else None, batch, ctx)


@pytest.fixture
def db(tmp_path):
    """sm90: page 64 and arena at B in {8, 32} x ctx {2048, 8192}, two candidates each (FAST
    wins); sm100: page 64 at B=8 ctx=2048 only, where SLOW wins."""
    path = tmp_path / "profile.db"
    h200 = []
    for layout in ("paged", "arena"):
        for batch in (8, 32):
            for ctx in (2048, 8192):
                base = batch * ctx / 1000
                h200 += [dict(layout=layout, batch=batch, ctx=ctx, params=FAST, median_us=base),
                         dict(layout=layout, batch=batch, ctx=ctx, params=SLOW, median_us=base * 1.3)]
    b200 = [dict(batch=8, ctx=2048, params=FAST, median_us=20.0),
            dict(batch=8, ctx=2048, params=SLOW, median_us=10.0)]
    build_db(path, {"h200": (H200, h200), "b200": (B200, b200)})
    return path


@pytest.fixture(autouse=True)
def fakes_environment(monkeypatch):
    """The runtime compares entries with this process's environment: here, the one the fake
    databases record (profile_fakes.H200, no GPU to compare)."""
    env = tuned_table.Environment(None, H200["sources_hash"], {"nvrtc": H200["nvrtc"]})
    monkeypatch.setattr(tuned_table, "current_environment", lambda: env)
    return env


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.setattr(FakeBackend, "device_types", ("cpu", "cuda"), raising=False)
    log: list = []
    registry.register("fake-a", lambda: FakeBackend("fake-a", unsupported_head_dims=(128,), log=log))
    registry.register("fake-b", lambda: FakeBackend("fake-b", log=log))
    yield log
    registry.unregister("fake-a")
    registry.unregister("fake-b")


# ---------------------------------------------------------------------------------------------
# tiers


def test_bucket():
    assert [bucket(x) for x in (0, 1, 2, 3, 5, 8, 9, 2048, 2049)] == [0, 1, 2, 4, 8, 8, 16, 2048, 4096]


def test_exact_tier(db):
    d = Dispatcher.load(db)
    pick = d.pick(_p(8, 2048), sm=90)
    assert pick.tier == "exact" and pick.impl == "cupy"
    assert {k: pick.params[k] for k in FAST} == FAST  # the faster of the two candidates
    assert "exact" in pick.reason and "winner of 2" in pick.reason and "measured" in pick.reason
    assert str(db) in pick.source
    with pytest.raises(TypeError):
        pick.params["tile_n"] = 1  # cached picks are shared: read-only


def test_bucketed_tier_same_bucket(db):
    pick = Dispatcher.load(db).pick(_p(5, 1500), sm=90)  # buckets (8, 2048)
    assert pick.tier == "bucketed" and "same bucket batch<=8 ctx<=2048" in pick.reason
    assert pick.entry["batch"] == 8 and pick.entry["ctx_len"] == 2048


def test_bucketed_tier_nearest_bucket(db):
    pick = Dispatcher.load(db).pick(_p(64, 100_000), sm=90)
    assert pick.tier == "bucketed" and "nearest measured bucket" in pick.reason
    assert (pick.entry["batch"], pick.entry["ctx_len"]) == (32, 8192)


def test_family_tier(db):
    # sm103 has no rows; sm100 is of the same family (10x) and SLOW won there
    pick = Dispatcher.load(db).pick(_p(8, 2048), sm=103)
    assert pick.tier == "family" and "sm100" in pick.reason
    assert {k: pick.params[k] for k in SLOW} == SLOW


def test_default_tier(db):
    d = Dispatcher.load(db)
    pick = d.pick(_p(8, 2048), sm=80)  # no sm8x rows at all
    assert pick.tier == "default" and pick.impl == "cupy"
    assert pick.params == registry.get("cupy").default_params(_p(8, 2048), sm=80)
    assert "no sm80 entry" in pick.reason
    # a shape cupy does not support: the reference
    odd = MAIN.with_(head_dim=96)
    pick = d.pick(_p(8, 2048, geometry=odd), sm=90)
    assert pick.tier == "default" and pick.impl == "reference" and "head_dim 96" in pick.reason
    # an unknown GPU does not consult the table
    assert d.pick(_p(8, 2048), sm=None).tier == "default"
    # no table at all
    assert Dispatcher().pick(_p(8, 2048), sm=90).tier == "default"


def test_layout_and_page_are_part_of_the_key(db):
    d = Dispatcher.load(db)
    assert d.pick(_p(8, 2048, layout="arena"), sm=90).tier == "exact"
    assert d.pick(_p(8, 2048, page=16), sm=90).tier == "default"  # page 16 was not measured


def test_supports_is_checked_before_a_choice(tmp_path, fakes):
    # fake-a won everywhere but does not do head_dim 128; fake-b is the runner-up
    path = tmp_path / "p.db"
    rows = [dict(impl="fake-a", params={"tile": 2}, median_us=1.0),
            dict(impl="fake-b", params={"tile": 1}, median_us=2.0)]
    build_db(path, {"h": (H200, rows)})
    d = Dispatcher.load(path)
    pick = d.pick(_p(8, 2048), sm=90)
    assert pick.tier == "exact" and pick.impl == "fake-b" and "alternative 1" in pick.reason
    assert "fake-a[tile=2] skipped: fake-a does not do head_dim 128" in pick.reason


@pytest.mark.parametrize("impl, params, message", [
    ("no-such-backend", {}, "unknown backend 'no-such-backend'"),
    ("fake-b", {"bogus": 1}, r"unknown fake-b params \['bogus'\]"),
    ("reference", {"tile_n": 64}, "reference.*no tunable parameters"),
])
def test_entries_that_do_nothing_are_flagged_at_load(tmp_path, fakes, impl, params, message):
    # an entry naming an unknown backend or parameter is a miss, flagged once when loaded
    build_db(tmp_path / "q.db", {"h": (H200, [dict(impl=impl, params=params, median_us=1.0)])})
    with pytest.warns(RuntimeWarning, match=f"1 entries left out.*{message}") as record:
        d = Dispatcher.load(tmp_path / "q.db")
    assert len(record) == 1 and d.entries == []
    assert d.pick(_p(8, 2048), sm=90).tier == "default"


def test_pick_never_raises():
    with pytest.warns(RuntimeWarning, match=r"1 entries left out.*num_q_heads must be int"):
        d = Dispatcher([{"sm": 90, "bad": True}])  # a bad row is a miss, flagged once
    assert d.entries == []
    assert d.pick("not a problem", sm=90).impl == "reference"  # and picking never raises
    assert Dispatcher().pick_key((90, 32, 8, 128, 16, "nope", None, "bfloat16", "paged", 64, 8, 2048)).impl \
        == "reference"


def test_predicted_rows_are_not_mixed_unless_asked(tmp_path):
    path = tmp_path / "p.db"
    build_db(path, {"b": (B200, [dict(params=FAST, median_us=5.0, provenance="predicted")]),
                    "h": (H200, [dict(params=SLOW, median_us=50.0)])})
    assert Dispatcher.load(path).pick(_p(), sm=100).tier == "default"
    pick = Dispatcher.load(path, include_predicted=True).pick(_p(), sm=100)
    assert pick.tier == "exact" and "predicted" in pick.reason
    # measured beats predicted in the same group, even when the prediction is faster
    build_db(tmp_path / "q.db", {"h": (H200, [dict(params=FAST, median_us=5.0, provenance="predicted"),
                                              dict(params=SLOW, median_us=50.0)])})
    pick = Dispatcher.load(tmp_path / "q.db", include_predicted=True).pick(_p(), sm=90)
    assert pick.params["tile_n"] == SLOW["tile_n"]


@pytest.mark.parametrize("stamps", [None, ("2026-01-01T00:00:00.000+00:00",) * 3],
                         ids=["now", "same-millisecond"])
def test_newest_measurement_of_a_candidate_counts(tmp_path, stamps):
    # FAST measured again, slower; rows of one sweep can share a millisecond: insert order decides
    path = tmp_path / "p.db"
    rows = [dict(params=FAST, median_us=1.0), dict(params=SLOW, median_us=2.0),
            dict(params=FAST, median_us=3.0)]
    for kw, stamp in zip(rows, stamps or ()):
        kw["created_at"] = stamp
    build_db(path, {"h": (H200, rows)})
    pick = Dispatcher.load(path).pick(_p(), sm=90)
    assert pick.params["tile_n"] == SLOW["tile_n"] and pick.entry["candidates"] == 2


def test_a_newer_timestamp_beats_a_later_insert(tmp_path):
    # merged databases insert old rows late: the timestamp, not the insert order, says which is newer
    path = tmp_path / "p.db"
    build_db(path, {"h": (H200, [dict(params=FAST, median_us=3.0, created_at="2026-02-01T00:00:00.000+00:00"),
                                 dict(params=SLOW, median_us=2.0),
                                 dict(params=FAST, median_us=1.0, created_at="2026-01-01T00:00:00.000+00:00")])})
    pick = Dispatcher.load(path).pick(_p(), sm=90)
    assert pick.params["tile_n"] == SLOW["tile_n"]


def test_failed_rows_are_ignored(tmp_path):
    path = tmp_path / "p.db"
    build_db(path, {"h": (H200, [dict(params=FAST, median_us=None, status="failed_runtime"),
                                 dict(params=SLOW, median_us=9.0)])})
    assert Dispatcher.load(path).pick(_p(), sm=90).params["tile_n"] == SLOW["tile_n"]


def test_picks_are_cached(db):
    d = Dispatcher.load(db)
    assert d.pick(_p(), sm=90) is d.pick(_p(), sm=90)


# ---------------------------------------------------------------------------------------------
# the database is read read-only; kernels stays independent of tuner


def test_database_is_opened_read_only(db):
    before = db.read_bytes()
    os.chmod(db, 0o444)
    try:
        d = Dispatcher.load(db)
    finally:
        os.chmod(db, 0o644)
    assert d.entries and db.read_bytes() == before


def test_db_constants_match_the_tuner_schema(tmp_path):
    from drafter_attn.tuner import db as tdb

    assert (dispatch.DB_SCHEMA_NAME, dispatch.DB_SCHEMA_VERSION) == (tdb.SCHEMA_NAME, tdb.SCHEMA_VERSION)
    with tdb.ProfileDB(tmp_path / "x.db") as d:
        d.query(dispatch.DB_ROWS_SQL)  # every column the runtime reads exists


def test_kernels_does_not_import_tuner_or_bench():
    code = ("import sys, kernels.dispatch, kernels.auto; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tuner', 'bench')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ---------------------------------------------------------------------------------------------
# unusable tables: a clear error from the loader, the default heuristic in the runtime


def _table(tmp_path, **changes) -> Path:
    doc = dispatch.make_table([], {"test": True})
    doc.update(changes)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("content, message", [
    (b"\x00\x01garbage{", "neither a profile database nor a JSON tuned table"),
    (b'{"format": "drafter-attn-tuned-table", "version": 1', "neither a profile database"),
    (b"[1, 2]", "not a tuned table"),
    (b'{"format": "something-else", "version": 1}', "not a drafter-attn tuned table"),
])
def test_corrupt_tables(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.raises(TableError, match=message):
        Dispatcher.load(path)


def test_foreign_versions(tmp_path):
    with pytest.raises(TableError, match="version 2.*reads version 1"):
        Dispatcher.load(_table(tmp_path, version=2))
    with pytest.raises(TableError, match="bucket rules"):
        Dispatcher.load(_table(tmp_path, rules={"batch": "linear"}))
    with pytest.raises(TableError, match="version True"):  # a bool is not a version (true == 1)
        Dispatcher.load(_table(tmp_path, version=True))
    bad_entry = {"sm": 90, "num_q_heads": "32"}
    with pytest.warns(RuntimeWarning, match=r"num_q_heads must be int.*first entries\[0\]"):
        assert Dispatcher.load(_table(tmp_path, entries=[bad_entry])).entries == []
    with pytest.raises(TableError, match="no such file|cannot read"):
        Dispatcher.load(tmp_path / "missing.json")


def test_foreign_databases(tmp_path, db):
    other = tmp_path / "other.db"
    c = sqlite3.connect(other)
    c.execute("CREATE TABLE t (x)")
    c.commit()
    c.close()
    with pytest.raises(TableError, match="not a drafter-attn profile database"):
        Dispatcher.load(other)
    c = sqlite3.connect(db)
    c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    c.commit()
    c.close()
    with pytest.raises(TableError, match="schema version 99.*reads versions 1, 2, 3"):
        Dispatcher.load(db)


def test_runtime_falls_back_and_warns_once(tmp_path, gen):
    path = _table(tmp_path, version=99)
    with pytest.warns(RuntimeWarning, match="tuned table unusable.*version 99") as record:
        rt = Runtime(path, sm=90)
    assert len([w for w in record if w.category is RuntimeWarning]) == 1
    assert isinstance(rt.table_error, TableError)
    g = small_geometry()
    q, kb, vb = random_block(g, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning on the step
        out = rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    (pick,) = rt.picks.values()
    assert pick.tier == "default" and "unusable" in pick.source
    assert out.shape == q.shape


# ---------------------------------------------------------------------------------------------
# the serving entry point


def _fake_table(tmp_path, geometry, impl="fake-b", params=None, page=16, batch=2, ctx=64):
    path = tmp_path / "fake.db"
    rows = [dict(geometry=geometry, impl=impl, params=params or {"tile": 2}, page=page, batch=batch,
                 ctx=ctx, median_us=1.0),
            dict(geometry=geometry, layout="arena", impl=impl, params=params or {"tile": 2}, batch=batch,
                 ctx=ctx, median_us=1.0)]
    build_db(path, {"h": (H200, rows)})
    return path


def test_runtime_runs_the_picked_backend(tmp_path, gen, fakes):
    g = small_geometry()
    rt = Runtime(_fake_table(tmp_path, g), sm=90)
    q, kb, vb = random_block(g, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen, extra_pages=1)
    # capacity = table columns x page = 4 x 16 = 64 -> the entry measured at ctx 64
    rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    first = len([e for e in fakes if e[0] == "with_params"])  # supports() and the binding
    for _ in range(2):
        out = rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    torch.testing.assert_close(out, reference.paged_attention(q, kb, vb, k_pages, v_pages, table, lens))
    assert len([e for e in fakes if e[0] == "with_params"]) == first == 2  # picked and bound once
    assert [e for e in fakes if e[0] == "paged_attention"] == [("paged_attention", {"tile": 2})] * 3
    (pick,) = rt.picks.values()
    assert pick.impl == "fake-b" and pick.tier == "exact"

    # the store follows the attention picked for the same cache
    k_new, v_new = kb.clone(), vb.clone()
    num = torch.tensor([3, 1], dtype=torch.int32)
    rt.store_paged(k_new, v_new, num, k_pages, v_pages, table, lens)
    assert fakes[-1] == ("store_paged", {"tile": 2}) and lens.tolist() == [8, 41]

    # the arena
    k_ar, v_ar, slots, alens = random_arena_context(g, [5, 40], 64, "cpu", gen)
    out = rt.arena_attention(q, kb, vb, k_ar, v_ar, slots, alens)
    torch.testing.assert_close(out, reference.arena_attention(q, kb, vb, k_ar, v_ar, slots, alens))
    assert fakes[-1] == ("arena_attention", {"tile": 2})
    rt.store_arena(k_new, v_new, num, k_ar, v_ar, slots, alens)
    assert fakes[-1] == ("store_arena", {"tile": 2})


def test_runtime_store_before_attention_and_with_geometry(tmp_path, gen, fakes):
    g = small_geometry()
    path = _fake_table(tmp_path, g)
    k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen, extra_pages=1)
    q, kb, vb = random_block(g, 2, "cpu", gen)
    num = torch.tensor([1, 1], dtype=torch.int32)
    # without the geometry, a store before any attention uses the default heuristic...
    rt = Runtime(path, sm=90)
    rt.store_paged(kb, vb, num, k_pages, v_pages, table, lens)
    assert not [e for e in fakes if e[0] == "store_paged"]
    rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    rt.store_paged(kb, vb, num, k_pages, v_pages, table, lens)  # ...then follows the attention
    assert fakes[-1][0] == "store_paged"
    # with the geometry, the first store already gets the tuned backend
    fakes.clear()
    rt = Runtime(path, sm=90, geometry=g)
    rt.store_paged(kb, vb, num, k_pages, v_pages, table, lens)
    assert fakes[-1][0] == "store_paged"


def test_runtime_cpu_without_sm_runs_the_reference(tmp_path, gen, fakes):
    g = small_geometry()
    rt = Runtime(_fake_table(tmp_path, g))
    q, kb, vb = random_block(g, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen)
    rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    (pick,) = rt.picks.values()
    assert pick.impl == "reference" and "cpu" in pick.reason and not fakes


def test_runtime_unbuildable_backend_falls_back(tmp_path, gen):
    g = small_geometry()
    registry.register("fake-broken", lambda: (_ for _ in ()).throw(ImportError("no such library")))
    try:
        # supports() cannot be asked either, so the pick itself already skips it
        rt = Runtime(_fake_table(tmp_path, g, impl="fake-broken"), sm=90)
        q, kb, vb = random_block(g, 1, "cpu", gen)
        k_pages, v_pages, table, lens = random_paged_context(g, [7], 16, "cpu", gen)
        rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
        (pick,) = rt.picks.values()
        assert pick.impl in ("cupy", "reference") and "fake-broken" in pick.reason
    finally:
        registry.unregister("fake-broken")


def test_runtime_serves_an_empty_batch(tmp_path, gen, fakes):
    """B=0 (an engine between batches) is not a problem to pick for: every function returns its
    empty result or stores nothing, and the picks for real batches of the cache are unchanged."""
    g = small_geometry()
    rt = Runtime(_fake_table(tmp_path, g), sm=90)
    q, kb, vb = random_block(g, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen, extra_pages=1)
    k_ar, v_ar, slots, alens = random_arena_context(g, [5, 40], 64, "cpu", gen)
    none = slice(0, 0)
    out = rt.paged_attention(q[none], kb[none], vb[none], k_pages, v_pages, table[none], lens[none])
    assert out.shape == (0, *q.shape[1:])
    out = rt.arena_attention(q[none], kb[none], vb[none], k_ar, v_ar, slots[none], alens[none])
    assert out.shape == (0, *q.shape[1:])
    empty = torch.zeros(0, dtype=torch.int32)
    rt.store_paged(kb[none], vb[none], empty, k_pages, v_pages, table[none], lens[none])
    rt.store_arena(kb[none], vb[none], empty, k_ar, v_ar, slots[none], alens[none])
    assert {p.impl for p in rt.picks.values()} == {"reference"} and not fakes
    # a real batch of the same cache still gets its pick, and its store follows it
    rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    rt.store_paged(kb, vb, torch.tensor([1, 1], dtype=torch.int32), k_pages, v_pages, table, lens)
    assert fakes[-2:] == [("paged_attention", {"tile": 2}), ("store_paged", {"tile": 2})]


def test_runtime_keeps_the_contract_errors(gen):
    g = small_geometry()
    rt = Runtime(sm=90)
    q, kb, vb = random_block(g, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen)
    with pytest.raises(ValueError, match="block_table must be int32"):
        rt.paged_attention(q, kb, vb, k_pages, v_pages, table.long(), lens)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        rt.paged_attention(q[0], kb, vb, k_pages, v_pages, table, lens)
    with pytest.raises(ValueError, match="window is required"):
        rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens, mask="sliding")


def test_runtime_table_from_environment(tmp_path, monkeypatch, fakes):
    g = small_geometry()
    monkeypatch.setenv("DRAFTER_TUNED_TABLE", str(_fake_table(tmp_path, g)))
    assert Runtime(sm=90).dispatcher.entries


# ---------------------------------------------------------------------------------------------
# host cost of a pick (recorded by pytest-benchmark, not asserted)


def test_bench_pick_cached(benchmark, db):
    d = Dispatcher.load(db)
    problem = _p(5, 1500)
    d.pick(problem, 90)
    pick = benchmark.pedantic(d.pick, (problem, 90), rounds=200, iterations=100)
    assert pick.tier == "bucketed"


def test_bench_pick_first_time(benchmark, db):
    d = Dispatcher.load(db)
    problem = _p(5, 1500)

    def first_pick():
        d.clear_cache()
        return d.pick(problem, 90)

    assert benchmark.pedantic(first_pick, rounds=200, iterations=10).tier == "bucketed"


def test_bench_runtime_call_overhead(benchmark, tmp_path, gen):
    """What the serving entry point adds to a call: the shape key and the lookup (the backend
    here returns at once)."""

    class Noop(FakeBackend):
        device_types = ("cpu",)

        def paged_attention(self, *args, **kw):
            return None

    registry.register("fake-noop", lambda: Noop("fake-noop"))
    try:
        g = small_geometry()
        rt = Runtime(_fake_table(tmp_path, g, impl="fake-noop", params={"tile": 1}), sm=90)
        q, kb, vb = random_block(g, 2, "cpu", gen)
        k_pages, v_pages, table, lens = random_paged_context(g, [5, 40], 16, "cpu", gen, extra_pages=1)
        args = (q, kb, vb, k_pages, v_pages, table, lens)
        rt.paged_attention(*args)
        benchmark.pedantic(rt.paged_attention, args, rounds=200, iterations=100)
        assert next(iter(rt.picks.values())).impl == "fake-noop"
    finally:
        registry.unregister("fake-noop")
