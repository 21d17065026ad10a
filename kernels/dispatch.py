"""The runtime: pick a tuned kernel per problem from the profile database or a tuned table.

Two halves:

- `Dispatcher` opens a tuned table (JSON written by `tuner export`; preferred for deployments) or
  the SQLite profile database itself (read-only), once, builds an in-memory index and picks an
  implementation per problem in tiers:

    exact     the same SM, geometry, mask/window, dtype, layout/page size, batch and context
    bucketed  the same SM and shape; batch and context rounded up to powers of two (the query's
              own bucket, else the nearest measured bucket)
    family    the same, measured on another SM of the same family (sm // 10: 100 and 103)
    default   cupy with its default parameters where it supports the problem, else the reference

  Every candidate is checked with the backend's `supports()` before it is chosen; a pick says
  which tier gave it and why, never raises and never touches the GPU. Picks are cached per key.

- `Runtime` is the one call for a serving engine: the four contract functions, which compute the
  problem from tensor shapes only (the context length bucket comes from the cache capacity:
  block-table columns x page size, or the arena's max_ctx), pick once per shape and call the
  picked backend. A table that cannot be read makes it warn once and use the default heuristic.

This module must not import `tuner` (dependencies point bench -> tuner -> kernels): it reads the
few profile-database columns it needs itself, named in one place below (`DB_ROWS_SQL`);
`tuner export` writes its tables through `make_table`/`select_entries` of this module.

Tuned-table JSON (format "drafter-attn-tuned-table", version 1)::

    {"format": "drafter-attn-tuned-table", "version": 1, "created_at": ISO-8601,
     "source": {...where it came from: database, exporting commit, SMs, predicted included...},
     "metric": "per_layer_us", "rules": RULES,
     "entries": [{"sm": 90, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                  "block_size": 16, "mask": "full", "window": null, "dtype": "bfloat16",
                  "layout": "paged", "page_size": 64, "batch": 8, "ctx_len": 8192,
                  "bucket": {"batch": 8, "ctx_len": 8192},
                  "impl": "cupy", "params": {...}, "median_us": 61.2, "num_layers": 5,
                  "per_layer_us": 12.24, "attention_median_us": ..., "store_median_us": ...,
                  "syncs": 0, "graph_capturable": true, "kv_bytes": ..., "workspace_bytes": ...,
                  "candidates": 2,
                  "alternatives": [{"impl": ..., "params": {...}, "median_us": ..., "per_layer_us": ...}],
                  "provenance": {"kind": "measured", "sweep": ..., "date": ..., "gpu": ...,
                                 "driver": ..., "cuda": ..., "sources_hash": ..., "commit": ...,
                                 "env_id": ..., "preset": ...}}, ...]}
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
import types
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from drafter_attn.kernels.spec import Geometry, Problem

log = logging.getLogger("drafter_attn.kernels.dispatch")

TABLE_FORMAT = "drafter-attn-tuned-table"
TABLE_VERSION = 1
TIERS = ("exact", "bucketed", "family", "default")
# How a table's entries answer problems they were not measured at. A table stating other rules
# is refused (the runtime would answer differently from what its writer meant).
RULES = {
    "batch": "pow2_ceil",  # bucket(x) = smallest power of two >= x (0 stays 0)
    "ctx_len": "pow2_ceil",
    "within_bucket": "largest_batch_then_ctx",  # several entries in one bucket: the point
    #                                             nearest its upper edge stands for it
    "nearest_bucket": "log2_distance",  # no entry in the query's bucket: the nearest bucket
    "family": "sm_div_10",  # SMs 100 and 103 are one family, 120 and 121 another
    "rank": "measured_first_then_per_layer_us",
}
MAX_ALTERNATIVES = 3

# ---------------------------------------------------------------------------------------------
# The profile database, as far as the runtime reads it (tuner/db.py owns the schema; a tuner
# test checks these names against it).

DB_SCHEMA_NAME = "drafter-attn-profile"
DB_SCHEMA_VERSION = 2
DB_READS_VERSIONS = ("1", "2")  # version 2 only added columns this runtime does not read
SHAPE_FIELDS = ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "mask", "window", "dtype",
                "layout", "page_size")
DB_ROWS_SQL = """
SELECT e.sm, e.gpu_name, e.driver, e.cuda, e.sources_hash, r.env_id, r.preset,
       r.num_q_heads, r.num_kv_heads, r.head_dim, r.block_size, r.mask, r.window, r.dtype,
       r.layout, r.page_size, r.batch, r.ctx_len, r.num_layers, r.impl, r.params, r.provenance,
       r.median_us, r.attention_median_us, r.store_median_us, r.syncs_debug, r.syncs_profiler,
       r.syncs_nsys, r.graph_capturable, r.kv_bytes, r.workspace_bytes, r.sweep_id, r.created_at,
       r.id AS row_order
