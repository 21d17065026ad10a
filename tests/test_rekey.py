"""tuner rekey: rows move to today's sources hash only where every kernel they ran compiles to
the same machine code from the old kernels package and from today's (no GPU; NVRTC and cuobjdump)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from drafter_attn.kernels import nvrtc, static_profile
from drafter_attn.tuner import rekey
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.export import digest_of, export_table
from tests.profile_fakes import H200, build_db

pytestmark = pytest.mark.skipif(static_profile.cuobjdump_path() is None, reason="no cuobjdump")

KERNELS = Path(nvrtc.__file__).resolve().parent
# the row's resolved params (as a sweep records them): the SM 90 default of the main preset
PARAMS = dict(min_ctas=1, num_splits=0, overlap=2, q_smem=False, skip_compute=False,
              skip_loads=False, stages=3, tile_n=64, wgmma=None)


def _old_package(tmp_path: Path, edit=None) -> tuple[Path, str]:
    """A copy of today's kernels package as tmp/old/drafter_attn/kernels, its CUDA sources
    passed through `edit` ({name: text} -> None, in place); returns (root, sources hash)."""
    root = tmp_path / "old"
    dest = root / "drafter_attn" / "kernels"
    shutil.copytree(KERNELS, dest, ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        texts = {p.name: p.read_text() for p in (dest / "cuda").glob("*.cu*")}
        edit(texts)
        for name, text in texts.items():
            (dest / "cuda" / name).write_text(text)
    files = {p.name: p.read_bytes() for p in (dest / "cuda").glob("*.cu*")}
    return root, digest_of(files)


def _db(tmp_path: Path, sources_hash: str, rows=None) -> Path:
    path = tmp_path / "p.db"
    rows = rows or [dict(params=PARAMS, median_us=90.0),
                    dict(params=PARAMS, batch=32, median_us=290.0),
                    dict(impl="reference", params={}, median_us=900.0)]
    build_db(path, {"h200": (dict(H200, sources_hash=sources_hash), rows)})
    return path


def _hashes(path: Path) -> dict:
    with ProfileDB(path, create=False) as db:
        return {r["id"]: r["sources_hash"] for r in db.query(
            "SELECT r.id, e.sources_hash FROM results r JOIN environments e USING (env_id)")}


def test_a_comment_edit_moves_every_row_to_todays_hash(tmp_path):
    def comment(texts):
        texts["drafter_attention.cu"] = "// an old comment\n" + texts["drafter_attention.cu"]

    root, old_hash = _old_package(tmp_path, comment)
    today = nvrtc.sources_digest()
    assert old_hash != today
    path = _db(tmp_path, old_hash)
    dry = rekey.rekey(path, root, old_hash, jobs=2, dry_run=True)
    assert (dry["moved"], dry["stale"]) == (3, 0)
    assert set(_hashes(path).values()) == {old_hash}  # a dry run changes nothing
    s = rekey.rekey(path, root, old_hash, jobs=2, source="test")
    assert (s["moved"], s["stale"]) == (3, 0)
    assert set(_hashes(path).values()) == {today}
    with ProfileDB(path, create=False) as db:
        record = [json.loads(r["value"]) for r in db.query("SELECT * FROM meta WHERE key LIKE 'rekey %'")]
    assert [(r["from_hash"], r["to_hash"], r["moved"]) for r in record] == [(old_hash, today, 3)]
    # the export now carries today's hash, and a second run finds nothing left to move
    entries = export_table(path, [90], resolve_commits=False, sources_hash=today)["entries"]
    assert entries and {e["provenance"]["sources_hash"] for e in entries} == {today}
    assert rekey.rekey(path, root, old_hash, jobs=2)["moved"] == 0


def test_a_code_edit_leaves_the_rows_that_ran_it_stale(tmp_path):
    """An old store kernel that differs (every paged row ran it): those rows stay on the old
    hash, the torch reference (no kernels of this package) moves, and an export limited to
    today's sources leaves the stale rows out."""
    def store(texts):
        old = "const int n = max(0, min(min(num_new[b], T), capacity - P));"
        assert old in texts["combine_store.cuh"]
        texts["combine_store.cuh"] = texts["combine_store.cuh"].replace(
            old, "const int n = max(0, min(num_new[b], capacity - P));")

    root, old_hash = _old_package(tmp_path, store)
    path = _db(tmp_path, old_hash)
    s = rekey.rekey(path, root, old_hash, jobs=2)
    assert (s["moved"], s["stale"]) == (1, 2)
    assert any("cupy: kernels changed" in k for k in s["stale_kinds"])
    hashes = _hashes(path)
    assert sorted(hashes.values()).count(old_hash) == 2
    today = nvrtc.sources_digest()
    entries = export_table(path, [90], resolve_commits=False, sources_hash=today)["entries"]
    assert {e["impl"] for e in entries} == {"reference"}
    assert "stay stale" in rekey.summary_text(s)


