"""The profile database (CPU): round trip, concurrent writers, schema checks, merge, default path."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drafter_attn.tuner import db as dbmod
from drafter_attn.tuner.db import DatabaseError, ProfileDB, SchemaError, merge

REPO = Path(__file__).resolve().parent.parent
FP = dict(gpu_name="NVIDIA H200", sm=90, sm_count=132, driver="580.95.05", cuda="13.0",
          torch="2.11.0", cupy="14.2.0", cutlass="4.2.0", nvrtc="13.0", sources_hash="abc")


def _row(env_id: str, i: int = 0, **extra) -> dict:
    problem = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, mask="full",
                   window=None, num_layers=5, dtype="bfloat16", layout="paged", page_size=64,
                   batch=8, ctx_len=2048 + i)
    params = {"tile_n": 64, "stages": 3}
    row = dict(env_id=env_id, candidate_key=dbmod.candidate_key(problem, None, "cupy", params),
               problem_key=problem, preset="qwen3-8b-dflash-b16", **problem, impl="cupy",
               params=params, status="ok", median_us=100.0 + i, p10_us=95.0, p90_us=110.0,
               count=200, bytes_moved=123456789, bandwidth_gbs=3000.0, roofline_fraction=0.7,
               syncs_debug=0, syncs_profiler=0, sync_host_us=0.0, graph_capturable=True,
               kv_bytes=1 << 30, workspace_bytes=1 << 20, peak_bytes=2 << 30)
    row.update(extra)
    return row


def test_round_trip(tmp_path):
    path = tmp_path / "p.db"
    with ProfileDB(path) as db:
        env = db.add_environment(FP)
        assert db.add_environment(FP) == env  # idempotent
        rid = db.add_result(_row(env))
        db.add_result(_row(env, 1, status="failed_runtime", reason="illegal address", median_us=None))
    with ProfileDB(path, create=False) as db:
        assert db.schema_version() == dbmod.SCHEMA_VERSION
        assert db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        rows = db.query("SELECT * FROM results ORDER BY id")
        assert rows[0]["id"] == rid and rows[0]["median_us"] == 100.0 and rows[0]["graph_capturable"] == 1
        assert rows[0]["params"] == '{"stages":3,"tile_n":64}' and rows[0]["provenance"] == "measured"
        assert rows[1]["status"] == "failed_runtime" and rows[1]["median_us"] is None
        envs = db.query("SELECT * FROM environments")
        assert envs[0]["gpu_name"] == "NVIDIA H200" and envs[0]["sm"] == 90 and envs[0]["env_id"] == env
        assert db.done_candidates(env) == {rows[0]["candidate_key"], rows[1]["candidate_key"]}
        assert db.done_candidates(env, ["ok"]) == {rows[0]["candidate_key"]}
        assert db.done_candidates("other-env") == set()
        assert db.done_candidates(None) == db.done_candidates(env)  # any environment
        assert db.done_candidates(None, ["failed_runtime"]) == {rows[1]["candidate_key"]}
        # only rows of the given kernel sources (FP's "abc"; a row of other sources is stale)
        assert db.done_candidates(None, sources_hash="abc") == db.done_candidates(env)
        assert db.done_candidates(None, sources_hash="older") == set()


def test_bad_rows_are_refused(tmp_path):
    with ProfileDB(tmp_path / "p.db") as db:
        env = db.add_environment(FP)
        with pytest.raises(ValueError, match="unknown result columns.*median_ms"):
            db.add_result({**_row(env), "median_ms": 1.0})
        with pytest.raises(ValueError, match="status='broken'"):
            db.add_result(_row(env, status="broken"))
        with pytest.raises(DatabaseError, match="p.db: storing a result failed: CHECK constraint"):
            db.add_result(_row(env, provenance="guessed"))  # provenance is checked by the schema
        with pytest.raises(DatabaseError, match="FOREIGN KEY"):  # the environment must exist
            db.add_result(_row("no-such-env"))


WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from drafter_attn.tuner.db import ProfileDB
    sys.path.insert(0, {tests!r})
    from test_tuner_db import FP, _row
    path, who, n, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    while time.time() < start:
        time.sleep(0.001)
    db = ProfileDB(path)  # every writer may be the one creating the file
    env = db.add_environment(FP)
    for i in range(n):
        db.add_result(_row(env, who * 1000 + i, worker=str(who)))
    db.close()
""")