FROM results r JOIN environments e USING (env_id)
WHERE r.status = 'ok' AND r.median_us IS NOT NULL AND r.median_us > 0
"""


class TableError(RuntimeError):
    """A tuned table or profile database the runtime cannot use (missing, corrupt, foreign)."""


# ---------------------------------------------------------------------------------------------
# Buckets


def bucket(x: int) -> int:
    """Smallest power of two >= x; 0 stays 0."""
    return 0 if x <= 0 else 1 << (int(x) - 1).bit_length()


def family(sm: int) -> int:
    return sm // 10


def _log2(x: int) -> float:
    return math.log2(max(x, 1))


# ---------------------------------------------------------------------------------------------
# Rows -> entries (shared by the runtime's database reader and `tuner export`)


def _syncs(row: dict):
    vals = [row.get(k) for k in ("syncs_debug", "syncs_profiler", "syncs_nsys")]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _params(value) -> dict:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _age(row: dict) -> tuple:
    # Timestamps have millisecond resolution, so two rows of one sweep can tie: the later
    # insert (higher id) breaks the tie.
    return (row.get("created_at") or "", row.get("row_order") or 0)


def select_entries(rows, *, include_predicted: bool = False) -> list[dict]:
    """Winners per (SM, shape, batch, context) from result rows (dicts with the columns of
    `DB_ROWS_SQL`): the newest row of each (impl, params) counts; candidates rank measured
    before predicted, then by step latency per layer (rows of presets with different layer
    counts compare per layer). Predicted rows are left out unless `include_predicted`."""
    groups: dict[tuple, dict[tuple, dict]] = {}
    for row in rows:
        kind = row.get("provenance") or "measured"
        if kind == "predicted" and not include_predicted:
            continue
        key = (row["sm"], *(row[f] for f in SHAPE_FIELDS), row["batch"], row["ctx_len"])
        cand = (row["impl"], _canonical(_params(row["params"])), kind)
        seen = groups.setdefault(key, {})
        old = seen.get(cand)
        if old is None or _age(row) >= _age(old):
            seen[cand] = row
    entries = []
    for key in sorted(groups, key=lambda k: tuple(-1 if v is None else v for v in k)):
        ranked = sorted(groups[key].values(),
                        key=lambda r: ((r.get("provenance") or "measured") != "measured",
                                       r["median_us"] / (r.get("num_layers") or 1)))
        best = ranked[0]
        layers = best.get("num_layers") or 1
        entry = {"sm": best["sm"], **{f: best[f] for f in SHAPE_FIELDS},
                 "batch": best["batch"], "ctx_len": best["ctx_len"],
                 "bucket": {"batch": bucket(best["batch"]), "ctx_len": bucket(best["ctx_len"])},
                 "impl": best["impl"], "params": _params(best["params"]),
                 "median_us": best["median_us"], "num_layers": layers,
                 "per_layer_us": best["median_us"] / layers,
                 "attention_median_us": best.get("attention_median_us"),
                 "store_median_us": best.get("store_median_us"),
                 "syncs": _syncs(best),
                 "graph_capturable": None if best.get("graph_capturable") is None
                 else bool(best["graph_capturable"]),
                 "kv_bytes": best.get("kv_bytes"), "workspace_bytes": best.get("workspace_bytes"),
                 "candidates": len(ranked),
                 "alternatives": [{"impl": r["impl"], "params": _params(r["params"]),
                                   "median_us": r["median_us"],
                                   "per_layer_us": r["median_us"] / (r.get("num_layers") or 1)}
                                  for r in ranked[1:1 + MAX_ALTERNATIVES]],
                 "provenance": {"kind": best.get("provenance") or "measured",
                                "sweep": best.get("sweep_id"), "date": best.get("created_at"),
                                "gpu": best.get("gpu_name"), "driver": best.get("driver"),
                                "cuda": best.get("cuda"), "sources_hash": best.get("sources_hash"),
                                "commit": None, "env_id": best.get("env_id"),
                                "preset": best.get("preset")}}
        entries.append(entry)
    return entries


def make_table(entries: list[dict], source: dict | None = None, created_at: str | None = None) -> dict:
    """A tuned table (the JSON document `tuner export` writes) around `entries`."""
    import datetime as _dt

    return {"format": TABLE_FORMAT, "version": TABLE_VERSION,
            "created_at": created_at or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": dict(source or {}), "metric": "per_layer_us", "rules": dict(RULES),
            "entries": entries}


# ---------------------------------------------------------------------------------------------
# Loading


def read_db_rows(path) -> list[dict]:
    """The result rows the runtime needs, read from a profile database opened read-only."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"no profile database at {path}")
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=10)
    except sqlite3.Error as exc:
        raise TableError(f"{path}: cannot open the profile database read-only: {exc}") from exc
    try:
        conn.row_factory = sqlite3.Row
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" not in tables:
            raise TableError(f"{path} is not a drafter-attn profile database (no 'meta' table)")
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("schema") != DB_SCHEMA_NAME:
            raise TableError(f"{path} is not a drafter-attn profile database "
                             f"(schema {meta.get('schema')!r}, expected {DB_SCHEMA_NAME!r})")
        if meta.get("schema_version") not in DB_READS_VERSIONS:
            raise TableError(f"{path} has profile schema version {meta.get('schema_version')}, but "
                             f"this runtime reads version {DB_SCHEMA_VERSION} only; export a tuned "
                             f"table with a matching tuner")
        return [dict(r) for r in conn.execute(DB_ROWS_SQL)]
    except sqlite3.Error as exc:
        raise TableError(f"{path} is not a readable profile database: {exc}") from exc
    finally:
        conn.close()


