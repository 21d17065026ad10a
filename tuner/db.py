"""The profile database: one SQLite file (WAL) of measured and predicted kernel profiles.

Tables:
  meta              schema name and version; a database of another name or version is refused
  environments      one row per environment fingerprint (GPU, SM, driver, CUDA, library versions,
                    kernel-source hash), keyed by `env_id` (see tuner.env)
  results           one row per measured (or predicted) candidate: environment, problem (its key
                    columns and canonical JSON), implementation and parameters (JSON), every
                    metric, status and reason, provenance, sweep id and time
  compile_profiles  static compile profiles (registers, spills, shared memory per SM target),
                    which need no GPU
  claims            candidates that running sweeps are measuring now (created on first use; see
                    claim_candidate)

Every result is inserted in its own transaction the moment it exists, so a killed sweep loses
nothing it finished. Writers from several processes are safe (WAL, a long busy timeout).

Default location (`default_path()`): `$DRAFTER_DB` when set; else `profiles/profile.db` of the
source checkout this package runs from (when that `profiles/` folder exists); else
`$XDG_DATA_HOME/drafter-attn/profile.db` (`~/.local/share/drafter-attn/profile.db`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import sqlite3
import time
import urllib.parse
import uuid
from pathlib import Path

from drafter_attn.kernels.tuned_table import unreplayed_wal

SCHEMA_NAME = "drafter-attn-profile"
SCHEMA_VERSION = 5

STATUSES = ("ok", "failed_compile", "failed_runtime", "failed_correctness", "failed_timeout",
            "unsupported", "failed_node_lost")
PROVENANCES = ("measured", "predicted")

# Problem key columns, in the order of kernels.spec.Problem.key().
PROBLEM_COLUMNS = (("num_q_heads", "INTEGER"), ("num_kv_heads", "INTEGER"), ("head_dim", "INTEGER"),
                   ("block_size", "INTEGER"), ("mask", "TEXT"), ("window", "INTEGER"),
                   ("num_layers", "INTEGER"), ("dtype", "TEXT"), ("layout", "TEXT"),
                   ("page_size", "INTEGER"), ("batch", "INTEGER"), ("ctx_len", "INTEGER"))

# Metrics of one candidate (NULL when not measured; zero only when measured zero).
METRIC_COLUMNS = (
    # latency of the whole step (CUDA graph replays, CUDA events), and a second timing (noise)
    ("median_us", "REAL"), ("p10_us", "REAL"), ("p90_us", "REAL"), ("mean_us", "REAL"),
    ("min_us", "REAL"), ("count", "INTEGER"), ("repeat_median_us", "REAL"), ("l2_flushed", "INTEGER"),
    # the split: attention alone, store alone
    ("attention_median_us", "REAL"), ("attention_p10_us", "REAL"), ("attention_p90_us", "REAL"),
    ("store_median_us", "REAL"), ("store_p10_us", "REAL"), ("store_p90_us", "REAL"),
    # roofline
    ("bytes_moved", "INTEGER"), ("bandwidth_gbs", "REAL"), ("copy_bandwidth_gbs", "REAL"),
    ("roofline_fraction", "REAL"),
    # the read floor: the same bytes streamed by a read-only kernel, timed the same way (schema 2)
    ("read_floor_us", "REAL"), ("read_bandwidth_gbs", "REAL"), ("read_roofline_fraction", "REAL"),
    # the timing method's fixed cost in this run: replay of a one-kernel graph (schema 2)
    ("graph_fixed_us", "REAL"),
    # the SM clock (MHz, NVML) around the timed replays: under a sustained load the H200 holds
    # its power limit by lowering it, and some kernels slow with it (schema 3)
    ("sm_clock_mhz", "REAL"),
    # correctness
    ("rel_err", "REAL"),
    # host-sync stalls of one step
    ("syncs_debug", "INTEGER"), ("syncs_profiler", "INTEGER"), ("sync_host_us", "REAL"),
    ("dtoh_copies", "INTEGER"), ("syncs_nsys", "INTEGER"), ("sync_host_us_nsys", "REAL"),
    ("graph_capturable", "INTEGER"), ("sync_note", "TEXT"),
    # memory
    ("kv_bytes", "INTEGER"), ("workspace_bytes", "INTEGER"), ("peak_bytes", "INTEGER"),
)

RESULT_COLUMNS = (
    ("uid", "TEXT NOT NULL UNIQUE"),
    ("env_id", "TEXT NOT NULL REFERENCES environments(env_id)"),
    ("candidate_key", "TEXT NOT NULL"),
    ("problem_key", "TEXT NOT NULL"),
    ("preset", "TEXT"),
    *PROBLEM_COLUMNS,
    ("accepted", "REAL"),
    # the regime of the timing: seconds of load before each timing (`--sustain`; NULL: a burst
    # on a cool GPU), the step's own unless `sustain_load` says otherwise. Part of the candidate
    # (schema 4)
    ("sustain_s", "REAL"),
    # what load held that state: NULL or 'self' the step's own, 'gemm' a co-runner's matmuls
    # before and between the timed replays (a target model's; tuner.timing.co_load). Part of the
    # candidate where not the step's own (schema 5)
    ("sustain_load", "TEXT"),
    ("impl", "TEXT NOT NULL"),
    ("params", "TEXT NOT NULL"),
    ("status", "TEXT NOT NULL CHECK (status IN (%s))" % ", ".join(f"'{s}'" for s in STATUSES)),
    ("reason", "TEXT"),
    ("provenance", "TEXT NOT NULL DEFAULT 'measured' CHECK (provenance IN (%s))"
     % ", ".join(f"'{p}'" for p in PROVENANCES)),
    *METRIC_COLUMNS,
    ("sweep_id", "TEXT"),
    ("worker", "TEXT"),
    ("elapsed_s", "REAL"),
    ("created_at", "TEXT NOT NULL"),
)

ENV_COLUMNS = (("env_id", "TEXT PRIMARY KEY"), ("gpu_name", "TEXT"), ("sm", "INTEGER"),
               ("sm_count", "INTEGER"), ("driver", "TEXT"), ("cuda", "TEXT"), ("torch", "TEXT"),
               ("cupy", "TEXT"), ("cutlass", "TEXT"), ("nvrtc", "TEXT"), ("sources_hash", "TEXT"),
               ("fingerprint", "TEXT NOT NULL"), ("created_at", "TEXT NOT NULL"))

COMPILE_COLUMNS = (("sm", "INTEGER NOT NULL"), ("arch", "TEXT NOT NULL"), ("backend", "TEXT NOT NULL"),
                   ("variant", "TEXT NOT NULL"), ("kernel", "TEXT NOT NULL"), ("registers", "INTEGER"),
                   ("spill_bytes", "INTEGER"), ("stack_bytes", "INTEGER"), ("smem_static", "INTEGER"),
                   ("smem_dynamic", "INTEGER"), ("compile_s", "REAL"), ("sources_hash", "TEXT NOT NULL"),
                   ("nvrtc", "TEXT NOT NULL"), ("created_at", "TEXT NOT NULL"))
COMPILE_KEY = ("sm", "arch", "backend", "variant", "kernel", "sources_hash", "nvrtc")


def _names(columns) -> list[str]:
    return [name for name, _ in columns]


def _table(name: str, columns, extra: str = "") -> str:
    body = ",\n  ".join(f"{c} {t}" for c, t in columns)
    return f"CREATE TABLE {name} (\n  {body}{extra}\n)"


# Statements that bring a database of version N up to N + 1 (each adds columns only, so rows
# written by older tuners stay valid; their new columns read NULL: not measured).
MIGRATIONS = {
    # 2: the read-floor and fixed-cost columns, and the status failed_node_lost (a CHECK
    # constraint: SQLite changes it only by rebuilding the table)
    1: lambda conn: _rebuild_results(conn),
    # 3: the SM clock of a timing (a database rebuilt from version 1 above has it already)
    2: lambda conn: _add_column(conn, "results", "sm_clock_mhz", "REAL"),
    # 4: the sustained regime of a timing (`sustain_s`; older rows are bursts)
    3: lambda conn: _add_column(conn, "results", "sustain_s", "REAL"),
    # 5: the load of a sustained timing (`sustain_load`; older sustained rows are the step's own)
    4: lambda conn: _add_column(conn, "results", "sustain_load", "TEXT"),
}


def _add_column(conn, table: str, name: str, kind: str) -> None:
    if name not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")


def _rebuild_results(conn) -> None:
    """Rebuild `results` with this schema's columns and constraints, keeping every row (columns
    it lacked read NULL) and its ids; inside the caller's transaction."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(results)")}
    conn.execute(_table("results_new", (("id", "INTEGER PRIMARY KEY"), *RESULT_COLUMNS)))
    cols = ", ".join(n for n in ("id", *_names(RESULT_COLUMNS)) if n in have)
    conn.execute(f"INSERT INTO results_new ({cols}) SELECT {cols} FROM results")
    conn.execute("DROP TABLE results")
    conn.execute("ALTER TABLE results_new RENAME TO results")
    for stmt in SCHEMA:
        if stmt.startswith("CREATE INDEX") and " ON results " in stmt:
            conn.execute(stmt)

