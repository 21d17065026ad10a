"""Tuned tables on the CPU: checks at load (GPU, kernel sources, library versions), the typed
entry's ranking, discovery of the shipped defaults, and contents that must never raise from the
runtime or the tuner's table commands (issues 14 and 17)."""

from __future__ import annotations

import json
import sqlite3
import warnings

import pytest
import torch

from drafter_attn.kernels import registry, shipped, tuned_table
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.dispatch import Dispatcher, Runtime, TableError, make_table
from drafter_attn.kernels.spec import Problem
from drafter_attn.kernels.tuned_table import Entry, Environment
from drafter_attn.tuner import export
from drafter_attn.tuner.cli import main
from helpers import random_block
from profile_fakes import H200, build_db, small_geometry

FAST = {"tile_n": 64, "stages": 3}
G = small_geometry()
# The environment the fake databases record (profile_fakes.H200) on the GPU they name.
HERE = Environment("NVIDIA H200", H200["sources_hash"], {"nvrtc": H200["nvrtc"], "cutlass": None})


def _problem(batch=2, ctx=64):
    return Problem(G, "paged", 16, batch, ctx)


def _db(tmp_path, rows=None, name="p.db"):
    path = tmp_path / name
    rows = rows or [dict(geometry=G, page=16, batch=2, ctx=64, params=FAST, median_us=10.0)]
    build_db(path, {"h": (H200, rows)})
    return path


def _table(tmp_path, edit=None, name="t.json", **doc_changes):
    """A tuned table exported from a fake database; `edit(entry)` changes its one entry."""
    doc = export.export_table(_db(tmp_path), resolve_commits=False)
    for e in doc["entries"]:
        if edit:
            edit(e)
    doc.update(doc_changes)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def here(monkeypatch):
    monkeypatch.setattr(tuned_table, "current_environment", lambda: HERE)
    return HERE


def _load_one_warning(path, env=HERE):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        d = Dispatcher.load(path, env=env)
    runtime_warnings = [w for w in record if w.category is RuntimeWarning]
    assert len(runtime_warnings) == 1, [str(w.message) for w in record]
    return d, str(runtime_warnings[0].message)


# ---------------------------------------------------------------------------------------------
# checks at load: another GPU, other kernel sources or library versions -> a miss, one warning