def test_concurrent_writers_lose_no_row(tmp_path):
    import time

    path, n = tmp_path / "shared.db", 60
    script = WRITER.format(repo=str(REPO), tests=str(REPO / "tests"))
    start = time.time() + 1.5  # all four open the (missing) file at once
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(w), str(n), str(start)],
                              stderr=subprocess.PIPE, text=True) for w in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with ProfileDB(path, create=False) as db:
        assert db.count("results") == 4 * n
        assert db.count("environments") == 1
        per_worker = db.query("SELECT worker, COUNT(*) AS n FROM results GROUP BY worker")
        assert {r["worker"]: r["n"] for r in per_worker} == {str(w): n for w in range(4)}


def test_foreign_schema_version_is_refused(tmp_path):
    path = tmp_path / "old.db"
    ProfileDB(path).close()
    c = sqlite3.connect(path)
    c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    c.commit()
    c.close()
    with pytest.raises(SchemaError, match=r"schema version 99.*reads version 5"):
        ProfileDB(path)


def test_foreign_files_are_refused(tmp_path):
    other = tmp_path / "other.db"
    c = sqlite3.connect(other)
    c.execute("CREATE TABLE t (x)")
    c.commit()
    c.close()
    with pytest.raises(SchemaError, match="not a drafter-attn profile database"):
        ProfileDB(other)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(SchemaError, match="not a readable SQLite"):
        ProfileDB(junk)
    with pytest.raises(SchemaError, match="no profile database at"):
        ProfileDB(tmp_path / "missing.db", create=False)


def test_compile_profiles(tmp_path):
    rows = [dict(sm=90, arch="sm_90a", backend="cupy", variant="cupy:page64:bf16:x", kernel=k,
                 registers=r, spill_bytes=0, stack_bytes=0, smem_static=0, smem_dynamic=1024,
                 compile_s=1.5, cached=False, cubin="/tmp/x.cubin")
            for k, r in (("drafter_attention", 168), ("drafter_store", 32))]
    with ProfileDB(tmp_path / "p.db") as db:
        assert db.add_compile_rows(rows, "hash1", "13.0") == 2
        db.add_compile_rows(rows, "hash1", "13.0")  # same kernels again: replaced, not doubled
        db.add_compile_rows(rows[:1], "hash2", "13.0")  # new sources: a new row
        assert db.count("compile_profiles") == 3


def test_merge(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "out.db"
    for path, n in ((a, 3), (b, 2)):
        with ProfileDB(path) as db:
            env = db.add_environment({**FP, "gpu_name": path.stem})
            for i in range(n):
                db.add_result(_row(env, i))
    assert merge(out, a, b) == {"environments": 2, "results": 5, "compile_profiles": 0}
    assert merge(out, a, b)["results"] == 0  # merging again adds nothing
    with ProfileDB(out, create=False) as db:
        assert db.count("results") == 5
    with pytest.raises(SchemaError, match="into itself"):
        merge(a, a)
    bad = tmp_path / "bad.db"
    ProfileDB(bad).close()
    c = sqlite3.connect(bad)
    c.execute("UPDATE meta SET value = '0' WHERE key = 'schema_version'")
    c.commit()
    c.close()
    with pytest.raises(SchemaError, match="schema version 0"):
        merge(out, bad)


def test_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "env.db"))
    assert dbmod.default_path() == tmp_path / "env.db"
    monkeypatch.delenv("DRAFTER_DB")
    assert dbmod.default_path() == REPO / "profiles" / "profile.db"  # a source checkout
    monkeypatch.setattr(dbmod, "_repo_profiles_dir", lambda: None)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert dbmod.default_path() == tmp_path / "data" / "drafter-attn" / "profile.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert dbmod.default_path() == Path.home() / ".local" / "share" / "drafter-attn" / "profile.db"