SCHEMA = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    _table("environments", ENV_COLUMNS),
    _table("results", (("id", "INTEGER PRIMARY KEY"), *RESULT_COLUMNS)),
    "CREATE INDEX results_candidate ON results (env_id, candidate_key)",
    "CREATE INDEX results_problem ON results (problem_key, impl)",
    _table("compile_profiles", (("id", "INTEGER PRIMARY KEY"), *COMPILE_COLUMNS),
           f",\n  UNIQUE ({', '.join(COMPILE_KEY)})"),
]


TABLES = {"meta", "environments", "results", "compile_profiles"}


class SchemaError(RuntimeError):
    """The file is not a profile database of the schema version this tuner reads."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def candidate_key(problem_key: dict, accepted, impl: str, params: dict, sustain_s=None,
                  sustain_load=None) -> str:
    """What makes two measurements the same candidate (within one environment). A timing after
    `sustain_s` seconds of load is another candidate than a burst's (whose key is as before the
    regime existed, so burst rows of older tuners keep theirs), and one under a co-runner's load
    (`sustain_load`, not the step's own) another again."""
    parts = [problem_key, None if accepted is None else float(accepted), impl, params]
    if sustain_s:
        parts.append({"sustain_s": float(sustain_s)})
        if sustain_load and sustain_load != "self":
            parts[-1]["sustain_load"] = sustain_load
    return hashlib.sha256(canonical_json(parts).encode()).hexdigest()[:24]


def _repo_profiles_dir() -> Path | None:
    # A source checkout (or editable install) has profiles/ next to the tuner package.
    candidate = Path(__file__).resolve().parent.parent / "profiles"
    return candidate if candidate.is_dir() else None


def default_path() -> Path:
    """$DRAFTER_DB, else <checkout>/profiles/profile.db, else ~/.local/share/drafter-attn/profile.db."""
    env = os.environ.get("DRAFTER_DB")
    if env:
        return Path(env).expanduser()
    profiles = _repo_profiles_dir()
    if profiles is not None:
        return profiles / "profile.db"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "drafter-attn" / "profile.db"


def reading_path(sm: int | None = None, table: str = "results") -> Path:
    """What a command that only reads measurements (`tuner show`, `tuner export`, `bench report`)
    reads without --db: $DRAFTER_DB, else this user's database (`default_path`, where sweeps
    write) when it holds ok rows (of SM `sm` when given), else the profile database shipped for
    the SM (--sm, else this GPU's; the only one shipped when neither says), else `default_path`
    (whose absence the command then names). `table`: what must be there ("compile_profiles" for
    `tuner show --compile`)."""
    own = default_path()
    if os.environ.get("DRAFTER_DB") or _holds_rows(own, sm, table):
        return own
    from drafter_attn.kernels.shipped import find_default, only_shipped

    found = find_default(sm, ("db",))
    if found is None and sm is None:
        found = only_shipped("db")
    return found or own


def _holds_rows(path: Path, sm: int | None, table: str = "results") -> bool:
    """Whether the database at `path` holds an ok result row, or a compile profile (`table`), of
    SM `sm` (any SM when None); False when it cannot be read."""
    if not path.is_file():
        return False
    sql = ("SELECT 1 FROM compile_profiles e WHERE 1" if table == "compile_profiles" else
           "SELECT 1 FROM results r JOIN environments e USING (env_id) WHERE r.status = 'ok'")
    try:
        conn = sqlite3.connect(_readonly_uri(path, False), uri=True)
        try:
            return conn.execute(sql + (" AND e.sm = ?" if sm is not None else "") + " LIMIT 1",
                                () if sm is None else (sm,)).fetchone() is not None
        finally:
            conn.close()
    except sqlite3.Error:
        return False


def _retry_locked(fn, attempts: int = 200, wait_s: float = 0.05):
    """Run fn(), retrying while SQLite says the database is locked (beyond the busy timeout,
    e.g. a journal-mode switch racing other first openers)."""
    for i in range(attempts):
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or i == attempts - 1:
                raise
            time.sleep(wait_s)


class DatabaseError(SchemaError):
    """SQLite failed on an open profile database (corrupt pages, a dropped table, a full disk, a
    read-only folder); the message names the file."""


@contextlib.contextmanager
def db_errors(path, doing: str):
    """Turn SQLite's errors while `doing` something with `path` into a DatabaseError naming both."""
    try:
        yield
    except sqlite3.Error as exc:
        raise DatabaseError(f"{path}: {doing} failed: {exc}") from exc


def _readonly_uri(path: Path, immutable: bool) -> str:
    return ("file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
            + ("&immutable=1" if immutable else ""))


def _cannot_open(exc: sqlite3.Error) -> bool:
    # A WAL database in a folder this process cannot write (package data): its -shm side file
    # cannot be created, so only an immutable open reads it.
    text = str(exc).lower()
    return "unable to open" in text or "readonly" in text or "read-only" in text


class ProfileDB:
    """An open profile database.

    `create=False` refuses a missing or empty file instead of creating a schema in it.
    `readonly=True` (implies create=False) opens the file read-only (SQLite `mode=ro`, and
    `immutable=1` when the folder cannot hold WAL side files): the file is never written, and any
    write through this object fails. Every read-only command opens the database this way.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, create: bool = True,
                 readonly: bool = False):
        self.path = Path(path) if path is not None else default_path()
        create = create and not readonly
        if self.path.is_dir():
            raise SchemaError(f"{self.path} is a directory, not a profile database")
        if not self.path.exists():
            if not create:
                hint = (" (run `tuner sweep` or `tuner compile` to create one, or pass --db)"
                        if path is None or self.path == default_path() else "")
                raise SchemaError(f"no profile database at {self.path}{hint}")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SchemaError(f"cannot create the folder of {self.path}: {exc.strerror or exc}") from None
        elif not create and self.path.stat().st_size == 0:
            raise SchemaError(f"{self.path} is an empty file, not a profile database")
        try:
            self.conn = self._connect_readonly() if readonly else self._connect(create)
        except sqlite3.DatabaseError as exc:
            raise SchemaError(f"{self.path} is not a readable SQLite profile database: {exc}") from exc

    def _connect(self, create: bool) -> sqlite3.Connection:
        # Autocommit: every statement is its own transaction unless BEGIN says otherwise.
        conn = self.conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        conn.row_factory = sqlite3.Row
        try:
            conn.execute("PRAGMA busy_timeout = 60000")
            _retry_locked(lambda: self._check_or_create(create))
            mode = _retry_locked(lambda: conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            if mode.lower() != "wal":
                raise SchemaError(f"{self.path}: could not switch to WAL mode (journal_mode={mode})")
            conn.execute("PRAGMA foreign_keys = ON")
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect_readonly(self) -> sqlite3.Connection:
        for immutable in (False, True):
            conn = None
            try:
                conn = self.conn = sqlite3.connect(_readonly_uri(self.path, immutable), uri=True,
                                                   timeout=60, isolation_level=None)
                conn.row_factory = sqlite3.Row
                conn.execute("PRAGMA query_only = ON")
                self._check_meta(self._tables(), migrate=False)
                return conn
            except sqlite3.OperationalError as exc:
                if conn is not None:
                    conn.close()
                if immutable or not _cannot_open(exc):
                    raise
                unreplayed_wal(self.path, DatabaseError)  # what an immutable open would not read
            except BaseException:
                if conn is not None:
                    conn.close()
                raise
        raise AssertionError("unreachable")

    # -- schema -------------------------------------------------------------------------------
    def _tables(self) -> set:
        return {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def _check_or_create(self, create: bool) -> None:
        with self.transaction():  # BEGIN IMMEDIATE serialises first openers racing to create the schema
            tables = self._tables()
            if not tables and create:
                for stmt in SCHEMA:
                    self.conn.execute(stmt)
                self.conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                                      [("schema", SCHEMA_NAME), ("schema_version", str(SCHEMA_VERSION)),
                                       ("created_at", now())])
            else:
                self._check_meta(tables)

    def _check_meta(self, tables: set, migrate: bool = True) -> None:
        """Refuse what is not a profile database of a version this tuner reads; bring an older
        version up to date when `migrate` (a read-only open reads it as it is: the columns added
        since are absent, i.e. not measured)."""
        if not tables:
            raise SchemaError(f"{self.path} holds no tables; it is not a drafter-attn profile database")
        if "meta" not in tables:
            raise SchemaError(f"{self.path} is not a drafter-attn profile database "
                              f"(it has tables {sorted(tables)} but no 'meta' table)")
        meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") != SCHEMA_NAME:
            raise SchemaError(f"{self.path} is not a drafter-attn profile database "
                              f"(schema {meta.get('schema')!r}, expected {SCHEMA_NAME!r})")
        version = meta.get("schema_version")
        if version is not None and version.isdigit() and int(version) in MIGRATIONS:
            if migrate:
                self._migrate(int(version))
        elif version != str(SCHEMA_VERSION):
            raise SchemaError(
                f"{self.path} has profile schema version {version}, but this tuner reads version "
                f"{SCHEMA_VERSION} only; use a tuner of that version, or pass --db for a new file"
            )
        missing = sorted(TABLES - tables)
        if missing:
            raise SchemaError(f"{self.path} is a damaged profile database: table(s) {missing} are missing")
        if migrate and not self._takes_every_status():
            # a file of version 2 made before failed_node_lost joined its CHECK constraint (the
            # migrations after 2 only add columns): rebuilt, or its next such row cannot be stored
            _rebuild_results(self.conn)

    def _takes_every_status(self) -> bool:
        sql = self.conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'results'"
                                ).fetchone()[0]
        return all(f"'{status}'" in sql for status in STATUSES)

    def check_integrity(self) -> None:
        """Raise DatabaseError when SQLite finds damaged pages (PRAGMA quick_check)."""
        with db_errors(self.path, "checking integrity"):
            problems = [r[0] for r in self.conn.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise DatabaseError(f"{self.path} is damaged: {'; '.join(problems)}")

    def _migrate(self, version: int) -> None:
        """Bring an older database up to SCHEMA_VERSION (inside the caller's transaction)."""
        for v in range(version, SCHEMA_VERSION):
            MIGRATIONS[v](self.conn)
        self.conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))

    def schema_version(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])

    # -- writes -------------------------------------------------------------------------------
    def add_environment(self, fp: dict) -> str:
        """Record an environment fingerprint (idempotent); returns its env_id."""
        from drafter_attn.tuner.env import FIELDS, env_id

        eid = env_id(fp)
        names = ["env_id", *FIELDS, "fingerprint", "created_at"]
        values = [eid, *(fp.get(f) for f in FIELDS), canonical_json(fp), now()]
        with db_errors(self.path, "storing an environment"):
            self.conn.execute(f"INSERT OR IGNORE INTO environments ({', '.join(names)}) "
                              f"VALUES ({', '.join('?' * len(names))})", values)
        return eid

    def add_result(self, row: dict) -> int:
        """Insert one result row now, in its own transaction; returns its id.

        `row` holds column values by name; unknown names are an error (a misspelt metric would
        otherwise vanish). `params` and `problem_key` may be dicts (stored as canonical JSON);
        uid and created_at are filled in when absent.
        """
        allowed = set(_names(RESULT_COLUMNS))
        unknown = set(row) - allowed
        if unknown:
            raise ValueError(f"unknown result columns {sorted(unknown)}")
        row = dict(row)
        for key in ("params", "problem_key"):
            if not isinstance(row.get(key), (str, type(None))):
                row[key] = canonical_json(row[key])
        row.setdefault("uid", uuid.uuid4().hex)
        row.setdefault("created_at", now())
        row.setdefault("provenance", "measured")
        if row.get("status") not in STATUSES:
            raise ValueError(f"status={row.get('status')!r} is not one of {', '.join(STATUSES)}")
        for key in ("l2_flushed", "graph_capturable"):
            if isinstance(row.get(key), bool):
                row[key] = int(row[key])
        names = list(row)
        with db_errors(self.path, "storing a result"):
            cur = self.conn.execute(f"INSERT INTO results ({', '.join(names)}) "
                                    f"VALUES ({', '.join('?' * len(names))})", [row[n] for n in names])
        return cur.lastrowid

    def add_compile_rows(self, rows: list[dict], sources_hash: str, nvrtc: str) -> int:
        """Store static compile profiles (rows of kernels.static_profile.compile_variants); a row
        of the same kernel, target, sources and compiler replaces the old one."""
        names = _names(COMPILE_COLUMNS)
        stamp = now()
        values = []
        for r in rows:
            full = {**r, "sources_hash": sources_hash, "nvrtc": nvrtc, "created_at": stamp}
            values.append([full.get(n) for n in names])
        with db_errors(self.path, "storing compile profiles"), self.transaction():
            self.conn.executemany(f"INSERT OR REPLACE INTO compile_profiles ({', '.join(names)}) "
                                  f"VALUES ({', '.join('?' * len(names))})", values)
        return len(values)

    @contextlib.contextmanager
    def transaction(self):
        """All statements inside commit together or not at all."""
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            yield
            c.execute("COMMIT")
        except BaseException:
            if c.in_transaction:
                c.execute("ROLLBACK")
            raise

    # -- reads --------------------------------------------------------------------------------
    def done_candidates(self, env_id: str | None, statuses=None, *,
                        sources_hash: str | None = None) -> set[str]:
        """candidate_keys with a row in environment `env_id` (None: in any) of the given
        statuses (or any); with `sources_hash`, only in environments of those kernel sources (a
        row of older sources is stale: the next sweep measures its candidate again)."""
        where, args = [], []
        if env_id is not None:
            where.append("env_id = ?")
            args.append(env_id)
        if statuses:
            where.append(f"status IN ({', '.join('?' * len(statuses))})")
            args += list(statuses)
        if sources_hash is not None:
            where.append("env_id IN (SELECT env_id FROM environments WHERE sources_hash = ?)")
            args.append(sources_hash)
        sql = "SELECT DISTINCT candidate_key FROM results" + (" WHERE " + " AND ".join(where) if where else "")
        with db_errors(self.path, "reading done candidates"):
            return {r[0] for r in self.conn.execute(sql, args)}

    def count(self, table: str = "results") -> int:
        if table not in TABLES - {"meta"}:
            raise ValueError(f"unknown table {table!r}")
        with db_errors(self.path, f"counting {table}"):
            return self.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]

    def query(self, sql: str, args=()) -> list[dict]:
        with db_errors(self.path, "reading"):
            return [dict(r) for r in self.conn.execute(sql, args)]

    def frame(self, sql: str, args=()):
        """A query's rows as a pandas DataFrame (its columns even when no row matches)."""
        import pandas as pd

        with db_errors(self.path, "reading"):
            cur = self.conn.execute(sql, list(args))
            rows = [tuple(r) for r in cur]
        return pd.DataFrame.from_records(rows, columns=[d[0] for d in cur.description], coerce_float=True)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ProfileDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge(dst: str | os.PathLike, *srcs: str | os.PathLike) -> dict[str, int]:
    """Copy every environment, result and compile profile of `srcs` into `dst` (created when
    missing). Rows already there (same result uid; same compile key) are skipped, so merging twice
    adds nothing. Every source is checked (exists, is a profile database of this schema, is not
    `dst`, is named once) before `dst` is created or touched. Returns rows added per table."""
    dst_path = Path(dst)
    seen: set[Path] = set()
    for src in srcs:
        real = Path(src).resolve()
        if real == dst_path.resolve():
            raise SchemaError(f"cannot merge {src} into itself (it is the destination {dst})")
        if real in seen:
            raise SchemaError(f"{src} is named twice as a source")
        seen.add(real)
        with ProfileDB(src, readonly=True) as db:  # refuses foreign, empty or missing files
            db.check_integrity()
    added = {"environments": 0, "results": 0, "compile_profiles": 0}
    with ProfileDB(dst_path) as out:
        for src in srcs:
            with db_errors(src, f"merging into {dst}"):
                _merge_one(out, src, added)
    return added