def test_matching_entries_are_used(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = Dispatcher.load(_table(tmp_path), env=HERE)
    assert d.pick(_problem(), 90).tier == "exact"


@pytest.mark.parametrize("env, field, expected, found", [
    (Environment("NVIDIA H100 80GB HBM3", "src-a", {"nvrtc": "13.0"}), "gpu", "NVIDIA H100 80GB HBM3",
     "NVIDIA H200"),
    (Environment("NVIDIA H200", "src-b", {"nvrtc": "13.0"}), "sources_hash", "src-b", "src-a"),
    (Environment("NVIDIA H200", "src-a", {"nvrtc": "14.0"}), "nvrtc version", "14.0", "13.0"),
])
def test_a_foreign_entry_is_a_miss_with_one_warning(tmp_path, env, field, expected, found):
    for path, what in ((_table(tmp_path), "entries"), (_db(tmp_path, name="q.db"), "rows")):  # alike
        d, message = _load_one_warning(path, env)
        assert f"{field}: expected {expected!r}" in message and f"found {found!r}" in message
        assert f"1 {what} left out" in message
        assert d.entries == [] and d.pick(_problem(), 90).tier == "default"


def test_a_database_key_is_decided_by_the_rows_measured_here(tmp_path):
    """Read directly, a profile database decides each key among the rows of this environment:
    a faster row of yesterday's kernel sources (or another GPU) does not take the key and then
    leave it a miss, while today's row of it was measured."""
    path = tmp_path / "mixed.db"
    slow = dict(geometry=G, page=16, batch=2, ctx=64, params={"tile_n": 32, "stages": 4}, median_us=12.0)
    build_db(path, {"old": (dict(H200, sources_hash="src-old"), [dict(slow, params=FAST, median_us=8.0)]),
                    "h100": (dict(H200, gpu_name="NVIDIA H100 80GB HBM3"), [dict(slow, median_us=7.0)]),
                    "here": (H200, [slow])})
    d, message = _load_one_warning(path)
    assert "2 rows left out (measured elsewhere" in message and "sources_hash" in message
    pick = d.pick(_problem(), 90)
    assert pick.tier == "exact" and dict(pick.params) == slow["params"]


def test_another_minor_nvrtc_uses_the_entry_and_says_so(tmp_path):
    """A pip install resolves the newest NVRTC 13.x while the GPU machine that measured the table
    keeps its toolkit's 13.0: the same major version compiles the same sources to close code, so
    the entries are used (not all misses), with one warning naming both versions."""
    here = Environment("NVIDIA H200", "src-a", {"nvrtc": "13.5"})
    for path in (_table(tmp_path), _db(tmp_path, name="q.db")):
        d, message = _load_one_warning(path, here)
        assert "1 entries measured with NVRTC 13.0 run with NVRTC 13.5 here: used as measured" in message
        assert d.pick(_problem(), 90).tier == "exact"


def test_gpu_classes_declare_compatible_gpus(tmp_path):
    h100 = Environment("NVIDIA H100 80GB HBM3", "src-a", {"nvrtc": "13.0"})
    classes = {"hopper": ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]}
    d = Dispatcher.load(_table(tmp_path, gpu_classes=classes), env=h100)
    assert d.pick(_problem(), 90).tier == "exact"
    # an entry may name the class itself
    d = Dispatcher.load(_table(tmp_path, lambda e: e["provenance"].update(gpu="hopper"),
                               gpu_classes=classes), env=h100)
    assert d.pick(_problem(), 90).tier == "exact"
    with pytest.raises(TableError, match="gpu_classes must map"):
        Dispatcher.load(_table(tmp_path, gpu_classes={"hopper": "NVIDIA H200"}))


def test_export_declares_gpu_classes(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["export", "--db", str(_db(tmp_path)), "--no-commits", "--out", str(out),
                 "--gpu-class", "hopper=NVIDIA H200, NVIDIA H100 80GB HBM3"]) == 0
    h100 = Environment("NVIDIA H100 80GB HBM3", "src-a", {"nvrtc": "13.0"})
    assert Dispatcher.load(out, env=h100).pick(_problem(), 90).tier == "exact"
    with pytest.raises(SystemExit):
        main(["export", "--gpu-class", "hopper", "--out", str(out)])
    assert "expected CLASS=GPU" in capsys.readouterr().err


def test_export_records_what_the_runtime_compares(tmp_path):
    e = json.loads(_table(tmp_path).read_text())["entries"][0]
    prov = e["provenance"]
    assert prov["gpu"] == "NVIDIA H200" and prov["sources_hash"] == "src-a"
    assert prov["versions"] == {"torch": "2.11.0", "cupy": "14.2.0", "cutlass": None, "nvrtc": "13.0"}


def test_runtime_compares_with_this_process(tmp_path, monkeypatch):
    other = Environment(None, "src-other", {})
    monkeypatch.setattr(tuned_table, "current_environment", lambda: other)
    with pytest.warns(RuntimeWarning, match="sources_hash: expected 'src-other'"):
        rt = Runtime(_table(tmp_path), sm=90)
    assert rt.dispatcher.entries == [] and rt.table_error is None


def test_current_environment_never_raises():
    env = tuned_table.current_environment()
    assert env.sources_hash and env.gpu_name is None  # no GPU on the CPU machines


# ---------------------------------------------------------------------------------------------
# the typed entry and the one ranking


def _entry(median_us, num_layers, **changes):
    d = {"sm": 90, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 4,
         "mask": "full", "window": None, "dtype": "bfloat16", "layout": "paged", "page_size": 16,
         "batch": 2, "ctx_len": 64, "impl": "cupy", "params": {"tile_n": 32},
         "median_us": median_us, "num_layers": num_layers}
    d.update(changes)
    return d


