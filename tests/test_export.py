"""Tuned tables (tuner export / diff) and predicted rows (tuner predict), CPU only."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from drafter_attn.kernels import dispatch, nvrtc
from drafter_attn.kernels.dispatch import Dispatcher
from drafter_attn.kernels.spec import Problem
from profile_fakes import B200, H200, MAIN, build_db
from drafter_attn.tuner import export, predict
from drafter_attn.tuner.cli import main
from drafter_attn.tuner.db import ProfileDB

REPO = Path(__file__).resolve().parent.parent
FAST = {"tile_n": 64, "stages": 3}
SLOW = {"tile_n": 32, "stages": 2}


def _db(tmp_path, name="p.db", fast_us=10.0):
    """sm90 (H200) page 64 + arena at B {1, 8} x ctx {1024, 4096}, FAST against SLOW; sm100 (B200)
    one row. bytes_moved is set so predictions can be made."""
    rows = []
    for layout in ("paged", "arena"):
        for b in (1, 8):
            for c in (1024, 4096):
                rows.append(dict(layout=layout, batch=b, ctx=c, params=FAST, median_us=fast_us * b,
                                 bytes_moved=b * c * 20480, attention_median_us=fast_us * b * 0.8,
                                 store_median_us=1.0, syncs_debug=0, kv_bytes=b * c * 20480))
                rows.append(dict(layout=layout, batch=b, ctx=c, params=SLOW, median_us=12.0 * b,
                                 bytes_moved=b * c * 20480))
    path = tmp_path / name
    build_db(path, {"h": (H200, rows), "b": (B200, [dict(params=FAST, median_us=3.0)])})
    return path


def test_export_round_trip(tmp_path, capsys):
    db = _db(tmp_path)
    out = tmp_path / "profiles" / "sm90.json"
    assert main(["export", "--db", str(db), "--sm", "90", "--out", str(out)]) == 0
    assert "8 tuned entries (measured; sm 90)" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["format"] == dispatch.TABLE_FORMAT and doc["version"] == dispatch.TABLE_VERSION
    assert doc["rules"] == dispatch.RULES and doc["source"]["sms"] == [90]
    assert {e["sm"] for e in doc["entries"]} == {90}
    e = doc["entries"][0]
    assert e["impl"] == "cupy" and e["params"] == FAST and e["candidates"] == 2
    assert e["alternatives"][0]["params"] == SLOW
    assert e["bucket"] == {"batch": dispatch.bucket(e["batch"]), "ctx_len": dispatch.bucket(e["ctx_len"])}
    prov = e["provenance"]
    assert prov["kind"] == "measured" and prov["sweep"] == "sweep-1" and prov["gpu"] == "NVIDIA H200"
    assert prov["date"] and "commit" in prov and prov["sources_hash"] == "src-a"
    assert e["syncs"] == 0 and e["per_layer_us"] == pytest.approx(e["median_us"] / MAIN.num_layers)

    # the runtime reads the table and the database alike
    from_json, from_db = Dispatcher.load(out), Dispatcher.load(db)
    for layout, page in (("paged", 64), ("arena", None)):
        for b, c in ((1, 1024), (8, 4096), (3, 3000), (64, 65536)):
            p = Problem(MAIN.with_(num_layers=1), layout, page, b, c)
            a, z = from_json.pick(p, 90), from_db.pick(p, 90)
            assert (a.impl, dict(a.params), a.tier) == (z.impl, dict(z.params), z.tier)
            assert a.tier in ("exact", "bucketed")
    # sm100 was not exported
    assert from_json.pick(Problem(MAIN, "paged", 64, 8, 2048), 100).tier == "default"


def test_a_one_layer_row_does_not_compete_with_whole_steps(tmp_path):
    """`bench.attention_table` records one-layer steps into the database it is given: a step's
    fixed cost then lands on one layer, so such a row of the key's winner (14 us a layer) must
    neither replace its five-layer row (10) nor rank it behind the runner-up (11)."""
    one = MAIN.with_(num_layers=1)
    db = tmp_path / "p.db"
    build_db(db, {"h": (H200, [dict(params=FAST, median_us=50.0), dict(params=SLOW, median_us=55.0),
                               dict(geometry=one, params=FAST, median_us=14.0)])})
    (entry,) = export.export_table(db, resolve_commits=False)["entries"]
    assert (entry["params"], entry["per_layer_us"], entry["num_layers"]) == (FAST, 10.0, 5)
    assert [a["params"] for a in entry["alternatives"]] == [SLOW] and entry["candidates"] == 2
    # a key measured only one layer at a time is still decided (on those rows)
    build_db(db, {"h": (H200, [dict(geometry=one, batch=2, params=SLOW, median_us=3.0)])})
    assert len(export.export_table(db, resolve_commits=False)["entries"]) == 2


def test_each_gpu_decides_its_own_entries(tmp_path):
    """An H100 and an H200 are both sm90: the H200's faster row must not take the H100's key
    (the runtime would drop it there as measured elsewhere, with H100 rows at hand). With the
    two declared one class, their rows compete."""
    h100 = dict(H200, gpu_name="NVIDIA H100 80GB HBM3")
    db = tmp_path / "p.db"
    build_db(db, {"h100": (h100, [dict(params=FAST, median_us=60.0), dict(params=SLOW, median_us=50.0)]),
                  "h200": (H200, [dict(params=FAST, median_us=40.0)])})
    doc = export.export_table(db, resolve_commits=False)
    by_gpu = {e["provenance"]["gpu"]: e for e in doc["entries"]}
    assert by_gpu.keys() == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"} and doc["source"]["gpus"] == sorted(by_gpu)
    assert by_gpu["NVIDIA H100 80GB HBM3"]["params"] == SLOW and by_gpu["NVIDIA H200"]["params"] == FAST
    for gpu, want in (("NVIDIA H100 80GB HBM3", SLOW), ("NVIDIA H200", FAST)):
        env = dispatch.Environment(gpu_name=gpu, sources_hash="src-a", versions={"nvrtc": "13.0"})
        assert Dispatcher.load(export.write_table(doc, tmp_path / "t.json"), env=env).entries[0].winner.params == want
    classed = export.export_table(db, resolve_commits=False, gpu_classes={"hopper": [h100["gpu_name"], "NVIDIA H200"]})
    (entry,) = classed["entries"]
    assert entry["params"] == FAST and entry["median_us"] == 40.0 and entry["candidates"] == 2


def test_diff_compares_each_gpus_entry_with_the_same_gpus(tmp_path):
    """Two exports of the same H100 and H200 rows, stored in opposite orders, hold the same
    entries: no flip (keyed by the problem alone, the diff compared one GPU's entry with the
    other's, whichever came last)."""
    h100 = dict(H200, gpu_name="NVIDIA H100 80GB HBM3")
    rows = {"h100": (h100, [dict(params=SLOW, median_us=50.0)]), "h200": (H200, [dict(params=FAST, median_us=40.0)])}
    build_db(tmp_path / "a.db", rows)
    build_db(tmp_path / "b.db", dict(reversed(rows.items())))
    a, b = (export.export_table(tmp_path / f"{n}.db", resolve_commits=False) for n in "ab")
    d = export.diff_tables(a, b)
    assert d["common"] == 2 and not d["flips"] and not d["slowdowns"] and not d["only_a"]
    b["entries"] = [e for e in b["entries"] if e["provenance"]["gpu"] == "NVIDIA H200"]
    assert [k.endswith("on NVIDIA H100 80GB HBM3") for k in export.diff_tables(a, b)["only_a"]] == [True]
    # exported as one class, each table's entry of the key (won by either GPU) is the class's
    classes = {"hopper": [h100["gpu_name"], "NVIDIA H200"]}
    build_db(tmp_path / "c.db", {"h100": (h100, [dict(params=SLOW, median_us=30.0)]), "h200": rows["h200"]})
    a, c = (export.export_table(tmp_path / f"{n}.db", resolve_commits=False, gpu_classes=classes) for n in "ac")
    d = export.diff_tables(a, c)
    assert d["common"] == 1 and len(d["flips"]) == 1 and not d["only_a"] and not d["only_b"]


def test_export_takes_todays_sources_where_the_database_has_them(tmp_path, monkeypatch):
    """Rows of an older kernel-sources hash, left stale by a kernel edit, never win a key the
    database also measured on this checkout's sources (the runtime here would drop such an
    entry); `--all-sources` lets every row compete, and a database with no row of today's
    sources is exported whole, as before."""
    monkeypatch.setattr(nvrtc, "sources_digest", lambda: "src-today")
    db = tmp_path / "p.db"
    build_db(db, {"old": (H200, [dict(params=FAST, median_us=40.0)]),
                  "new": (dict(H200, sources_hash="src-today"), [dict(params=SLOW, median_us=50.0)])})
    (entry,) = export.export_table(db, resolve_commits=False)["entries"]
    assert entry["params"] == SLOW and entry["provenance"]["sources_hash"] == "src-today"
    out = tmp_path / "all.json"
    assert main(["export", "--db", str(db), "--out", str(out), "--all-sources", "--no-commits"]) == 0
    (entry,) = json.loads(out.read_text())["entries"]
    assert entry["params"] == FAST
    monkeypatch.setattr(nvrtc, "sources_digest", lambda: "src-elsewhere")
    (entry,) = export.export_table(db, resolve_commits=False)["entries"]
    assert entry["params"] == FAST and entry["candidates"] == 2


def test_export_errors(tmp_path, capsys):
    db = _db(tmp_path)
    assert main(["export", "--db", str(db), "--sm", "80", "--out", str(tmp_path / "x.json")]) == 2
    assert "no ok rows for sm 80" in capsys.readouterr().err
    assert main(["export", "--db", str(tmp_path / "missing.db"), "--out", str(tmp_path / "x.json")]) == 2
    assert "no profile database" in capsys.readouterr().err


def _export(tmp_path, name, **kw) -> Path:
    out = tmp_path / f"{name}.json"
    export.write_table(export.export_table(_db(tmp_path, f"{name}.db", **kw), [90], resolve_commits=False), out)
    return out


def test_diff_and_gate(tmp_path, capsys):
    a = _export(tmp_path, "a", fast_us=10.0)
    same = _export(tmp_path, "same", fast_us=10.0)
    assert main(["diff", str(a), str(same), "--gate"]) == 0
    assert "0 winner flips, 0 slowdowns" in capsys.readouterr().out

    # fast_us 11.0: FAST still wins (12.0 is SLOW) but 10% slower -> slowdowns beyond 5%
    slower = _export(tmp_path, "slower", fast_us=11.0)
    d = export.diff_tables(json.loads(a.read_text()), json.loads(slower.read_text()), 0.05)
    assert not d["flips"] and len(d["slowdowns"]) == 8 and d["slowdowns"][0]["change"] == pytest.approx(0.1)
    assert export.diff_tables(json.loads(a.read_text()), json.loads(slower.read_text()), 0.2)["slowdowns"] == []
    # fast_us 13.0: SLOW wins now -> flips (and the winner is 20% slower)
    flipped = _export(tmp_path, "flipped", fast_us=13.0)
    d = export.diff_tables(json.loads(a.read_text()), json.loads(flipped.read_text()), 0.05)
    assert len(d["flips"]) == 8 and d["flips"][0]["a"].startswith("cupy[") and "tile_n=32" in d["flips"][0]["b"]
    assert main(["diff", str(a), str(flipped)]) == 0  # reports only
    out = capsys.readouterr().out
    assert "winner flips:" in out and "slowdowns:" in out
    assert main(["diff", str(a), str(flipped), "--gate"]) == 1
    assert "gate failed: 8 winner flips" in capsys.readouterr().err
    assert main(["diff", str(a), str(flipped), "--format", "json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["flips"]) == 8

    # entries only on one side
    doc = json.loads(a.read_text())
    doc["entries"] = doc["entries"][1:]
    fewer = tmp_path / "fewer.json"
    fewer.write_text(json.dumps(doc))
    d = export.diff_tables(json.loads(a.read_text()), doc)
    assert len(d["only_a"]) == 1 and d["only_b"] == []


def test_diff_refuses_foreign_tables(tmp_path, capsys):
    a = _export(tmp_path, "a")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": dispatch.TABLE_FORMAT, "version": 7}))
    assert main(["diff", str(a), str(bad)]) == 2
    assert "version 7" in capsys.readouterr().err
    bad.write_text("{not json")
    assert main(["diff", str(a), str(bad)]) == 2
    assert "not a JSON tuned table" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# provenance: the commit whose kernel sources were measured


def test_digest_matches_the_kernels_hash():
    files = {p.name: p.read_bytes() for p in nvrtc.CUDA_SRC_DIR.iterdir() if p.is_file()}
    assert export.digest_of(files) == nvrtc.sources_digest()


def test_commit_for_sources(tmp_path):
    repo = tmp_path / "repo"
    (repo / "kernels" / "cuda").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,  # noqa: E731
                                    text=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    src = repo / "kernels" / "cuda"
    (src / "a.cu").write_text("one")
    (src / "b.cuh").write_text("header")
    (src / "notes.txt").write_text("not hashed")
    git("add", ".")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    (repo / "README").write_text("unrelated")
    git("add", ".")
    git("commit", "-qm", "docs")  # same sources: still the first commit
    (src / "a.cu").write_text("two")
    git("commit", "-qam", "second")
    second = git("rev-parse", "HEAD")
    h1 = export.digest_of({"a.cu": b"one", "b.cuh": b"header"})
    h2 = export.digest_of({"a.cu": b"two", "b.cuh": b"header"})
    assert export.commit_for_sources(h1, repo) == first
    assert export.commit_for_sources(h2, repo) == second
    assert export.commit_for_sources("0" * 64, repo) is None and export.commit_for_sources(None, repo) is None
    assert export.head_commit(repo) == second
    (src / "a.cu").write_text("three")
    assert export.head_commit(repo) == second + "+dirty"


# ---------------------------------------------------------------------------------------------
# predicted rows


def test_datasheets():
    gpus = predict.load_datasheets()
    assert all(g.source and g.bandwidth_tbs > 0 for g in gpus)
    by = {g.name: g for g in gpus}
    assert by["H100 SXM"].bandwidth_tbs == 3.35 and by["H200"].bandwidth_tbs == 4.8
    assert by["B200"].bandwidth_tbs == 8.0 and by["GB300"].bandwidth_tbs == 8.0
    assert by["RTX PRO 6000 Blackwell"].bandwidth_tbs == pytest.approx(1.792)
    assert predict.gpu_for_device(gpus, "NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert predict.gpu_for_device(gpus, "NVIDIA GB200").name == "GB200"  # longest match, not B200
    assert predict.gpu_for_device(gpus, "NVIDIA RTX PRO 6000 Blackwell Server Edition").sm == 120
    assert predict.gpu_for_device(gpus, "Some Other GPU") is None
    assert predict.target_gpu(gpus, 100).name == "B200" and predict.target_gpu(gpus, 100, "gb200").name == "GB200"
    with pytest.raises(predict.DatasheetError, match="sm100, not sm90"):
        predict.target_gpu(gpus, 90, "B200")
    with pytest.raises(predict.DatasheetError, match="no default GPU for sm75"):
        predict.target_gpu(gpus, 75)


def test_datasheet_errors_name_the_key(tmp_path):
    bad = tmp_path / "d.toml"
    bad.write_text('[[gpu]]\nname = "X"\nsm = 90\nbandwidth_tbs = -1\nsource = "s"\n')
    with pytest.raises(predict.DatasheetError, match=r"gpu\[0\]\.bandwidth_tbs"):
        predict.load_datasheets(bad)
    bad.write_text('[[gpu]]\nname = "X"\nsm = 90\nbandwidth_tbs = 1\nsource = "s"\nspeed = 3\n')
    with pytest.raises(predict.DatasheetError, match=r"unknown key.*speed"):
        predict.load_datasheets(bad)


def test_nearest_sm():
    assert predict.nearest_sm([90, 100], 103) == 100  # same family first
    assert predict.nearest_sm([90, 100], 120) == 100  # else numerically nearest
    assert predict.nearest_sm([90], 100) == 90 and predict.nearest_sm([], 100) is None


def test_predict_round_trip(tmp_path, capsys):
    db = _db(tmp_path)
    assert main(["predict", "--db", str(db), "--sm", "103", "--from", "90"]) == 0
    err = capsys.readouterr().err
    assert "16 predicted rows written from sm90" in err and "GB300" in err
    with ProfileDB(db, create=False) as d:
        rows = d.query("SELECT r.*, e.gpu_name, e.sm FROM results r JOIN environments e USING (env_id) "
                       "WHERE r.provenance = 'predicted' ORDER BY r.id")
        src = d.query("SELECT * FROM results WHERE provenance = 'measured' ORDER BY id")
    assert len(rows) == 16 and {r["sm"] for r in rows} == {103}
    assert rows[0]["gpu_name"] == "GB300 (predicted from NVIDIA H200)"
    # H200 4.8 TB/s -> GB300 8 TB/s: every time x 4.8 / 8
    assert rows[0]["median_us"] == pytest.approx(src[0]["median_us"] * 4.8 / 8.0)
    assert rows[0]["attention_median_us"] == pytest.approx(src[0]["attention_median_us"] * 0.6)
    assert rows[0]["candidate_key"] == src[0]["candidate_key"] and rows[0]["params"] == src[0]["params"]
    assert rows[0]["syncs_debug"] is None and rows[0]["workspace_bytes"] is None  # not modelled
    assert "roofline projection" in rows[0]["reason"] and "4.8 TB/s" in rows[0]["reason"]
    # again: nothing new
    assert main(["predict", "--db", str(db), "--sm", "103", "--from", "90"]) == 0
    assert "0 predicted rows written" in capsys.readouterr().err

    # export leaves predicted rows out unless asked, and marks them
    out = tmp_path / "t.json"
    assert main(["export", "--db", str(db), "--sm", "103", "--out", str(out)]) == 2
    capsys.readouterr()
    assert main(["export", "--db", str(db), "--sm", "103", "--out", str(out), "--include-predicted"]) == 0
    doc = json.loads(out.read_text())
    assert {e["provenance"]["kind"] for e in doc["entries"]} == {"predicted"}
    # the runtime ignores them unless asked
    p = Problem(MAIN.with_(num_layers=1), "paged", 64, 8, 4096)
    assert Dispatcher.load(out).pick(p, 103).tier == "default"  # the table holds sm103 predictions only
    pick = Dispatcher.load(out, include_predicted=True).pick(p, 103)
    assert pick.tier == "exact" and "predicted" in pick.reason


def test_predict_projects_a_candidates_newest_timing(tmp_path, capsys):
    """A candidate measured twice is projected from its latest row, as export and report read
    it (the oldest was: a stale timing projected onto the target)."""
    db = tmp_path / "p.db"
    timings = [dict(params=FAST, median_us=us, bytes_moved=10**8) for us in (100.0, 80.0)]
    build_db(db, {"h": (H200, timings)})
    assert main(["predict", "--db", str(db), "--sm", "103", "--from", "90"]) == 0
    assert ("1 predicted rows written from sm90; 0 predicted before; 1 older timings of a candidate "
            "projected from its newest;") in capsys.readouterr().err
    with ProfileDB(db, create=False) as d:
        (got,) = d.query("SELECT median_us, reason FROM results WHERE provenance = 'predicted'")
    assert got["median_us"] == pytest.approx(80.0 * 4.8 / 8.0) and "row 2" in got["reason"]


def test_predict_default_source_and_errors(tmp_path, capsys):
    db = _db(tmp_path)
    # --from left out: sm100 (B200) is the nearest measured SM to sm103
    assert main(["predict", "--db", str(db), "--sm", "103"]) == 0
    # (its one row has no bytes_moved, so it cannot be projected)
    assert "0 predicted rows written from sm100; 0 predicted before; 1 without bytes_moved" \
        in capsys.readouterr().err
    assert main(["predict", "--db", str(db), "--sm", "90", "--from", "80"]) == 2
    assert "no measured ok rows of sm80" in capsys.readouterr().err
    assert main(["predict", "--list"]) == 0
    assert "H200" in capsys.readouterr().out


def test_diff_a_parameter_added_at_its_default_is_no_flip(tmp_path):
    """A table exported after a parameter was added to the backend names it in every winner;
    the older table does not. At the parameter's default that is the same kernel (what `tuner
    rekey` proves), so no flip; at another value it is one."""
    a = json.loads(_export(tmp_path, "a", fast_us=10.0).read_text())

    def with_param(name, value):
        doc = json.loads(json.dumps(a))
        for e in doc["entries"]:
            e["params"][name] = value
        return doc

    assert not any("q_step" in e["params"] for e in a["entries"])
    assert export.diff_tables(a, with_param("q_step", False))["flips"] == []
    assert export.diff_tables(with_param("q_step", False), a)["flips"] == []
    assert len(export.diff_tables(a, with_param("q_step", True))["flips"]) == len(a["entries"])