def _merge_one(out: ProfileDB, src, added: dict) -> None:
    # Read through a read-only open, not ATTACH: ATTACH opens the source read-write, which fails
    # where its folder cannot hold WAL side files (read-only storage) and may checkpoint into a
    # file that a merge only reads.
    with ProfileDB(src, readonly=True) as db, out.transaction():
        for table, columns in (("environments", ENV_COLUMNS), ("results", RESULT_COLUMNS),
                               ("compile_profiles", COMPILE_COLUMNS)):
            have = {r[1] for r in db.conn.execute(f"PRAGMA table_info({table})")}  # older schema: fewer
            names = [n for n in _names(columns) if n in have]
            cols, marks = ", ".join(names), ", ".join("?" * len(names))
            cur = out.conn.executemany(f"INSERT OR IGNORE INTO {table} ({cols}) VALUES ({marks})",
                                       db.conn.execute(f"SELECT {cols} FROM {table}"))
            added[table] += cur.rowcount


# ---------------------------------------------------------------------------------------------
# Claims: which sweep is measuring which candidate right now. A sweep claims a candidate in a
# short write transaction before it measures it, so two sweeps of one spec over one database
# never measure the same candidate twice. A claim holds for a lease that its sweep renews while
# it runs; the claim of a killed sweep expires, and a later sweep takes the candidate over.
# A claim's scope is the candidate's target ("sm90", "H200"; "*" for any GPU), since a candidate
# for any GPU is measured once whichever environment takes it. The table is created on first
# use (older databases gain it without a version change: readers of version 1 ignore it).