def test_entry_is_typed_and_frozen():
    e = Entry.parse(_entry(50.0, 5))
    assert e.per_layer_us == 10.0 and e["per_layer_us"] == 10.0 and e["batch"] == 2
    assert e.rank == (False, 10.0) and e.key == (90, 4, 2, 64, 4, "full", None, "bfloat16", "paged", 16, 2, 64)
    with pytest.raises(Exception):
        e.batch = 3
    with pytest.raises(TypeError):
        e.winner.params["tile_n"] = 64


def test_entries_rank_by_per_layer_time():
    # a 5-layer step of 50 us (10 us a layer) beats a 2-layer step of 40 us (20 us a layer),
    # with or without a stored per_layer_us
    five, two = _entry(50.0, 5, params={"tile_n": 32}), _entry(40.0, 2, params={"tile_n": 64})
    for entries in ([five, two], [two, five]):
        pick = Dispatcher(entries).pick(_problem(), 90)
        assert pick.params["tile_n"] == 32
    rows = [dict(geometry=G.with_(num_layers=5), page=16, batch=2, ctx=64, params={"tile_n": 32},
                 median_us=50.0),
            dict(geometry=G.with_(num_layers=2), page=16, batch=2, ctx=64, params={"tile_n": 64},
                 median_us=40.0)]
    assert tuned_table.rank_key("measured", 10.0) < tuned_table.rank_key("predicted", 1.0)
    ranked = tuned_table.select_entries(
        [dict(r, sm=90, row_order=i) for i, r in enumerate(_rows_of(rows))])
    assert ranked[0]["params"] == {"tile_n": 32} and ranked[0]["per_layer_us"] == 10.0


def test_a_tuned_set_must_beat_the_default_by_more_than_the_tie_margin():
    """Within TIE_MARGIN of the default (per layer) the default wins: two runs of one sweep then
    pick the same set where candidates differ by noise; a larger lead still wins."""
    from profile_fakes import MAIN

    problem = Problem(MAIN, "paged", 64, 8, 2048)
    default = registry.get("cupy").default_params(problem)
    tuned = dict(default, tile_n=32, stages=4)
    layers = MAIN.num_layers

    def winner(tuned_us_per_layer):
        rows = _rows_of([dict(params=default, median_us=10.0 * layers),
                         dict(params=tuned, median_us=tuned_us_per_layer * layers)])
        ranked = tuned_table.group_rows([dict(r, sm=90, row_order=i) for i, r in enumerate(rows)])
        (only,) = ranked.values()
        return only[0]["params"]

    assert tuned_table.is_default(dict(_rows_of([dict(params=default)])[0], params=default))
    assert winner(10.0 * (1 - tuned_table.TIE_MARGIN / 2)) == default  # half the margin: noise
    assert winner(10.0 * (1 - 2 * tuned_table.TIE_MARGIN)) == tuned  # twice it: a real lead
    assert winner(10.5) == default  # slower anyway


def _rows_of(specs) -> list[dict]:
    from profile_fakes import row

    out = []
    for spec in specs:
        r = row("env", **spec)
        r["params"] = json.dumps(r["params"])
        out.append(r)
    return out


def test_stored_per_layer_us_must_agree():
    with pytest.raises(tuned_table.EntryError, match="per_layer_us 3.0 is not median_us / num_layers"):
        Entry.parse(_entry(50.0, 5, per_layer_us=3.0))


# ---------------------------------------------------------------------------------------------
# discovery of the defaults


def test_shipped_profiles_are_found_per_sm(monkeypatch):
    for var in shipped.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    folder = shipped.shipped_dir()
    assert folder is not None and (folder / "sm90.json").is_file()
    assert shipped.find_default(90) == folder / "sm90.json"
    assert shipped.find_default(90, ("db",)) == folder / "sm90.db"
    assert shipped.find_default(75) is None and shipped.find_default(None) is None