def test_a_candidate_measured_twice_moves_with_both_rows(tmp_path):
    """`tuner refine --with-winners` measures a candidate again on the same sources: both rows
    move (the export then takes the newer), and complete_params fills in both; a row measured
    on today's sources before the rekey still stands against the old ones."""
    root, old_hash = _old_package(tmp_path, lambda t: t.update(
        {"drafter_attention.cu": "// a comment\n" + t["drafter_attention.cu"]}))
    twice = [dict(params=PARAMS, median_us=90.0), dict(params=PARAMS, median_us=80.0)]
    path = _db(tmp_path, old_hash, twice)
    s = rekey.rekey(path, root, old_hash, jobs=2)
    assert (s["moved"], s["stale"]) == (2, 0)
    assert set(_hashes(path).values()) == {nvrtc.sources_digest()}
    c = rekey.complete_params(path)
    assert c["completed"] == 2
    with ProfileDB(path, create=False) as db:
        keys = {r["candidate_key"] for r in db.query("SELECT candidate_key FROM results")}
    assert len(keys) == 1
    entries = export_table(path, [90], resolve_commits=False,
                           sources_hash=nvrtc.sources_digest())["entries"]
    assert [e["median_us"] for e in entries] == [80.0]


def test_complete_params_completes_a_row_whose_candidate_has_a_complete_row(tmp_path):
    """A candidate measured again after the first completion (or moved in by a later rekey)
    with the parameter missing: completed all the same, so the key's rows are one candidate and
    the export takes the newest."""
    from drafter_attn.kernels import registry
    from drafter_attn.kernels.presets import PRESETS
    from drafter_attn.kernels.spec import Problem

    problem = Problem(PRESETS["qwen3-8b-dflash-b16"], "paged", 64, 8, 2048)
    full = registry.resolve_params(registry.get("cupy"), problem, 90, PARAMS)
    path = _db(tmp_path, nvrtc.sources_digest(), [dict(params=full, median_us=90.0),
                                                  dict(params=PARAMS, median_us=80.0)])
    assert rekey.complete_params(path)["completed"] == 1
    with ProfileDB(path, create=False) as db:
        rows = db.query("SELECT params, candidate_key FROM results")
    assert len({r["candidate_key"] for r in rows}) == 1
    assert all(json.loads(r["params"]) == full for r in rows)
    entries = export_table(path, [90], resolve_commits=False,
                           sources_hash=nvrtc.sources_digest())["entries"]
    assert [e["median_us"] for e in entries] == [80.0]


def test_rows_of_a_row_that_no_longer_compiles_stay_stale(tmp_path):
    """A parameter today's kernels refuse (tile_n 48) is an error, never 'unchanged'."""
    root, old_hash = _old_package(tmp_path, lambda t: t.update(
        {"drafter_attention.cu": "\n" + t["drafter_attention.cu"]}))
    path = _db(tmp_path, old_hash, [dict(params=dict(PARAMS, tile_n=48), median_us=50.0)])
    s = rekey.rekey(path, root, old_hash, jobs=2)
    assert (s["moved"], s["stale"]) == (0, 1)
    assert all("error" in k for k in s["stale_kinds"])


def test_the_same_sources_need_no_rekey(tmp_path):
    path = _db(tmp_path, nvrtc.sources_digest())
    s = rekey.rekey_from_commit(path, "HEAD") if _head_has_todays_sources() else \
        rekey.rekey(path, tmp_path, nvrtc.sources_digest())
    assert s["moved"] == 0 and "nothing to do" in s["note"]


def test_an_unknown_commit_is_a_clear_error(tmp_path):
    path = _db(tmp_path, "old")
    with pytest.raises(RuntimeError, match="cannot read kernels/cuda at 'no-such-commit'"):
        rekey.rekey_from_commit(path, "no-such-commit")


def _head_has_todays_sources() -> bool:
    from drafter_attn.tuner.export import sources_at

    try:
        return digest_of(sources_at("HEAD")) == nvrtc.sources_digest()
    except Exception:  # noqa: BLE001 - no git (an installed package)
        return False