def test_candidate_key_depends_on_every_part():
    base = ({"batch": 1}, None, "cupy", {"tile_n": 64})
    key = dbmod.candidate_key(*base)
    assert key == dbmod.candidate_key({"batch": 1}, None, "cupy", {"tile_n": 64})
    assert key != dbmod.candidate_key({"batch": 2}, None, "cupy", {"tile_n": 64})
    assert key != dbmod.candidate_key({"batch": 1}, 8, "cupy", {"tile_n": 64})
    assert key != dbmod.candidate_key({"batch": 1}, None, "other", {"tile_n": 64})
    assert key != dbmod.candidate_key({"batch": 1}, None, "cupy", {"tile_n": 32})
    # a sustained timing is another candidate; a burst's key is the one older tuners wrote
    assert key == dbmod.candidate_key(*base, 0.0) == dbmod.candidate_key(*base, None)
    assert key != dbmod.candidate_key(*base, 0.75) != dbmod.candidate_key(*base, 0.5)
    # under a co-runner's load another again; the step's own load is the key sustained rows had
    own = dbmod.candidate_key(*base, 0.75)
    assert own == dbmod.candidate_key(*base, 0.75, "self") == dbmod.candidate_key(*base, 0.75, None)
    assert dbmod.candidate_key(*base, 0.75, "gemm") not in (own, key)


def test_environment_id_and_software_versions():
    from drafter_attn.kernels import nvrtc
    from drafter_attn.tuner import env

    assert env.env_id(FP) == env.env_id({**FP, "hostname": "elsewhere"})  # only FIELDS count
    assert env.env_id(FP) != env.env_id({**FP, "driver": "580.0"})
    assert env.env_id(FP) != env.env_id({**FP, "sources_hash": "def"})
    sw = env.software_versions()
    assert sw["sources_hash"] == nvrtc.sources_digest() and sw["torch"]
    assert set(sw) | {"gpu_name", "sm", "sm_count", "driver"} == set(env.FIELDS)


def _older_database(path, version: int, added_since: tuple[str, ...]) -> str:
    """A database of schema `version` at `path`, one ok row in it (candidate "c", 12.5 us): a
    current one with the columns added since taken out. Returns its environment's id."""
    with ProfileDB(path) as db:
        eid = db.add_environment(dict(gpu_name="H200", sm=90))
        db.add_result(dict(env_id=eid, candidate_key="c", problem_key={}, impl="cupy", params={},
                           status="ok", median_us=12.5))
    c = sqlite3.connect(path)
    for name in added_since:
        c.execute(f"ALTER TABLE results DROP COLUMN {name}")
    c.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
    c.commit()
    c.close()
    return eid


def test_version_2_database_gains_the_clock_column(tmp_path):
    """A database written before timings recorded their SM clock opens as version 3: its rows
    kept, their clock NULL (not measured), and a new row's clock stored."""
    path = tmp_path / "v2.db"
    eid = _older_database(path, 2, ("sm_clock_mhz", "sustain_s", "sustain_load"))
    with ProfileDB(path, readonly=True) as db:  # read as it is
        assert db.schema_version() == 2
    with ProfileDB(path) as db:
        assert db.schema_version() == dbmod.SCHEMA_VERSION == 5
        db.add_result(dict(env_id=eid, candidate_key="d", problem_key={}, impl="cupy", params={},
                           status="ok", median_us=13.0, sm_clock_mhz=1590.0))
        rows = db.query("SELECT candidate_key, sm_clock_mhz FROM results ORDER BY id")
    assert rows == [{"candidate_key": "c", "sm_clock_mhz": None}, {"candidate_key": "d", "sm_clock_mhz": 1590.0}]