def test_shipped_sm90_table_is_the_export_of_its_database_for_todays_sources():
    """profiles/sm90.json is `tuner export` of profiles/sm90.db (same keys, same winners), and its
    entries were measured on today's kernel sources: after any edit under kernels/cuda the
    runtime would treat every entry as a miss, so the profile must be brought to the new
    sources (`tuner rekey`, then scripts/sm90_profile.sh for what changed) before such an edit
    lands."""
    from drafter_attn.kernels import nvrtc

    folder = shipped.shipped_dir()
    shipped_table = json.loads((folder / "sm90.json").read_text())
    # as profiles/README.md exports it (`--current-sources`): rows `tuner rekey` left stale and
    # that were measured again stay in the database for the record, but are no candidates
    fresh = export.export_table(folder / "sm90.db", [90], resolve_commits=False,
                                sources_hash=nvrtc.sources_digest())
    d = export.diff_tables(shipped_table, fresh, threshold=0.0)
    assert d["common"] == len(shipped_table["entries"]) > 0
    assert (d["flips"], d["slowdowns"], d["speedups"], d["only_a"], d["only_b"]) == ([],) * 5
    hashes = {e["provenance"]["sources_hash"] for e in shipped_table["entries"]}
    assert hashes == {nvrtc.sources_digest()}, (
        "the kernel sources changed since profiles/sm90.json was measured: `tuner rekey --db "
        "profiles/sm90.db` (after committing the edit) carries the unchanged rows, "
        "scripts/sm90_profile.sh measures the rest; then export (profiles/README.md)")


def test_shipped_sustained_table_is_the_sustained_export_of_its_database():
    """profiles/sm90-sustained.json is `tuner export --regime sustained` of profiles/sm90.db:
    the keys measured under a sustained load decided on those rows, every other key as the
    burst table has it."""
    from drafter_attn.kernels import nvrtc

    folder = shipped.shipped_dir()
    path = folder / "sm90-sustained.json"
    if not path.is_file():
        pytest.skip("no sustained table shipped")
    table = json.loads(path.read_text())
    assert table["source"]["regime"] == "sustained"
    fresh = export.export_table(folder / "sm90.db", [90], resolve_commits=False,
                                sources_hash=nvrtc.sources_digest(), regime="sustained")
    d = export.diff_tables(table, fresh, threshold=0.0)
    assert (d["flips"], d["slowdowns"], d["speedups"], d["only_a"], d["only_b"]) == ([],) * 5
    burst = {tuple(e[f] for f in (*tuned_table.SHAPE_FIELDS, "batch", "ctx_len")): e
             for e in json.loads((folder / "sm90.json").read_text())["entries"]}
    regimes = {e["provenance"]["regime"] for e in table["entries"]}
    assert regimes == {"burst", "sustained"}
    for e in table["entries"]:
        if e["provenance"]["regime"] == "burst":  # not measured sustained: the burst winner
            assert e["params"] == burst[tuple(e[f] for f in (*tuned_table.SHAPE_FIELDS, "batch", "ctx_len"))]["params"]


def test_environment_overrides_the_shipped_profiles(monkeypatch, tmp_path):
    monkeypatch.delenv("DRAFTER_TUNED_TABLE", raising=False)
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "mine.db"))
    assert shipped.find_default(90) == tmp_path / "mine.db"  # the database beats a shipped table
    monkeypatch.setenv("DRAFTER_TUNED_TABLE", str(tmp_path / "mine.json"))
    assert shipped.find_default(None) == tmp_path / "mine.json"
    assert shipped.find_default(90, ("db",)) == tmp_path / "mine.db"


def test_runtime_opens_the_shipped_table_of_its_sm(monkeypatch):
    for var in shipped.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its entries may be stale against today's sources
        rt = Runtime(sm=90)
    assert rt.dispatcher.source.endswith("sm90.json") and rt.table_error is None
    assert Runtime(sm=75).dispatcher.source == "default heuristic"


def test_tuner_export_defaults_to_the_shipped_database(monkeypatch, tmp_path, capsys):
    for var in shipped.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "t.json"
    assert main(["export", "--sm", "90", "--no-commits", "--out", str(out)]) == 0
    assert str(shipped.shipped_dir() / "sm90.db") in capsys.readouterr().err
    assert json.loads(out.read_text())["entries"]


# ---------------------------------------------------------------------------------------------
# issue 17: no content of a table or database raises from the runtime or the table commands