_ENTRY_TYPES = {"sm": int, "num_q_heads": int, "num_kv_heads": int, "head_dim": int,
                "block_size": int, "mask": str, "dtype": str, "layout": str, "batch": int,
                "ctx_len": int, "impl": str, "params": dict}


def validate_table(doc, where: str = "<table>") -> list[dict]:
    """Check a tuned-table document; returns its entries. Raises TableError naming the problem."""
    if not isinstance(doc, dict):
        raise TableError(f"{where} is not a tuned table (a JSON object is expected, got "
                         f"{type(doc).__name__})")
    if doc.get("format") != TABLE_FORMAT:
        raise TableError(f"{where} is not a drafter-attn tuned table (format {doc.get('format')!r}, "
                         f"expected {TABLE_FORMAT!r})")
    if doc.get("version") != TABLE_VERSION:
        raise TableError(f"{where} is tuned-table version {doc.get('version')!r}, but this runtime "
                         f"reads version {TABLE_VERSION} only; export it again with a matching tuner")
    rules = doc.get("rules")
    if rules != RULES:
        raise TableError(f"{where} states bucket rules {rules!r}; this runtime applies {RULES!r}")
    return check_entries(doc.get("entries"), where)


def check_entries(entries, where: str = "<entries>") -> list[dict]:
    """Check tuned-table entries (the fields the runtime reads); raises TableError."""
    if not isinstance(entries, list):
        raise TableError(f"{where}: 'entries' must be a list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise TableError(f"{where}: entries[{i}] is not an object")
        for name, typ in _ENTRY_TYPES.items():
            if not isinstance(e.get(name), typ) or isinstance(e.get(name), bool):
                raise TableError(f"{where}: entries[{i}].{name} must be {typ.__name__}, got {e.get(name)!r}")
        for name in ("window", "page_size"):
            if e.get(name) is not None and not isinstance(e[name], int):
                raise TableError(f"{where}: entries[{i}].{name} must be an int or null, got {e[name]!r}")
        if not isinstance(e.get("median_us"), (int, float)) or not e["median_us"] > 0:
            raise TableError(f"{where}: entries[{i}].median_us must be a positive number")
        if not isinstance(e.get("alternatives", []), list):
            raise TableError(f"{where}: entries[{i}].alternatives must be a list")
    return entries


def load_entries(path, *, include_predicted: bool = False) -> tuple[list[dict], str]:
    """Entries of a tuned table (.json) or a profile database; returns (entries, source text).
    Raises TableError for a missing, corrupt or foreign file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise TableError(f"cannot read the tuned table {path}: {exc.strerror or exc}") from None
    if head.startswith(b"SQLite format 3\x00"):
        entries = select_entries(read_db_rows(path), include_predicted=include_predicted)
        return entries, f"profile database {path}"
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise TableError(f"{path} is neither a profile database nor a JSON tuned table: {exc}") from None
    entries = validate_table(doc, str(path))
    if not include_predicted:
        entries = [e for e in entries if _kind(e) != "predicted"]
    return entries, f"tuned table {path}"


def _kind(entry: dict) -> str:
    prov = entry.get("provenance")
    return (prov.get("kind") if isinstance(prov, dict) else None) or "measured"


# ---------------------------------------------------------------------------------------------
# Picks


@dataclass(frozen=True)
class Pick:
    """What to run for one problem, and why. `params` is read-only (picks are cached, shared)."""

    impl: str
    params: types.MappingProxyType
    tier: str  # one of TIERS
    reason: str
    source: str  # the table or database it came from, or "default heuristic"
    entry: dict | None = field(default=None, compare=False, repr=False)  # the table row behind it

    def as_dict(self) -> dict:
        return {"impl": self.impl, "params": dict(self.params), "tier": self.tier,
                "reason": self.reason, "source": self.source}


def _pick(impl, params, tier, reason, source, entry=None) -> Pick:
    return Pick(impl, types.MappingProxyType(dict(params)), tier, reason, source, entry)


def problem_key(problem: Problem, sm: int | None) -> tuple:
    g = problem.geometry
    return (sm, g.num_q_heads, g.num_kv_heads, g.head_dim, g.block_size, g.mask, g.window, g.dtype,
            problem.layout, problem.page_size, problem.batch, problem.ctx_len)


def _describe(key: tuple) -> str:
    sm, hq, hkv, d, qb, mask, window, dtype, layout, page, batch, ctx = key
    cache = f"page{page}" if layout == "paged" else "arena"
    m = mask if window is None else f"{mask}:{window}"
    return f"sm{sm} {hq}/{hkv}x{d} Qb={qb} {m} {dtype} {cache} B={batch} ctx={ctx}"


class Dispatcher:
    """An in-memory index of tuned entries, and the tiered pick over it."""

    def __init__(self, entries=(), *, source: str = "default heuristic",
                 include_predicted: bool = False):
        self.source = source
        entries = check_entries(list(entries), source)
        self.entries = [e for e in entries if include_predicted or _kind(e) != "predicted"]
        self._exact: dict[tuple, dict] = {}
        # shape -> sm -> (batch bucket, ctx bucket) -> entry
        self._shapes: dict[tuple, dict[int, dict[tuple, dict]]] = {}
        for e in self.entries:
            shape = tuple(e.get(f) for f in SHAPE_FIELDS)
            key = (e["sm"], *shape, e["batch"], e["ctx_len"])
            old = self._exact.get(key)
            if old is None or _rank(e) < _rank(old):
                self._exact[key] = e
            buckets = self._shapes.setdefault(shape, {}).setdefault(e["sm"], {})
            b = (bucket(e["batch"]), bucket(e["ctx_len"]))
            old = buckets.get(b)
            # within a bucket the point nearest its upper edge stands for it
            if old is None or (e["batch"], e["ctx_len"]) > (old["batch"], old["ctx_len"]) or (
                    (e["batch"], e["ctx_len"]) == (old["batch"], old["ctx_len"]) and _rank(e) < _rank(old)):
                buckets[b] = e
        self._cache: dict[tuple, Pick] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path, *, include_predicted: bool = False) -> Dispatcher:
        """Open a tuned table (.json) or a profile database; raises TableError when unusable."""
        entries, source = load_entries(path, include_predicted=include_predicted)
        return cls(entries, source=source, include_predicted=include_predicted)

    @property
    def sms(self) -> list[int]:
        return sorted({e["sm"] for e in self.entries})

    # -- picking ---------------------------------------------------------------------------
    def pick(self, problem: Problem, sm: int | None = None) -> Pick:
        """The implementation to run `problem` on SM `sm` (None: unknown GPU). Never raises."""
        try:
            key = problem_key(problem, sm)
        except Exception as exc:  # not a Problem
            return _pick("reference", {}, "default", f"not a problem ({exc}); the reference runs anything",
                         "default heuristic")
        return self.pick_key(key, problem)

    def pick_key(self, key: tuple, problem: Problem | None = None) -> Pick:
        """`pick` by key (sm, Hq, Hkv, D, Qb, mask, window, dtype, layout, page_size, batch,
        ctx_len); cached per key. Never raises."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        try:
            if problem is None:
                sm, hq, hkv, d, qb, mask, window, dtype, layout, page, batch, ctx = key
                problem = Problem(Geometry(hq, hkv, d, qb, mask, window, 1, dtype), layout, page,
                                  batch, ctx)
            result = self._pick(key, problem)
        except Exception as exc:  # a broken table row or backend: never fail a step
            try:
                result = default_pick(problem, note=f"picking failed ({type(exc).__name__}: {exc})")
            except Exception:
                result = _pick("reference", {}, "default",
                               f"picking failed ({type(exc).__name__}: {exc}); the reference runs anything",
                               "default heuristic")
        with self._lock:
            self._cache[key] = result
        return result

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def _pick(self, key: tuple, problem: Problem) -> Pick:
        sm = key[0]
        shape, batch, ctx = key[1:10], key[10], key[11]
        notes: list[str] = []
        tried: set[int] = set()
        if sm is None:
            return default_pick(problem, note="GPU unknown (no SM): the table is not consulted")
        # exact
        entry = self._exact.get(key)
        if entry is not None:
            p = self._usable(entry, problem, "exact", "measured at this exact problem", notes, tried)
            if p:
                return p
        else:
            notes.append("no exact entry")
        per_sm = self._shapes.get(shape, {})
        qb = (bucket(batch), bucket(ctx))
        # bucketed (the same SM)
        if sm in per_sm:
            p = self._from_buckets(per_sm[sm], qb, problem, "bucketed", f"sm{sm}", notes, tried)
            if p:
                return p
        else:
            notes.append(f"no sm{sm} entry of this shape")
        # family (other SMs of sm // 10, nearest SM first)
        kin = sorted((s for s in per_sm if s != sm and family(s) == family(sm)), key=lambda s: (abs(s - sm), s))
        for other in kin:
            p = self._from_buckets(per_sm[other], qb, problem, "family",
                                   f"sm{other} (family sm{family(sm)}x)", notes, tried)
            if p:
                return p
        if not kin:
            notes.append(f"no other SM of family sm{family(sm)}x with this shape")
        return default_pick(problem, note="; ".join(notes), source=self.source)

    def _from_buckets(self, buckets: dict, qb: tuple, problem, tier, where, notes, tried):
        entry = buckets.get(qb)
        if entry is not None:
            p = self._usable(entry, problem, tier,
                             f"{where}, same bucket batch<={qb[0]} ctx<={qb[1]} (measured at "
                             f"B={entry['batch']} ctx={entry['ctx_len']})", notes, tried)
            if p:
                return p
        order = sorted(buckets.items(), key=lambda kv: (abs(_log2(kv[0][0]) - _log2(qb[0]))
                                                         + abs(_log2(kv[0][1]) - _log2(qb[1])),
                                                         -kv[0][0], -kv[0][1]))
        for b, entry in order:
            if b == qb:
                continue
            p = self._usable(entry, problem, tier,
                             f"{where}, nearest measured bucket batch<={b[0]} ctx<={b[1]} (query "
                             f"bucket batch<={qb[0]} ctx<={qb[1]}; measured at B={entry['batch']} "
                             f"ctx={entry['ctx_len']})", notes, tried)
            if p:
                return p
        return None

    def _usable(self, entry: dict, problem: Problem, tier: str, why: str, notes: list, tried: set):
        if id(entry) in tried:
            return None
        tried.add(id(entry))
        choices = [(entry["impl"], entry["params"], entry.get("median_us"), "winner")]
        choices += [(a["impl"], a.get("params") or {}, a.get("median_us"), f"alternative {i + 1}")
                    for i, a in enumerate(entry.get("alternatives") or [])]
        for impl, params, median, rank in choices:
            reason = _supports(impl, params, problem)
            if reason is None:
                kind = _kind(entry)
                text = (f"{tier}: {why}; {rank} of {entry.get('candidates', len(choices))} "
                        f"candidates ({kind}, {median:.1f} us/step)" if median else f"{tier}: {why}")
                if notes:
                    text += f" [before: {'; '.join(notes)}]"
                return _pick(impl, params, tier, text, self.source, entry)
            notes.append(f"{tier} {impl}{_fmt(params)} skipped: {reason}")
        return None


def _rank(e: dict) -> tuple:
    return (_kind(e) != "measured", e.get("per_layer_us") or e["median_us"])


def _fmt(params) -> str:
    return "[" + ",".join(f"{k}={v}" for k, v in dict(params).items()) + "]" if params else ""


def _supports(impl: str, params, problem: Problem) -> str | None:
    """None when `impl` with `params` can run `problem`, else why not (never raises)."""
    from drafter_attn.kernels import registry

    try:
        return registry.get(impl).with_params(**dict(params)).supports(problem)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def default_pick(problem: Problem, note: str = "", source: str = "default heuristic") -> Pick:
    """The safe default: cupy at its default parameters where it supports the problem, else the
    torch reference (which runs everything)."""
    from drafter_attn.kernels import registry

    prefix = f"default: {note}; " if note else "default: "
    try:
        cupy = registry.get("cupy")
        reason = cupy.supports(problem)
        if reason is None:
            return _pick("cupy", cupy.default_params(problem), "default",
                         prefix + "cupy supports this problem (its default parameters)", source)
        why = f"cupy does not support it ({reason})"
    except Exception as exc:
        why = f"cupy is unavailable ({type(exc).__name__}: {exc})"
    return _pick("reference", {}, "default", prefix + why + "; the torch reference runs it", source)


# ---------------------------------------------------------------------------------------------
# The serving entry point


@dataclass
class _Bound:
    backend: object
    pick: Pick


class Runtime:
    """The four contract functions, each running the tuned kernel for its shapes.

        rt = Runtime("profiles/sm90.json")        # or a profile database, or None
        out = rt.paged_attention(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens,
                                 mask="full")

    `table`: a tuned table / profile database path, a Dispatcher, or None ($DRAFTER_TUNED_TABLE
    when set, else the default heuristic). An unreadable table warns once and falls back to the
    default heuristic. `sm`: the GPU's SM (default: read from the tensors' CUDA device once; CPU
    tensors without `sm` run the reference). `geometry`: the drafter geometry, when known, lets
    the context stores use the tuned pick from the first step; otherwise a store uses the
    backend of the last attention picked for the same cache (the default heuristic before one).

    Per call: a key from tensor shapes, dtypes and the device (no device reads), a dict lookup,
    then the backend's own function (which validates its inputs).
    """

    def __init__(self, table=None, *, sm: int | None = None, include_predicted: bool = False,
                 geometry: Geometry | None = None):
        self.sm = sm
        self.geometry = geometry
        self.table_error: TableError | None = None
        if table is None:
            table = os.environ.get("DRAFTER_TUNED_TABLE") or None
        if isinstance(table, Dispatcher):
            self.dispatcher = table
        elif table is None:
            self.dispatcher = Dispatcher()
        else:
            try:
                self.dispatcher = Dispatcher.load(table, include_predicted=include_predicted)
            except TableError as exc:
                self.table_error = exc
                msg = f"tuned table unusable, using the default heuristic: {exc}"
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                self.dispatcher = Dispatcher(source=f"default heuristic ({table} unusable)")
        self._bound: dict[tuple, _Bound] = {}
        self._cache_impl: dict[tuple, _Bound] = {}  # cache key -> last attention binding
        self._sm_of: dict[tuple, int | None] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # -- introspection ---------------------------------------------------------------------
    @property
    def picks(self) -> dict[tuple, Pick]:
        """Every pick made so far, by call key."""
        return {k: b.pick for k, b in self._bound.items()}

    # -- the contract ----------------------------------------------------------------------
    def paged_attention(self, q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *,
                        mask="full", window=None, scale=None):
        args = (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens)
        b = self._attention_binding("paged", args, mask, window, scale)
        return b.backend.paged_attention(*args, mask=mask, window=window, scale=scale)

    def arena_attention(self, q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *,
                        mask="full", window=None, scale=None):
        args = (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens)
        b = self._attention_binding("arena", args, mask, window, scale)
        return b.backend.arena_attention(*args, mask=mask, window=window, scale=scale)

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> None:
        b = self._store_binding("paged", k_new, k_pages, block_table,
                                (k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens))
        b.backend.store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens)

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> None:
        b = self._store_binding("arena", k_new, k_arena, slots,
                                (k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens))
        b.backend.store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens)

    # -- internals -------------------------------------------------------------------------
    def _device_sm(self, device) -> int | None:
        if self.sm is not None:
            return self.sm
        if device.type != "cuda":
            return None
        index = device.index
        k = (device.type, index)
        if k not in self._sm_of:
            import torch

            major, minor = torch.cuda.get_device_capability(index if index is not None
                                                            else torch.cuda.current_device())
            self._sm_of[k] = major * 10 + minor
        return self._sm_of[k]

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning(text)
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def _bind(self, pick: Pick) -> _Bound:
        from drafter_attn.kernels import registry

        try:
            return _Bound(registry.get(pick.impl).with_params(**dict(pick.params)), pick)
        except Exception as exc:
            self._warn_once(f"drafter_attn.kernels.dispatch: cannot build {pick.impl}{_fmt(pick.params)} "
                            f"({type(exc).__name__}: {exc}); using the torch reference")
            ref = _pick("reference", {}, "default",
                        f"{pick.impl} could not be built ({exc}); the torch reference runs it",
                        pick.source)
            return _Bound(registry.get("reference"), ref)

    def _choose(self, problem: Problem, device) -> Pick:
        sm = self._device_sm(device)
        if sm is None and device.type != "cuda":
            return _pick("reference", {}, "default",
                         f"default: tensors on {device.type} and no SM given; the torch reference runs them",
                         "default heuristic")
        pick = self.dispatcher.pick(problem, sm)
        if device.type != "cuda" and pick.tier == "default" and pick.impl != "reference":
            # the default heuristic's kernels need CUDA tensors
            pick = _pick("reference", {}, "default", f"{pick.reason}; but the tensors are on "
                         f"{device.type}: the torch reference runs them", pick.source)
        return pick

    def _attention_binding(self, layout, args, mask, window, scale) -> _Bound:
        """The bound pick for these shapes: a dict lookup after the first call. The key holds
        shapes only (the cache's capacity, never its contents); bad arguments get no key and
        reach the backend's own checks."""
        q, k_blk, _, k_cache, _, table, _ = args
        try:
            capacity = (k_cache.shape[2], table.shape[1]) if layout == "paged" else (k_cache.shape[1],)
            key = (layout, q.device, q.dtype, q.shape, k_blk.shape[2], *capacity, mask, window)
        except Exception:
            key = None
        b = self._bound.get(key) if key is not None else None
        return b if b is not None else self._bind_attention(key, layout, args, mask, window, scale)

    def _bind_attention(self, key, layout, args, mask, window, scale) -> _Bound:
        from drafter_attn.kernels import contract

        check = contract.check_paged if layout == "paged" else contract.check_arena
        dims = check(*args, mask, window, scale)  # a bad input: ValueError naming the argument
        q = args[0]
        problem = Problem(Geometry(dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size,
                                   dims.mask, dims.window, 1, str(dims.dtype).removeprefix("torch.")),
                          layout, dims.page_size, dims.batch, dims.capacity)
        b = self._bind(self._choose(problem, q.device))
        with self._lock:
            if key is not None:
                self._bound[key] = b
            self._cache_impl[(layout, q.device, q.dtype, dims.num_kv_heads, dims.head_dim,
                              dims.page_size)] = b
        return b

    def _store_binding(self, layout, k_new, cache, table, args) -> _Bound:
        try:
            page = cache.shape[2] if layout == "paged" else None
            ckey = (layout, k_new.device, k_new.dtype, k_new.shape[2], k_new.shape[3], page)
            key = ("store", *ckey, k_new.shape[0],
                   table.shape[1] * page if layout == "paged" else cache.shape[1])
        except Exception:
            ckey = key = None
        if key is not None and self.geometry is None:
            b = self._cache_impl.get(ckey)  # follow the attention picked for this cache
            if b is not None:
                return b
        b = self._bound.get(key) if key is not None else None
        if b is not None:
            return b
        from drafter_attn.kernels import contract

        check = contract.check_store_paged if layout == "paged" else contract.check_store_arena
        dims = check(*args)
        g = self.geometry
        if g is not None and (g.num_kv_heads, g.head_dim) == (dims.num_kv_heads, dims.head_dim):
            g = g.with_(num_layers=1, dtype=str(dims.dtype).removeprefix("torch."))
        else:  # the cache's own geometry: one query head per KV head, one-row blocks
            g = Geometry(dims.num_kv_heads, dims.num_kv_heads, dims.head_dim, 1,
                         dtype=str(dims.dtype).removeprefix("torch."))
        problem = Problem(g, layout, dims.page_size, dims.batch, dims.capacity)
        b = self._bind(self._choose(problem, k_new.device))
        if key is not None:
            with self._lock:
                self._bound[key] = b
        return b