def test_version_3_database_gains_the_regime_column(tmp_path):
    """A database written before the sustained regime existed opens as version 4: its rows read
    as bursts (sustain_s NULL), the runtime reads it before and after, and a sustained row is
    stored with its load."""
    from drafter_attn.kernels import tuned_table

    path = tmp_path / "v3.db"
    eid = _older_database(path, 3, ("sustain_s", "sustain_load"))
    rows = tuned_table.read_db_rows(path)  # the runtime reads version 3 as it is
    assert len(rows) == 1 and rows[0]["sustain_s"] is None and tuned_table.row_regime(rows[0]) == "burst"
    with ProfileDB(path) as db:
        assert db.schema_version() == dbmod.SCHEMA_VERSION
        db.add_result(dict(env_id=eid, candidate_key="d", problem_key={}, impl="cupy", params={},
                           status="ok", median_us=13.0, sustain_s=0.75))
    regimes = [tuned_table.row_regime(r) for r in tuned_table.read_db_rows(path)]
    assert regimes == ["burst", "sustained"]


def test_version_4_database_gains_the_load_column(tmp_path):
    """A database written before co-loaded timings existed opens as version 5: its sustained
    rows read as the step's own load, the runtime reads it before and after, and a row under a
    co-runner's load is stored with it."""
    from drafter_attn.kernels import tuned_table

    path = tmp_path / "v4.db"
    eid = _older_database(path, 4, ("sustain_load",))
    with sqlite3.connect(path) as c:
        c.execute("UPDATE results SET sustain_s = 0.75")
    (row,) = tuned_table.read_db_rows(path)  # version 4 as it is
    assert row["sustain_load"] is None and tuned_table.row_load(row) == "self"
    with ProfileDB(path) as db:
        assert db.schema_version() == 5
        db.add_result(dict(env_id=eid, candidate_key="d", problem_key={}, impl="cupy", params={},
                           status="ok", median_us=13.0, sustain_s=0.75, sustain_load="gemm"))
    loads = [tuned_table.row_load(r) for r in tuned_table.read_db_rows(path)]
    assert loads == ["self", "gemm"]


def test_version_1_database_is_migrated_keeping_its_rows(tmp_path):
    """A database written before the read-floor columns existed opens, keeps its rows, and
    reads NULL (not measured) in the new columns; merging it into a new database works too."""
    path = tmp_path / "v1.db"
    eid = _older_database(path, 1, ("read_floor_us", "read_bandwidth_gbs", "read_roofline_fraction",
                                    "graph_fixed_us", "sm_clock_mhz", "sustain_s", "sustain_load"))
    assert merge(tmp_path / "new.db", path)["results"] == 1
    with ProfileDB(path) as db:
        assert db.schema_version() == dbmod.SCHEMA_VERSION
        (row,) = db.query("SELECT id, median_us, read_floor_us FROM results")
        assert row == {"id": 1, "median_us": 12.5, "read_floor_us": None}
        # the rebuilt table takes the status version 2 added, and keeps its indexes
        db.add_result(dict(env_id=eid, candidate_key="d", problem_key={}, impl="cupy", params={},
                           status="failed_node_lost", reason="node left"))
        names = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
        assert {"results_candidate", "results_problem"} <= names


def test_a_version_2_file_without_the_node_lost_status_is_repaired(tmp_path):
    """Version 2 gained failed_node_lost in its CHECK constraint after some files were written
    (results/two-h200 holds two), and the migrations after it only add columns: opening such a
    file, at whatever version it now says, rebuilds the table so that the status can be stored,
    keeping its rows."""
    path = tmp_path / "early-v2.db"
    eid = _older_database(path, 2, ("sm_clock_mhz", "sustain_s", "sustain_load"))
    c = sqlite3.connect(path)
    old = [s for s in dbmod.STATUSES if s != "failed_node_lost"]
    (sql,) = c.execute("SELECT sql FROM sqlite_master WHERE name = 'results'").fetchone()
    narrow = sql.replace(", 'failed_node_lost'", "")
    assert narrow != sql and all(f"'{s}'" in narrow for s in old)
    c.execute("PRAGMA writable_schema = ON")
    c.execute("UPDATE sqlite_master SET sql = ? WHERE name = 'results'", (narrow,))
    c.commit()
    c.close()
    with sqlite3.connect(path) as c:  # the narrow constraint is in force
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            c.execute("INSERT INTO results (env_id, candidate_key, problem_key, impl, params, status, "
                      "uid, created_at) VALUES ('e', 'x', '{}', 'cupy', '{}', 'failed_node_lost', 'u', 't')")
    with ProfileDB(path) as db:
        db.add_result(dict(env_id=eid, candidate_key="d", problem_key={}, impl="cupy", params={},
                           status="failed_node_lost", reason="node left"))
        rows = db.query("SELECT candidate_key, status FROM results ORDER BY id")
    assert rows == [{"candidate_key": "c", "status": "ok"}, {"candidate_key": "d", "status": "failed_node_lost"}]
    with ProfileDB(path) as db:  # repaired once: the next open leaves it alone
        assert db._takes_every_status()