def _bad_params_db(tmp_path):
    path = _db(tmp_path, [dict(geometry=G, page=16, batch=2, ctx=64, params=FAST, median_us=10.0),
                          dict(geometry=G, page=16, batch=4, ctx=64, params=FAST, median_us=10.0)])
    c = sqlite3.connect(path)
    c.execute("UPDATE results SET params = '{not json' WHERE batch = 2")
    c.commit()
    c.close()
    return path


def test_db_row_with_non_json_params(tmp_path, here, gen, capsys):
    path = _bad_params_db(tmp_path)
    with pytest.warns(RuntimeWarning, match="1 rows left out.*params is not JSON"):
        rt = Runtime(path, sm=90)
    assert [e.batch for e in rt.dispatcher.entries] == [4]
    with pytest.warns(RuntimeWarning, match="params is not JSON"):
        assert main(["export", "--db", str(path), "--no-commits", "--out", str(tmp_path / "o.json")]) == 0
    with pytest.warns(RuntimeWarning, match="params is not JSON"):
        assert main(["auto", "--preset", "qwen3-8b-dflash-b16", "--page", "16", "--max-ctx", "4096",
                     "--concurrency", "4", "--table", str(path), "--sm", "90"]) == 0


def test_db_row_with_a_text_problem_column(tmp_path, here):
    # SQLite keeps text in an INTEGER column; sorting it against numbers must not raise
    path = _bad_params_db(tmp_path)
    c = sqlite3.connect(path)
    c.execute("UPDATE results SET params = '{}', batch = 'eight' WHERE batch = 2")
    c.commit()
    c.close()
    with pytest.warns(RuntimeWarning, match="1 rows left out.*batch must be int, got 'eight'"):
        assert [e["batch"] for e in export.export_table(path, resolve_commits=False)["entries"]] == [4]


def test_duplicate_entries_with_a_string_per_layer_us(tmp_path, here):
    doc = make_table([_entry(50.0, 5, per_layer_us="10"), _entry(40.0, 5, per_layer_us="8")])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match="2 entries left out.*per_layer_us must be a positive number"):
        rt = Runtime(path, sm=90)
    assert rt.dispatcher.pick(_problem(), 90).tier == "default"


def test_deeply_nested_json(tmp_path, here, capsys):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.warns(RuntimeWarning, match="tuned table unusable.*nested too deeply"):
        rt = Runtime(path, sm=90)
    assert isinstance(rt.table_error, TableError)
    assert main(["diff", str(path), str(path)]) == 2
    assert "nested too deeply" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# issue 17 item 5: parameter values are typed and ranged before anything compiles