def test_without_from_each_stale_hash_finds_its_commit(tmp_path, monkeypatch):
    """`tuner rekey` without --from: every sources hash of the database other than today's is
    looked up in git; one git knows is re-keyed from its commit, one it does not is reported."""
    path = tmp_path / "p.db"
    rows = [dict(params=PARAMS, median_us=90.0)]
    build_db(path, {"known": (dict(H200, sources_hash="hash-known"), rows * 2),
                    "unknown": (dict(H200, sources_hash="hash-unknown", driver="x"), rows),
                    "today": (dict(H200, sources_hash=nvrtc.sources_digest(), driver="y"), rows)})
    assert rekey.stale_sources(path) == {"hash-known": 2, "hash-unknown": 1}
    monkeypatch.setattr(rekey, "commit_for_sources",
                        lambda h, repo: "abc123" if h == "hash-known" else None)
    calls = []
    monkeypatch.setattr(rekey, "rekey_from_commit",
                        lambda db, commit, repo, **kw: calls.append((commit, kw)) or {"note": "done"})
    out = rekey.rekey_stale(path, dry_run=True)
    assert calls == [("abc123", {"dry_run": True})]
    notes = [rekey.summary_text(s) for s in out]
    assert "done" in notes
    assert any("no commit of this repository has them; give --from" in n for n in notes)


def test_cli_without_from_on_todays_sources(tmp_path, capsys):
    from drafter_attn.tuner.cli import main

    path = _db(tmp_path, nvrtc.sources_digest())
    assert main(["rekey", "--db", str(path), "--dry-run"]) == 0
    assert "is on today's kernel sources" in capsys.readouterr().out


def test_a_dry_run_leaves_the_file_as_it_was(tmp_path):
    """`tuner rekey --dry-run` opens nothing for writing: no migration of an older file, no
    switch of its journal to WAL (the shipped profiles/sm90.db is a rollback-journal file); its
    bytes are what they were."""
    import hashlib
    import sqlite3

    from drafter_attn.tuner.cli import main

    for version in (5, 4):
        (tmp_path / f"v{version}").mkdir()
        path = _db(tmp_path / f"v{version}", nvrtc.sources_digest())
        c = sqlite3.connect(path)
        if version < 5:
            c.execute("ALTER TABLE results DROP COLUMN sustain_load")
            c.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
            c.commit()
        c.execute("PRAGMA journal_mode = DELETE")  # as shipped: one file, no -wal beside it
        c.close()
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        assert main(["rekey", "--db", str(path), "--dry-run"]) == 0
        assert hashlib.sha256(path.read_bytes()).hexdigest() == before, version
        with sqlite3.connect(path) as c:
            assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
            assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(version)


def test_complete_params_fills_a_parameter_added_since(tmp_path):
    """Rows measured before a backend gained a parameter (cupy's `tma`) get it, with the value
    today's package resolves from the row's own parameters (the kernel rekey compared), and the
    candidate key today's sweep gives that candidate; a second run changes nothing."""
    from drafter_attn.kernels import registry
    from drafter_attn.kernels.presets import PRESETS
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner.db import candidate_key

    path = _db(tmp_path, nvrtc.sources_digest())  # rows without `tma`, on today's sources
    problem = Problem(PRESETS["qwen3-8b-dflash-b16"], "paged", 64, 32, 2048)
    full = registry.resolve_params(registry.get("cupy"), problem, 90, {"tma": False, "lean": False})
    added = {name: 2 for name in set(full) - set(PARAMS)}  # every field newer than the rows
    assert "tma" in added
    dry = rekey.complete_params(path, dry_run=True)
    assert dry["completed"] == 2 and dry["added"] == added
    s = rekey.complete_params(path)
    assert s["completed"] == 2 and s["added"] == added
    with ProfileDB(path, create=False) as db:
        rows = db.query("SELECT * FROM results WHERE impl = 'cupy' ORDER BY batch")
    # `overlap` named, so the defaults' TMA and lean rules do not apply: tma=False, lean=False,
    # the cp.async kernel these rows ran; which is today's {tma = false, lean = false} at B=32
    assert [json.loads(r["params"])["tma"] for r in rows] == [False, False]
    big = rows[1]
    assert json.loads(big["params"]) == full
    assert big["candidate_key"] == candidate_key(json.loads(big["problem_key"]), big["accepted"],
                                                 "cupy", full)
    assert rekey.complete_params(path)["completed"] == 0