@pytest.fixture
def own_and_shipped(tmp_path, monkeypatch):
    """(your database's path, the shipped profiles' folder holding sm90.db), with no GPU and no
    $DRAFTER_DB: what a reading command chooses between."""
    from drafter_attn.kernels import shipped
    from profile_fakes import H200, build_db

    own_dir, ship = tmp_path / "profiles", tmp_path / "pkg"
    own_dir.mkdir(), ship.mkdir()
    monkeypatch.delenv("DRAFTER_DB", raising=False)
    monkeypatch.setattr(dbmod, "_repo_profiles_dir", lambda: own_dir)
    monkeypatch.setattr(shipped, "shipped_dir", lambda: ship)
    monkeypatch.setattr(shipped, "gpu_sm", lambda: None)
    build_db(ship / "sm90.db", {"h": (H200, [dict(median_us=10.0)])})
    return own_dir / "profile.db", ship


def test_reading_commands_read_your_database_where_it_has_rows_else_the_shipped_one(own_and_shipped, tmp_path, monkeypatch):
    """`tuner show`, `tuner export` and `bench report` without --db: this user's database (where
    sweeps write) when it holds ok rows of the SM asked, else the profile shipped for the SM; on
    a fresh clone (no database of one's own) the shipped one, which `bench report --sm 90` did
    not read before."""
    from profile_fakes import B200, build_db

    own, ship = own_and_shipped
    assert dbmod.reading_path(90) == ship / "sm90.db"
    assert dbmod.reading_path() == ship / "sm90.db"  # no SM asked, no GPU: the only one shipped
    assert dbmod.reading_path(100) == own  # nothing for sm100 anywhere: the default, named
    build_db(own, {"b": (B200, [dict(median_us=3.0)])})
    assert dbmod.reading_path(100) == own and dbmod.reading_path() == own
    assert dbmod.reading_path(90) == ship / "sm90.db"  # yours holds no sm90 rows
    build_db(ship / "sm100.db", {"b": (B200, [dict(median_us=3.0)])})
    assert dbmod.reading_path(100) == own  # yours first
    monkeypatch.setenv("DRAFTER_DB", str(tmp_path / "elsewhere.db"))
    assert dbmod.reading_path(90) == tmp_path / "elsewhere.db"


def test_show_compile_reads_your_compile_profiles_and_rekey_never_the_shipped_database(own_and_shipped, monkeypatch):
    """`tuner show --compile` reads your database where it holds compile profiles of the SM (it
    holds no result rows after a `tuner compile`); `tuner rekey` without --db rewrites your own
    database, never the shipped one (on a machine without a GPU it took the only one shipped)."""
    from drafter_attn.tuner import cli, rekey

    own, ship = own_and_shipped
    with ProfileDB(own):
        pass
    with sqlite3.connect(own) as c:
        c.execute("INSERT INTO compile_profiles (sm, arch, backend, variant, kernel, sources_hash, nvrtc, "
                  "created_at) VALUES (90, 'sm_90a', 'cupy', 'v', 'k', 'h', '13.0', 'now')")
    assert dbmod.reading_path(90, "compile_profiles") == own
    assert dbmod.reading_path(90) == ship / "sm90.db"  # no result rows of yours
    seen = []
    monkeypatch.setattr(rekey, "rekey_stale", lambda path, **kw: seen.append(path) or [])
    monkeypatch.setattr(rekey, "summary_text", lambda *a, **kw: "")
    cli.main(["rekey", "--dry-run"])
    assert seen == [own]