@pytest.mark.parametrize("spec, message", [
    ("cupy:min_ctas=1 -DEVIL=1", "min_ctas='1 -DEVIL=1' must be int"),
    ("cupy:stages=0", "stages=0 must be from 2 to 12"),
    ("cupy:tile_n=48", "tile_n=48 must be a power of two"),
    ("cupy:num_splits=-1", "num_splits=-1 must be from 0"),
    ("cupy:q_smem=2", "q_smem=2 must be true or false"),
    ("cupy:tile_n=none", "tile_n=None must not be None"),
    ("cutlass:wgmma=yes", "wgmma='yes' must be true or false"),
])
def test_bad_parameter_values_are_refused(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        registry.from_spec(spec)


def test_no_string_reaches_a_compiled_backend():
    cupy = registry.get("cupy")
    with pytest.raises(ValueError, match="min_ctas"):
        cupy.with_params(min_ctas="1 -DEVIL=1")  # the tuner binds this way
    assert dict(cupy.with_params(q_smem=1, wgmma=None).overrides) == {"q_smem": True, "wgmma": None}


@pytest.mark.parametrize("params", [{"min_ctas": "1 -DEVIL=1"}, {"stages": 0}, {"tile_n": 1.5}])
def test_a_bad_parameter_in_a_table_is_a_miss(tmp_path, here, params):
    path = _table(tmp_path, lambda e: e["params"].update(params))
    with pytest.warns(RuntimeWarning, match="1 entries left out.*cupy: backend 'cupy': parameter"):
        rt = Runtime(path, sm=90)
    assert rt.dispatcher.pick(_problem(), 90).tier == "default"


# ---------------------------------------------------------------------------------------------
# issue 17 items 10 and 11


def test_an_unhashable_mask_gets_the_contract_error(gen):
    rt = Runtime(sm=None)
    q, kb, vb = random_block(G, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(G, [5, 40], 16, "cpu", gen)
    with pytest.raises(ValueError, match="mask"):
        rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens, mask=["full"])


def test_cpu_tensors_with_a_gpu_table_run_the_reference(tmp_path, here, gen):
    rt = Runtime(_table(tmp_path), sm=90)  # the table's pick is cupy, which needs CUDA tensors
    q, kb, vb = random_block(G, 2, "cpu", gen)
    k_pages, v_pages, table, lens = random_paged_context(G, [5, 40], 16, "cpu", gen, extra_pages=2)
    with pytest.warns(RuntimeWarning, match="tuned pick cupy.*not used.*on cpu"):
        out = rt.paged_attention(q, kb, vb, k_pages, v_pages, table, lens)
    (pick,) = rt.picks.values()
    assert pick.impl == "reference" and "cupy" in pick.reason
    from drafter_attn.kernels import reference

    torch.testing.assert_close(out, reference.paged_attention(q, kb, vb, k_pages, v_pages, table, lens))


# ---------------------------------------------------------------------------------------------
# The one host-sync count (issue 14): tuned entries, tuner show, bench decode and tuner.syncs


def test_sync_count_is_the_most_any_detector_saw(tmp_path):
    from drafter_attn.bench import decode
    from drafter_attn.tuner import syncs
    from drafter_attn.tuner.cli import load_results

    count = tuned_table.sync_count
    assert count({"syncs_debug": 0, "syncs_profiler": 3, "syncs_nsys": None}) == 3
    assert count({"syncs_debug": None}) is None and count({}) is None
    assert count({"syncs_debug": float("nan"), "syncs_profiler": 2.0}) == 2  # pandas NULLs
    assert decode.sync_count is count  # bench decode's rows
    report = syncs.SyncReport(debug_syncs=1, profiler=syncs.RuntimeSyncs(4, 9.0, 0))
    assert report.syncs == count(report.as_row()) == 4
    path = _db(tmp_path, [dict(geometry=G, page=16, batch=2, ctx=64, params=FAST, median_us=10.0,
                               syncs_debug=1, syncs_profiler=2),
                          dict(geometry=G, page=16, batch=4, ctx=64, params=FAST, median_us=10.0)])
    shown = load_results(path)  # tuner show
    assert shown["syncs"].tolist()[0] == 2 and shown["syncs"].isna().tolist() == [False, True]
    entries, _ = tuned_table.load_table(path)  # the runtime's entries
    assert [(e["batch"], e["syncs"]) for e in entries] == [(2, 2), (4, None)]


def test_steps_storing_other_rows_never_compete_for_a_key(tmp_path):
    """`bench decode --accepted` steps store fewer rows than the block, and `bench prefill`'s
    context steps a whole chunk: recorded in the same database, they are not the decode step a
    key stands for, so a faster one of them neither wins the key nor lists as an alternative."""
    full = dict(geometry=G, page=16, batch=2, ctx=64, params=FAST, median_us=10.0)
    rows = [full, dict(full, params={"tile_n": 32, "stages": 4}, median_us=12.0),
            dict(full, params={"tile_n": 32, "stages": 2}, median_us=6.0, accepted=4.4),
            dict(full, params={"tile_n": 32, "stages": 5}, median_us=50.0, accepted=512.0),
            dict(full, params={"tile_n": 32, "stages": 6}, median_us=11.0, accepted=float(G.block_size))]
    (entry,) = export.export_table(_db(tmp_path, rows), resolve_commits=False)["entries"]
    assert entry["params"] == FAST and entry["candidates"] == 3
    assert [a["params"] for a in entry["alternatives"]] == [{"tile_n": 32, "stages": 6},
                                                            {"tile_n": 32, "stages": 4}]
