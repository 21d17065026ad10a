"""Hostile input, CPU only: bad arguments, broken files and bad options across the contract, the
profile database, sweep specs and both CLIs. Each must get a clear message naming the culprit, exit
2 when a command cannot run as asked, and leave every file a read-only command touched as it was."""

from __future__ import annotations

import json
import math
import re
import sqlite3
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from drafter_attn.bench import cli as bench_cli
from drafter_attn.bench import decode, gpu
from drafter_attn.kernels import reference
from drafter_attn.tuner import cli as tuner_cli
from drafter_attn.tuner.cli_checks import write_whole
from drafter_attn.tuner.db import DatabaseError, ProfileDB

from test_contract import CALLS
from test_tuner_db import FP, _row

# ---------------------------------------------------------------------------------------------
# helpers


def _run(main, capsys, argv) -> tuple[int, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        rc = exc.code
    return rc, capsys.readouterr().err


def _snapshot(folder: Path) -> dict:
    """Every file under `folder`: its bytes and modification time."""
    return {p.relative_to(folder): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _assert_untouched(before: dict, after: dict) -> None:
    for name, (data, mtime) in before.items():
        assert name in after, f"{name} was removed"
        assert after[name] == (data, mtime), f"{name} was changed"
    # A reader of a WAL database may leave SQLite's own side files; nothing else may appear.
    new = [n for n in after if n not in before and not re.search(r"\.db-(wal|shm)$", str(n))]
    assert not new, f"files were created: {new}"


def _valid_db(path: Path, **extra) -> Path:
    with ProfileDB(path) as db:
        env = db.add_environment(FP)
        db.add_result(_row(env, 0, **extra))
        db.add_result(_row(env, 1, layout="arena", page_size=None, **extra))
    return path  # closed: checkpointed, no -wal left


def _sql(path: Path, *statements: str) -> None:
    c = sqlite3.connect(path)
    for s in statements:
        c.execute(s)
    c.commit()
    c.close()


# ---------------------------------------------------------------------------------------------
# Broken database files against every command that reads one


def _missing(p):
    return p


def _empty(p):
    p.write_bytes(b"")
    return p


def _directory(p):
    p.mkdir()
    return p


def _text(p):
    p.write_text("these are not the rows you are looking for\n")
    return p


def _random(p):
    p.write_bytes(bytes(range(256)) * 64)
    return p


def _truncated(p):
    data = _valid_db(p.with_name("whole.db")).read_bytes()
    p.write_bytes(data[:100])
    p.with_name("whole.db").unlink()
    return p


def _foreign(p):
    _sql(p, "CREATE TABLE t (x)", "INSERT INTO t VALUES (1)")
    return p


def _newer(p):
    _valid_db(p)
    _sql(p, "UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    return p


def _other_schema(p):
    _valid_db(p)
    _sql(p, "UPDATE meta SET value = 'someone-else' WHERE key = 'schema'")
    return p


def _tables_dropped(p):
    _valid_db(p)
    _sql(p, "PRAGMA foreign_keys = OFF", "DROP TABLE results", "DROP TABLE compile_profiles",
         "DROP TABLE environments")
    return p


def _corrupt_pages(p):
    _valid_db(p)
    data = bytearray(p.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = b"\xff" * (len(data) - page)  # every page after the first (the schema) is garbage
    p.write_bytes(bytes(data))
    return p


BROKEN = [_missing, _empty, _directory, _text, _random, _truncated, _foreign, _newer, _other_schema,
          _tables_dropped, _corrupt_pages]

# Commands that read a database; {db} and {tmp} are filled in. `main` and the files each must not create.
READERS = {
    "tuner show": (tuner_cli.main, ["show", "--db", "{db}"], []),
    "tuner show --compile": (tuner_cli.main, ["show", "--compile", "--db", "{db}"], []),
    "tuner export": (tuner_cli.main, ["export", "--db", "{db}", "--out", "{tmp}/out/t.json", "--no-commits"],
                     ["out"]),
    "tuner predict": (tuner_cli.main, ["predict", "--db", "{db}", "--sm", "100", "--from", "90"], []),
    "tuner merge": (tuner_cli.main, ["merge", "{tmp}/dst.db", "{db}"], ["dst.db"]),
    "bench report": (bench_cli.main, ["report", "--db", "{db}", "--out", "{tmp}/report"], ["report"]),
}


@pytest.mark.parametrize("command", READERS)
@pytest.mark.parametrize("broken", BROKEN, ids=[f.__name__.strip("_") for f in BROKEN])
def test_broken_database_files(command, broken, tmp_path, capsys):
    main, argv, never = READERS[command]
    db = broken(tmp_path / "p.db")
    before = _snapshot(tmp_path)
    rc, err = _run(main, capsys, [a.format(db=db, tmp=tmp_path) for a in argv])
    assert rc == 2, err
    assert str(db) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    _assert_untouched(before, _snapshot(tmp_path))
    for name in never:
        assert not (tmp_path / name).exists()


BROKEN_TABLES = {
    "empty": b"",
    "binary": b"\xff\xfe\x00\x01",
    "not JSON": b"{entries: [}",
    "a list": b"[1, 2]",
    "another format": b'{"format": "someone-else", "version": 1}',
    "a newer version": b'{"format": "drafter-attn-tuned-table", "version": 99}',
}
TABLE_READERS = {
    "tuner diff": ["diff", "{good}", "{table}"],
    "tuner auto": ["auto", "--preset", "qwen3-8b-dflash-b16", "--page", "64", "--max-ctx", "8192",
                   "--concurrency", "4", "--table", "{table}"],
}


@pytest.mark.parametrize("command", TABLE_READERS)
@pytest.mark.parametrize("kind", BROKEN_TABLES)
def test_broken_tuned_tables(command, kind, tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(Path(__file__).parent.parent.joinpath("profiles", "sm90.json").read_text())
    table = tmp_path / "t.json"
    table.write_bytes(BROKEN_TABLES[kind])
    before = _snapshot(tmp_path)
    rc, err = _run(tuner_cli.main, capsys, [a.format(good=good, table=table) for a in TABLE_READERS[command]])
    assert rc == 2 and str(table) in err and len(err.strip().splitlines()) == 1, err
    _assert_untouched(before, _snapshot(tmp_path))


@pytest.mark.parametrize("command", ["tuner show", "tuner show --compile", "tuner export", "bench report"])
def test_read_only_commands_leave_a_valid_database_as_it_was(command, tmp_path, capsys):
    main, argv, _ = READERS[command]
    db = _valid_db(tmp_path / "p.db")
    _sql(db, "INSERT INTO compile_profiles (sm, arch, backend, variant, kernel, sources_hash, nvrtc, "
             "created_at) VALUES (90, 'sm_90a', 'cupy', 'v', 'k', 'h', '13.0', 'now')")
    data, mtime = db.read_bytes(), db.stat().st_mtime_ns
    rc, err = _run(main, capsys, [a.format(db=db, tmp=tmp_path) for a in argv])
    assert rc == 0, err
    assert (db.read_bytes(), db.stat().st_mtime_ns) == (data, mtime)


def test_a_wal_database_whose_folder_takes_no_side_files_is_read(tmp_path, capsys):
    """Package data on read-only storage: SQLite cannot create the -wal file; the database is read
    immutable instead of being called unreadable. (A folder named like the side file stands in
    for a read-only folder: root ignores permissions.)"""
    db = _valid_db(tmp_path / "p.db")
    (tmp_path / "p.db-wal").mkdir()
    (tmp_path / "p.db-shm").mkdir()
    before = _snapshot(tmp_path)
    with ProfileDB(db, readonly=True) as opened:
        assert opened.count() == 2
    rc, err = _run(tuner_cli.main, capsys, ["show", "--db", db, "--format", "csv"])
    assert rc == 0, err
    assert _snapshot(tmp_path) == before


def test_a_read_only_open_refuses_a_log_it_cannot_replay(tmp_path, capsys, monkeypatch):
    """A writer killed mid-sweep leaves rows in the -wal file only. Where SQLite cannot open it
    read-only (a read-only mount: stood in for here by a connect that refuses every open but an
    immutable one), the immutable open would read the main file alone: it refuses, naming the
    log, instead of showing the rows before the kill as all there is."""
    import shutil

    from drafter_attn.kernels import tuned_table

    connect = sqlite3.connect

    def read_only_mount(database, *args, **kwargs):
        if "mode=ro" in str(database) and "immutable=1" not in str(database):
            raise sqlite3.OperationalError("unable to open database file")
        return connect(database, *args, **kwargs)

    live = _valid_db(tmp_path / "live.db")
    writer = sqlite3.connect(live)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("UPDATE results SET median_us = median_us + 1")
    writer.commit()  # in the log, not yet in the main file
    copy = tmp_path / "ro"
    copy.mkdir()
    shutil.copy(live, copy / "p.db")
    shutil.copy(f"{live}-wal", copy / "p.db-wal")
    writer.close()
    monkeypatch.setattr(sqlite3, "connect", read_only_mount)
    with pytest.raises(DatabaseError, match="write-ahead log p.db-wal holds writes"):
        ProfileDB(copy / "p.db", readonly=True)
    rc, err = _run(tuner_cli.main, capsys, ["show", "--db", copy / "p.db", "--format", "csv"])
    assert rc == 2 and "p.db-wal holds writes" in err
    with pytest.raises(tuned_table.TableError, match="p.db-wal holds writes"):
        tuned_table.read_db_rows(copy / "p.db")


def test_read_only_open_cannot_write(tmp_path):
    db = _valid_db(tmp_path / "p.db")
    with ProfileDB(db, readonly=True) as opened, pytest.raises(DatabaseError, match=re.escape(str(db))):
        opened.add_environment({**FP, "gpu_name": "other"})


def test_full_disk_mid_sweep_keeps_committed_rows(tmp_path):
    db = tmp_path / "p.db"
    with ProfileDB(db) as opened:
        env = opened.add_environment(FP)
        pages = opened.conn.execute("PRAGMA page_count").fetchone()[0]
        opened.conn.execute(f"PRAGMA max_page_count = {pages + 2}")  # the disk fills up
        stored = 0
        with pytest.raises(DatabaseError, match=re.escape(str(db)) + ".*full"):
            for i in range(1000):
                opened.add_result(_row(env, i, reason="x" * 2000))
                stored += 1
    assert stored > 0
    with ProfileDB(db, readonly=True) as opened:
        assert opened.count() == stored


def test_merge_checks_every_source_before_creating_the_destination(tmp_path, capsys):
    good = _valid_db(tmp_path / "good.db")
    dst = tmp_path / "dst.db"
    rc, err = _run(tuner_cli.main, capsys, ["merge", dst, good, tmp_path / "missing.db"])
    assert rc == 2 and "missing.db" in err and not dst.exists()
    rc, err = _run(tuner_cli.main, capsys, ["merge", dst, good, good])
    assert rc == 2 and "named twice" in err and not dst.exists()
    rc, err = _run(tuner_cli.main, capsys, ["merge", good, good])
    assert rc == 2 and "into itself" in err



def test_merge_reads_a_source_on_read_only_storage_and_never_writes_it(tmp_path, capsys):
    """A WAL source whose folder takes no side files (read-only storage, stood in for as above):
    ATTACH opened it read-write and failed ("unable to open database file"); the merge reads it
    read-only, adds its rows, and leaves the folder as it was."""
    (tmp_path / "ro").mkdir()
    src = _valid_db(tmp_path / "ro" / "p.db")
    (tmp_path / "ro" / "p.db-wal").mkdir()
    (tmp_path / "ro" / "p.db-shm").mkdir()
    before = _snapshot(tmp_path / "ro")
    dst = tmp_path / "dst.db"
    rc, err = _run(tuner_cli.main, capsys, ["merge", dst, src])
    assert rc == 0, err
    with ProfileDB(dst, readonly=True) as merged:
        assert merged.count() == 2
    assert _snapshot(tmp_path / "ro") == before

# ---------------------------------------------------------------------------------------------
# tuner predict: a non-numeric measurement is skipped, nothing half-written


@pytest.mark.parametrize("bad", ["fast", b"\x00", "nan"], ids=["text", "blob", "nan-text"])
def test_predict_skips_rows_without_numbers_and_writes_all_or_nothing(bad, tmp_path, capsys):
    db = tmp_path / "p.db"
    with ProfileDB(db) as opened:
        env = opened.add_environment(FP)
        for i in range(10):
            opened.add_result(_row(env, i))
        opened.add_result(_row(env, 10, median_us=bad))
    argv = ["predict", "--db", db, "--sm", "100", "--from", "90"]
    rc, err = _run(tuner_cli.main, capsys, argv)
    assert rc == 0, err
    assert "10 predicted rows written" in err and "skipped 1 row(s)" in err and "median_us" in err
    rc, err = _run(tuner_cli.main, capsys, argv)  # the rerun: nothing new, still no crash
    assert rc == 0 and "0 predicted rows written" in err and "10 predicted before" in err
    with ProfileDB(db, readonly=True) as opened:
        assert opened.query("SELECT COUNT(*) AS n FROM results WHERE provenance = 'predicted'")[0]["n"] == 10


# ---------------------------------------------------------------------------------------------
# Options of both CLIs: one line, exit 2, before any work


def _binary(tmp):
    (tmp / "prog").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    return tmp / "prog"


def _bad_toml(tmp):
    (tmp / "bad.toml").write_text("[sweep\nname = 1\n")
    return tmp / "bad.toml"


def _a_file(tmp):
    (tmp / "file").write_text("x")
    return tmp / "file"


TUNER_OPTIONS = [
    (["show", "--limit", "-1"], "argument --limit"),
    (["show", "--limit", "0"], "argument --limit"),
    (["show", "--limit", "all"], "argument --limit"),
    (["diff", "a.json", "b.json", "--threshold", "-1", "--gate"], "argument --threshold"),
    (["diff", "a.json", "b.json", "--threshold", "nan"], "argument --threshold"),
    (["diff", "a.json", "b.json", "--threshold", "inf"], "argument --threshold"),
    (["auto", "--preset", "x", "--page", "64", "--max-ctx", "8", "--concurrency", "1", "--tolerance", "-1"],
     "argument --tolerance"),
    (["auto", "--preset", "x", "--page", "64", "--max-ctx", "8", "--concurrency", "1", "--tolerance", "nan"],
     "argument --tolerance"),
    (["sweep", "default", "--timeout", "-5"], "argument --timeout"),
    (["sweep", "default", "--timeout", "0"], "argument --timeout"),
    (["sweep", "default", "--timeout", "nan"], "argument --timeout"),
    (["sweep", "{binary}"], "not UTF-8 text"),
    (["sweep", "{bad_toml}"], "not valid TOML"),
    (["sweep", "{tmp}/none.toml"], "cannot read the sweep spec"),
    (["sweep", "{tmp}"], "cannot read the sweep spec"),
    (["export", "--db", "{db}", "--out", "{tmp}", "--no-commits"], "is a folder, not a file"),
    (["export", "--db", "{db}", "--out", "{file}/t.json", "--no-commits"], "is a file, not a folder"),
]


@pytest.mark.parametrize("argv,message", TUNER_OPTIONS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in TUNER_OPTIONS])
def test_tuner_option_errors(argv, message, tmp_path, capsys):
    files = dict(tmp=tmp_path, binary=_binary(tmp_path), bad_toml=_bad_toml(tmp_path), file=_a_file(tmp_path),
                 db=_valid_db(tmp_path / "p.db"))
    before = _snapshot(tmp_path)
    rc, err = _run(tuner_cli.main, capsys, [a.format(**files) for a in argv])
    assert rc == 2, err
    assert message in err and "Traceback" not in err
    _assert_untouched(before, _snapshot(tmp_path))


def test_spec_naming_an_uninstalled_backend(tmp_path, capsys, monkeypatch):
    """cutlass without the nvidia-cutlass wheel: a message saying what to install, even for --dry-run."""
    from drafter_attn.kernels import registry

    monkeypatch.setattr(registry, "_BUILT", {})
    monkeypatch.setitem(sys.modules, "cutlass_library", None)  # import fails as without the wheel
    monkeypatch.delitem(sys.modules, "drafter_attn.kernels.cutlass_backend", raising=False)
    spec = tmp_path / "s.toml"
    spec.write_text('[sweep]\nname = "c"\nbackends = ["cutlass"]\npresets = ["qwen3-8b-dflash-b16"]\n'
                    'page_sizes = [64]\nbatches = [1]\nctx_lens = [2048]\n')
    rc, err = _run(tuner_cli.main, capsys, ["sweep", spec, "--dry-run"])
    assert rc == 2 and f"{spec}: backend 'cutlass' is unavailable" in err and "nvidia-cutlass" in err


BENCH_OPTIONS = [
    (["report", "--db", "{db}", "--out", "{file}"], "is a file, not a folder"),
    (["report", "--db", "{db}", "--out", "{file}/sub"], "cannot write there"),
    (["report", "--db", "{db}", "--sm", "ninety"], "argument --sm"),
    (["decode", "--sm", "90", "--db", "{tmp}/new.db", "--out", "{file}"], "is a file, not a folder"),
    (["decode", "--sm", "90", "--db", "{file}/new.db", "--out", "{tmp}/o"], "cannot create the folder"),
    (["decode", "--reps", "-1"], "argument --reps"),
    (["decode", "--accepted", "nan"], "argument --accepted"),
]


@pytest.fixture
def no_measuring(monkeypatch):
    """A fake H200 whose every measurement fails the test: options must be refused before."""
    from drafter_attn.kernels import baselines

    def measure(*a, **k):
        raise AssertionError("measured although the command could not run as asked")

    monkeypatch.setattr(gpu, "probe", lambda: [gpu.GpuInfo(0, "NVIDIA H200", 90, 132, 141 << 30)])
    monkeypatch.setattr(decode, "default_measures", lambda: (measure, measure, measure))
    monkeypatch.setattr(baselines, "flashinfer_available", lambda: False)


@pytest.mark.parametrize("argv,message", BENCH_OPTIONS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BENCH_OPTIONS])
def test_bench_option_errors(argv, message, tmp_path, capsys, no_measuring):
    files = dict(tmp=tmp_path, file=_a_file(tmp_path), db=_valid_db(tmp_path / "p.db"))
    before = _snapshot(tmp_path)
    rc, err = _run(bench_cli.main, capsys, [a.format(**files) for a in argv])
    assert rc == 2, err
    assert message in err and "Traceback" not in err
    _assert_untouched(before, _snapshot(tmp_path))
    assert not (tmp_path / "new.db").exists()  # refused before the database was opened


@pytest.mark.parametrize("preset", ["wide/32", "x/../../escaped", "../../../../tmp/evil", "..", "a b\nc"])
def test_report_file_names_from_the_database_stay_inside_out(preset, tmp_path, capsys):
    db = _valid_db(tmp_path / "p.db", preset=preset)
    out = tmp_path / "deep" / "er" / "report"
    rc, err = _run(bench_cli.main, capsys, ["report", "--db", db, "--out", out])
    assert rc == 0, err
    pngs = list(tmp_path.rglob("*.png"))
    assert len(pngs) == 1 and pngs[0].parent == out
    assert {p.name for p in tmp_path.iterdir()} - {"p.db-wal", "p.db-shm"} == {"p.db", "deep"}


def test_a_failed_write_leaves_no_truncated_file(tmp_path):
    """A full disk part way through: the old file stays whole, no 0-byte or partial file appears."""
    target = tmp_path / "plot.png"
    target.write_bytes(b"old plot")

    def fill_disk(tmp: Path) -> None:
        tmp.write_bytes(b"half a pl")
        raise OSError(28, "No space left on device", str(tmp))

    with pytest.raises(OSError, match="No space left"):
        write_whole(target, fill_disk)
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"] and target.read_bytes() == b"old plot"


def test_a_file_written_whole_keeps_the_mode_a_plain_write_gives(tmp_path):
    """A tuned table exported for a service must stay readable to it: the temporary file's
    owner-only mode does not carry over; a new file gets the umask's mode, an existing one its own."""
    import os
    import stat

    new = write_whole(tmp_path / "t.json", lambda tmp: tmp.write_text("{}"))
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~mask
    old = tmp_path / "shared.json"
    old.write_text("[]")
    old.chmod(0o640)
    write_whole(old, lambda tmp: tmp.write_text("{}"))
    assert stat.S_IMODE(old.stat().st_mode) == 0o640 and old.read_text() == "{}"


# ---------------------------------------------------------------------------------------------
# The contract: numpy scalars are numbers; bad values name the argument; no store writes one row twice


@pytest.mark.parametrize("window,scale", [(np.int64(4), None), (np.int32(3), np.float32(0.5)),
                                          (4, np.float64(0.25)), (np.uint8(2), np.float16(1.0))])
def test_numpy_scalars_are_accepted(window, scale):
    make, fn = CALLS["paged"]
    args = make()
    got = fn(**args, mask="sliding", window=window, scale=scale)
    want = fn(**args, mask="sliding", window=int(window), scale=None if scale is None else float(scale))
    torch.testing.assert_close(got, want)


BAD_CONTRACT = [
    ("paged", dict(mask="sliding", window=np.float32(4.0)), "window must be a positive integer, got np.float32(4.0)"),
    ("paged", dict(mask="sliding", window="4"), "window must be a positive integer, got '4' (str)"),
    ("paged", dict(mask="sliding", window=np.int64(0)), "window must be positive, got window=0"),
    ("paged", dict(mask="sliding", window=True), "window must be a positive integer, got True"),
    ("arena", dict(scale=np.float32("nan")), "scale must be a positive finite number"),
    ("arena", dict(scale=np.float32(-1)), "scale must be a positive finite number"),
    ("arena", dict(scale=True), "scale must be a positive finite number or None, got True"),
    ("arena", dict(scale="0.5"), "scale must be a positive finite number or None, got '0.5'"),
    ("arena", dict(scale=math.inf), "scale must be a positive finite number"),
    ("paged", dict(mask=["full"]), "mask=['full'] is unknown"),
    ("paged", dict(mask="causal"), "mask='causal' is unknown"),
]


@pytest.mark.parametrize("call,options,message", BAD_CONTRACT,
                         ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(BAD_CONTRACT)])
def test_contract_options(call, options, message):
    make, fn = CALLS[call]
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(**make(), **options)


def _store(block_table, ctx_lens, num_new, page_size=4, pages=8, rows=8):
    B = len(block_table)
    return dict(k_new=torch.randn(B, rows, 2, 8), v_new=torch.randn(B, rows, 2, 8),
                num_new=torch.tensor(num_new, dtype=torch.int32),
                k_pages=torch.zeros(pages, 2, page_size, 8), v_pages=torch.zeros(pages, 2, page_size, 8),
                block_table=torch.tensor(block_table, dtype=torch.int32),
                ctx_lens=torch.tensor(ctx_lens, dtype=torch.int32))


DOUBLE_WRITES = [
    (([[0, 1, 2], [0, 4, 5]], [0, 0], [2, 2]), "requests 0 and 1 both write row 0 of page 0"),
    (([[0, 1, 2], [3, 1, 5]], [4, 5], [2, 1]), "requests 0 and 1 both write row 1 of page 1"),
    (([[6, 7], [2, 3], [7, 6]], [0, 0, 4], [2, 1, 1]), "requests 0 and 2 both write row 0 of page 6"),
    (([[2, 2]], [0], [8]), "request 0 writes row 0 of page 2 twice"),
]


@pytest.mark.parametrize("tables,message", DOUBLE_WRITES, ids=[m for _, m in DOUBLE_WRITES])
def test_store_paged_refuses_two_writes_to_one_cache_row(tables, message):
    args = _store(*tables)
    k_before = args["k_pages"].clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        reference.store_paged(**args)
    assert torch.equal(args["k_pages"], k_before)  # refused before any row was stored


def test_store_paged_accepts_distinct_rows():
    reference.store_paged(**_store([[0, 1], [2, 3]], [0, 3], [4, 5]))
    reference.store_paged(**_store([[0, 1], [0, 1]], [0, 0], [0, 0]))  # nothing written at all


@pytest.mark.gpu
def test_full_checks_read_gpu_values_only_when_asked(monkeypatch):
    """On the GPU the value checks cost a device read, so they run only with DRAFTER_CHECKS=full."""
    from drafter_attn.kernels.contract import check_store_paged

    args = {k: v.cuda() for k, v in _store([[0, 1, 2], [0, 4, 5]], [0, 0], [2, 2]).items()}
    monkeypatch.delenv("DRAFTER_CHECKS", raising=False)
    check_store_paged(**args)  # shapes only: no device read, no error
    monkeypatch.setenv("DRAFTER_CHECKS", "full")
    with pytest.raises(ValueError, match="requests 0 and 1 both write row 0 of page 0"):
        check_store_paged(**args)
    args["ctx_lens"] = torch.tensor([0, 11], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=re.escape("ctx_lens[1]=11 + num_new[1]=2 exceeds the capacity")):
        check_store_paged(**args)


@pytest.mark.parametrize("table, args, message", [
    ("shipped", ["--set", "foo=1"], "unknown cupy params ['foo']"),
    ("shipped", ["--set", "stages=abc"], "parameter stages='abc' must be int"),
    ("shipped", ["--set", "stages"], "'stages' is not key=value"),
    ("shipped", ["--impl", "nosuch", "--set", "stages=3"], "unknown backend 'nosuch'"),
    ("[]", ["--set", "stages=3"], "is not a tuned table"),
    ("{", ["--set", "stages=3"], "is not a JSON tuned table"),
    (None, ["--set", "stages=3"], "cannot read"),
    ("entry-without-params", ["--set", "stages=3"], "an entry is not one `tuner export` writes"),
])
def test_tuner_refine_refuses_bad_input_with_a_message(table, args, message, tmp_path, capsys):
    """A bad --set, --impl or table is exit 2 with a line naming it, never a traceback."""
    from drafter_attn.kernels.shipped import find_default

    path = tmp_path / "t.json"
    if table == "shipped":
        path = find_default(90, ("table",))
        if path is None:
            pytest.skip("no shipped sm90 table")
    elif table == "entry-without-params":
        doc = json.loads(find_default(90, ("table",)).read_text())
        del doc["entries"][0]["params"]
        path.write_text(json.dumps(doc))
    elif table is not None:
        path.write_text(table)
    rc, err = _run(tuner_cli.main, capsys, ["refine", path, *args, "--dry-run"])
    assert rc == 2 and message in err and "Traceback" not in err


def test_tuner_sweep_names_a_variant_value_of_the_wrong_type(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('[sweep]\nname = "x"\nbackends = ["cupy"]\npresets = ["qwen3-8b-dflash-b16"]\n'
                    'page_sizes = [64]\nbatches = [1]\nctx_lens = [2048]\n\n'
                    '[params.cupy]\nvariants = [{}, {stages = 3.0}]\n')
    rc, err = _run(tuner_cli.main, capsys, ["sweep", spec, "--dry-run"])
    assert rc == 2 and "params.cupy.variants[1]: backend 'cupy': parameter stages=3.0 must be int" in err


def test_ray_gpus_without_ray_is_refused(tmp_path, capsys):
    rc, err = _run(tuner_cli.main, capsys, ["sweep", "default", "--ray-gpus", "2", "--db", tmp_path / "p.db"])
    assert rc == 2 and "--ray-gpus caps a Ray sweep's GPUs: give --ray too" in err
    assert not (tmp_path / "p.db").exists()
