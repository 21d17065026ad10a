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

import datetime as _dt
import hashlib
import json
import os
import sqlite3
import time
import uuid
from pathlib import Path

SCHEMA_NAME = "drafter-attn-profile"
SCHEMA_VERSION = 1

STATUSES = ("ok", "failed_compile", "failed_runtime", "failed_correctness", "failed_timeout",
            "unsupported")
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


SCHEMA = [
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    _table("environments", ENV_COLUMNS),
    _table("results", (("id", "INTEGER PRIMARY KEY"), *RESULT_COLUMNS)),
    "CREATE INDEX results_candidate ON results (env_id, candidate_key)",
    "CREATE INDEX results_problem ON results (problem_key, impl)",
    _table("compile_profiles", (("id", "INTEGER PRIMARY KEY"), *COMPILE_COLUMNS),
           f",\n  UNIQUE ({', '.join(COMPILE_KEY)})"),
]


class SchemaError(RuntimeError):
    """The file is not a profile database of the schema version this tuner reads."""


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def candidate_key(problem_key: dict, accepted, impl: str, params: dict) -> str:
    """What makes two measurements the same candidate (within one environment)."""
    text = canonical_json([problem_key, None if accepted is None else float(accepted), impl, params])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


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


class ProfileDB:
    """An open profile database. `create=False` refuses a missing file instead of creating it."""

    def __init__(self, path: str | os.PathLike | None = None, *, create: bool = True):
        self.path = Path(path) if path is not None else default_path()
        if not self.path.exists():
            if not create:
                raise SchemaError(f"no profile database at {self.path} (run `tuner sweep` or "
                                  f"`tuner compile` to create one, or pass --db)")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit: every statement is its own transaction unless BEGIN says otherwise.
        self.conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute("PRAGMA busy_timeout = 60000")
            _retry_locked(self._check_or_create)
            mode = _retry_locked(lambda: self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            if mode.lower() != "wal":
                raise SchemaError(f"{self.path}: could not switch to WAL mode (journal_mode={mode})")
            self.conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise SchemaError(f"{self.path} is not a readable SQLite profile database: {exc}") from exc
        except BaseException:
            self.conn.close()
            raise

    # -- schema -------------------------------------------------------------------------------
    def _check_or_create(self) -> None:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")  # serialises first openers racing to create the schema
        try:
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                for stmt in SCHEMA:
                    c.execute(stmt)
                c.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                              [("schema", SCHEMA_NAME), ("schema_version", str(SCHEMA_VERSION)),
                               ("created_at", now())])
            else:
                self._check_meta(tables)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def _check_meta(self, tables: set) -> None:
        if "meta" not in tables:
            raise SchemaError(f"{self.path} is not a drafter-attn profile database "
                              f"(it has tables {sorted(tables)} but no 'meta' table)")
        meta = dict(self.conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") != SCHEMA_NAME:
            raise SchemaError(f"{self.path} is not a drafter-attn profile database "
                              f"(schema {meta.get('schema')!r}, expected {SCHEMA_NAME!r})")
        version = meta.get("schema_version")
        if version != str(SCHEMA_VERSION):
            raise SchemaError(
                f"{self.path} has profile schema version {version}, but this tuner reads version "
                f"{SCHEMA_VERSION} only; use a tuner of that version, or pass --db for a new file"
            )

    def schema_version(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])

    # -- writes -------------------------------------------------------------------------------
    def add_environment(self, fp: dict) -> str:
        """Record an environment fingerprint (idempotent); returns its env_id."""
        from drafter_attn.tuner.env import FIELDS, env_id

        eid = env_id(fp)
        names = ["env_id", *FIELDS, "fingerprint", "created_at"]
        values = [eid, *(fp.get(f) for f in FIELDS), canonical_json(fp), now()]
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
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            c.executemany(f"INSERT OR REPLACE INTO compile_profiles ({', '.join(names)}) "
                          f"VALUES ({', '.join('?' * len(names))})", values)
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        return len(values)

    # -- reads --------------------------------------------------------------------------------
    def done_candidates(self, env_id: str, statuses=None) -> set[str]:
        """candidate_keys with a row in environment `env_id` (of the given statuses, or any)."""
        sql = "SELECT DISTINCT candidate_key FROM results WHERE env_id = ?"
        args: list = [env_id]
        if statuses:
            sql += f" AND status IN ({', '.join('?' * len(statuses))})"
            args += list(statuses)
        return {r[0] for r in self.conn.execute(sql, args)}

    def count(self, table: str = "results") -> int:
        if table not in ("results", "environments", "compile_profiles"):
            raise ValueError(f"unknown table {table!r}")
        return self.conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]

    def query(self, sql: str, args=()) -> list[dict]:
        return [dict(r) for r in self.conn.execute(sql, args)]

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ProfileDB:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge(dst: str | os.PathLike, *srcs: str | os.PathLike) -> dict[str, int]:
    """Copy every environment, result and compile profile of `srcs` into `dst` (created when
    missing). Rows already there (same result uid; same compile key) are skipped, so merging twice
    adds nothing. Each source's schema is checked first. Returns rows added per table."""
    added = {"environments": 0, "results": 0, "compile_profiles": 0}
    with ProfileDB(dst) as out:
        for src in srcs:
            if Path(src).resolve() == out.path.resolve():
                raise ValueError(f"cannot merge {src} into itself")
            ProfileDB(src, create=False).close()  # refuses foreign or missing files
            c = out.conn
            c.execute("ATTACH DATABASE ? AS src", (str(src),))
            try:
                c.execute("BEGIN IMMEDIATE")
                try:
                    for table, columns in (("environments", ENV_COLUMNS), ("results", RESULT_COLUMNS),
                                           ("compile_profiles", COMPILE_COLUMNS)):
                        cols = ", ".join(_names(columns))
                        cur = c.execute(f"INSERT OR IGNORE INTO main.{table} ({cols}) "
                                        f"SELECT {cols} FROM src.{table}")
                        added[table] += cur.rowcount
                    c.execute("COMMIT")
                except BaseException:
                    c.execute("ROLLBACK")
                    raise
            finally:
                c.execute("DETACH DATABASE src")
    return added


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


def _write_transaction(conn: sqlite3.Connection, fn):
    """fn() inside BEGIN IMMEDIATE ... COMMIT (rolled back on any error); returns fn's value."""
    def attempt():
        conn.execute("BEGIN IMMEDIATE")
        try:
            value = fn()
            conn.execute("COMMIT")
            return value
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    return _retry_locked(attempt)


def ensure_claims(db: ProfileDB) -> None:
    _retry_locked(lambda: db.conn.execute(CLAIMS_DDL))


def claim_candidate(db: ProfileDB, scope: str, env_id: str, key: str, owner: str, *, lease_s: float,
                    since: str, statuses=None, serves=lambda env: True) -> str:
    """Claim candidate `key` of `scope` for `owner`, to measure in environment `env_id`,
    atomically. Returns DONE when the database holds a row for it in `env_id` (of `statuses`,
    when given), or a row written at or after `since` in any environment that `serves` (a
    predicate on its environments row): another sweep measured it meanwhile. Returns BUSY while
    another owner's claim is unexpired, else CLAIMED."""
    c = db.conn
    own_sql = "SELECT 1 FROM results WHERE env_id = ? AND candidate_key = ?"
    own_args: list = [env_id, key]
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

    return _write_transaction(c, attempt)


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