CLAIMS_DDL = ("CREATE TABLE IF NOT EXISTS claims (\n  scope TEXT NOT NULL,\n  candidate_key TEXT NOT NULL,\n"
              "  owner TEXT NOT NULL,\n  expires_at REAL NOT NULL,\n  PRIMARY KEY (scope, candidate_key)\n)")

CLAIMED, DONE, BUSY = "claimed", "done", "busy"


def _write_transaction(db: ProfileDB, fn):
    """fn() inside one `db.transaction()`, retried while the database is locked; fn's value."""
    def attempt():
        with db.transaction():
            return fn()

    return _retry_locked(attempt)


def ensure_claims(db: ProfileDB) -> None:
    _retry_locked(lambda: db.conn.execute(CLAIMS_DDL))


def claim_candidate(db: ProfileDB, scope: str, env_id: str, key: str, owner: str, *, lease_s: float,
                    since: str, statuses=None, serves=lambda env: True, fresh: bool = False) -> str:
    """Claim candidate `key` of `scope` for `owner`, to measure in environment `env_id`,
    atomically. Returns DONE when the database holds a row for it in `env_id` (of `statuses`,
    when given; with `fresh`, only a row written at or after `since` counts: a candidate to be
    measured again), or a row written at or after `since` in any environment that `serves` (a
    predicate on its environments row): another sweep measured it meanwhile. Returns BUSY while
    another owner's claim is unexpired, else CLAIMED."""
    c = db.conn
    own_sql = "SELECT 1 FROM results WHERE env_id = ? AND candidate_key = ?"
    own_args: list = [env_id, key]
    if fresh:
        own_sql += " AND created_at >= ?"
        own_args.append(since)
    if statuses:
        own_sql += f" AND status IN ({', '.join('?' * len(statuses))})"
        own_args += list(statuses)

    def done() -> bool:
        if c.execute(own_sql + " LIMIT 1", own_args).fetchone():
            return True
        recent = c.execute("SELECT DISTINCT e.* FROM results r JOIN environments e USING (env_id) "
                           "WHERE r.candidate_key = ? AND r.created_at >= ?", (key, since))
        return any(serves(dict(env)) for env in recent)

    def attempt() -> str:
        if done():
            return DONE
        t = time.time()
        held = c.execute("SELECT owner, expires_at FROM claims WHERE scope = ? AND candidate_key = ?",
                         (scope, key)).fetchone()
        if held and held[0] != owner and held[1] > t:
            return BUSY
        c.execute("INSERT OR REPLACE INTO claims (scope, candidate_key, owner, expires_at) "
                  "VALUES (?, ?, ?, ?)", (scope, key, owner, t + lease_s))
        return CLAIMED

    return _write_transaction(db, attempt)


def renew_claims(db: ProfileDB, owner: str, lease_s: float) -> None:
    """The heartbeat: extend every claim `owner` holds by `lease_s` from now."""
    _retry_locked(lambda: db.conn.execute("UPDATE claims SET expires_at = ? WHERE owner = ?",
                                          (time.time() + lease_s, owner)))


def release_claim(db: ProfileDB, scope: str, key: str, owner: str) -> None:
    _retry_locked(lambda: db.conn.execute(
        "DELETE FROM claims WHERE scope = ? AND candidate_key = ? AND owner = ?", (scope, key, owner)))


def release_claims(db: ProfileDB, owner: str) -> None:
    """Drop every claim of `owner` (a sweep that stops, finished or interrupted)."""
    _retry_locked(lambda: db.conn.execute("DELETE FROM claims WHERE owner = ?", (owner,)))
