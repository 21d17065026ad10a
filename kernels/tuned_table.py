"""The tuned-table model: typed entries, and loading a tuned table (JSON) or a profile database.

A tuned table is what `tuner export` writes and the runtime reads. Every entry becomes a frozen
`Entry` once, at load: its fields are type-checked, `per_layer_us` is computed there (step latency
over the layer count), and it is compared with the environment it will run in (GPU, kernel
sources, library versions). An entry that fails any check is left out with one warning per load
that says why; only a file that is not a tuned table at all raises `TableError`.

Tuned-table JSON (format "drafter-attn-tuned-table", version 1)::

    {"format": "drafter-attn-tuned-table", "version": 1, "created_at": ISO-8601,
     "source": {...where it came from: database, exporting commit, SMs, predicted included...},
     "metric": "per_layer_us", "rules": RULES,
     "gpu_classes": {"hopper-141g": ["NVIDIA H200", "NVIDIA H200 NVL"]},   # optional
     "entries": [{"sm": 90, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                  "block_size": 16, "mask": "full", "window": null, "dtype": "bfloat16",
                  "layout": "paged", "page_size": 64, "batch": 8, "ctx_len": 8192,
                  "bucket": {"batch": 8, "ctx_len": 8192},
                  "impl": "cupy", "params": {...}, "median_us": 61.2, "num_layers": 5,
                  "per_layer_us": 12.24, "attention_median_us": ..., "store_median_us": ...,
                  "syncs": 0, "graph_capturable": true, "kv_bytes": ..., "workspace_bytes": ...,
                  "candidates": 2,
                  "alternatives": [{"impl": ..., "params": {...}, "median_us": ..., "per_layer_us": ...}],
                  "provenance": {"kind": "measured", "regime": "burst", "sustain_s": null,
                                 "sustain_load": null, "sweep": ..., "date": ..., "gpu": ...,
                                 "driver": ..., "cuda": ..., "sources_hash": ...,
                                 "versions": {"torch": ..., "cupy": ..., "cutlass": ..., "nvrtc": ...},
                                 "commit": ..., "env_id": ..., "preset": ...}}, ...]}

`provenance.regime` is the clock regime its winner was timed in (REGIMES: "burst", or
"sustained" after `sustain_s` seconds of load, `sustain_load` saying whose: SUSTAIN_LOADS); a
table exported for the sustained regime (`source.regime`) holds sustained winners where its
database measured the key sustained.
`provenance.gpu` is a GPU name, or the name of a class in `gpu_classes`: an entry measured on one
GPU of a class is used on every GPU of that class, and on no other GPU.

This module must not import `tuner`: it reads the few profile-database columns it needs itself,
named in one place (`DB_ROWS_SQL`); `tuner export` writes through `select_entries`/`make_table`.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sqlite3
import types
import urllib.parse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

TABLE_FORMAT = "drafter-attn-tuned-table"
TABLE_VERSION = 1
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

# The profile database, as far as the runtime reads it (tuner/db.py owns the schema; a test
# checks these names against it).
DB_SCHEMA_NAME = "drafter-attn-profile"
DB_SCHEMA_VERSION = 5
# versions 2 and 3 only added columns this runtime does not read; before 4 (`sustain_s`) every row
# is a burst's, before 5 (`sustain_load`) every sustained row the step's own load's
DB_READS_VERSIONS = ("1", "2", "3", "4", "5")
SHAPE_FIELDS = ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "mask", "window", "dtype",
                "layout", "page_size")
VERSION_FIELDS = ("torch", "cupy", "cutlass", "nvrtc")
# The host-sync detector layers of a result row (tuner.syncs): debug mode, profiler, Nsight Systems.
SYNC_COLUMNS = ("syncs_debug", "syncs_profiler", "syncs_nsys")
DB_ROWS_SQL = """
SELECT e.sm, e.gpu_name, e.driver, e.cuda, e.torch, e.cupy, e.cutlass, e.nvrtc, e.sources_hash,
       r.env_id, r.preset,
       r.num_q_heads, r.num_kv_heads, r.head_dim, r.block_size, r.mask, r.window, r.dtype,
       r.layout, r.page_size, r.batch, r.ctx_len, r.num_layers, r.impl, r.params, r.provenance,
       r.median_us, r.attention_median_us, r.store_median_us, r.syncs_debug, r.syncs_profiler,
       r.syncs_nsys, r.graph_capturable, r.kv_bytes, r.workspace_bytes, r.sweep_id, r.created_at,
       r.sustain_s, r.sustain_load, r.id AS row_order
FROM results r JOIN environments e USING (env_id)
WHERE r.status = 'ok' AND r.median_us IS NOT NULL AND r.median_us > 0
  AND (r.accepted IS NULL OR r.accepted = r.block_size)
"""
# (`accepted`: a decode step that stores the whole block, as sweeps time it. `bench decode
# --accepted` steps store fewer rows and `bench prefill`'s context steps a chunk: other workloads,
# which the problem key does not tell apart, so they never compete for a key.)
# The clock regimes a row is timed in. "burst": on a cool GPU (each timing right after the last);
# "sustained": after seconds of the step's own back-to-back load (the profile database's
# `sustain_s`), where the H200 holds its power limit by lowering its SM clock and some kernels slow
# with it. A burst table decides each key on burst rows only; a sustained one on the key's
# sustained rows where it has any, else on its burst rows (a call too light to bring the clock
# down times the same either way, and is not measured twice).
REGIMES = ("burst", "sustained")
REGIME_ENV = "DRAFTER_REGIME"
# What holds a sustained timing's state: "self", the step's own back-to-back load (which brings
# only heavy calls to the power limit), or "gemm", a co-runner's matmuls for the same seconds
# and then between every timed replay: the target model's load a drafter runs between, which
# holds the GPU at its power limit whatever the drafter's own draw (results/perf-notes.md, "The
# picks under a target model's load"). Where a key has co-load rows, they alone decide it in
# the sustained regime (the defined state); its own-load rows otherwise.
SUSTAIN_LOADS = ("self", "gemm")
# A sustained key keeps its burst winner unless another candidate's sustained row beats that
# winner's own sustained row by more than this share. Two sustained timings of one kernel at
# one key differ by 3-8% on the H200 (the clock state keeps moving), where bursts differ by 1-2%
# (TIE_MARGIN): a smaller lead is not reliably there (results/perf-notes.md, "Tables per clock
# regime").
SUSTAINED_MARGIN = 0.05
# The load before each sustained timing, by default: on the H200 the SM clock settles at its
# power-capped level within it (results/perf-notes.md, "The SM clock under the power limit").
SUSTAIN_S = 0.75
# JSON nesting deeper than this is not a tuned table (and would overflow the parser's stack).
MAX_JSON_DEPTH = 64


class TableError(RuntimeError):
    """A tuned table or profile database the runtime cannot use (missing, corrupt, foreign)."""


class EntryError(ValueError):
    """One entry (or database row) the runtime cannot use; the message names the field."""


def bucket(x: int) -> int:
    """Smallest power of two >= x; 0 stays 0."""
    return 0 if x <= 0 else 1 << (int(x) - 1).bit_length()


def family(sm: int) -> int:
    return sm // 10


# ---------------------------------------------------------------------------------------------
# The one ranking: measured before predicted, then step latency per layer (presets differ in
# layer count, so whole steps never compare). The runtime, export, diff and auto all use it.


def per_layer_us(median_us: float, num_layers) -> float:
    return median_us / (num_layers or 1)


def rank_key(kind: str, per_layer: float) -> tuple:
    return (kind != "measured", per_layer)


# A candidate that is not its backend's default parameter set wins a key only by more than this
# share of the default's time per layer. One candidate's run-to-run spread on the H200 is
# 0.2% (median) and 0.9-1.2% (p90), up to 5% (`tuner repeat` of two sweep pairs,
# results/sm90-2026-11-30/repeatability/ and sm90-2026-12-01/repeatability/): a lead under 2%
# is not reliably there in a second run (at 1%, 5 of 36 keys flipped between two runs), and the
# default is the kernel every test runs.
TIE_MARGIN = 0.02


def is_default(row: dict) -> bool:
    """Whether a (clean) row's params are its backend's defaults for its problem on its SM
    (kernels.cupy_backend.SM_BUDGETS; a knob the row does not name counts as its default);
    False when the backend or problem cannot be built."""
    from drafter_attn.kernels import registry
    from drafter_attn.kernels.spec import Geometry, Problem

    try:
        geometry = Geometry(*(row[f] for f in ("num_q_heads", "num_kv_heads", "head_dim",
                                               "block_size", "mask", "window")),
                            dtype=row["dtype"])
        problem = Problem(geometry, row["layout"], row["page_size"], row["batch"], row["ctx_len"])
        defaults = registry.default_params(registry.get(row["impl"]), problem, row.get("sm"))
    except Exception:  # an impl not installed here, a problem this code cannot describe
        return False
    return all(row["params"].get(k, v) == v for k, v in defaults.items())


def rank_rows(rows: list[dict]) -> list[dict]:
    """One key's (clean) rows, best first: by `rank_key`, except that the best row's backend
    with its default params comes first when it is within TIE_MARGIN of the best."""
    ranked = sorted(rows, key=_row_rank)
    if not ranked or is_default(ranked[0]):
        return ranked
    best = ranked[0]
    kind = best.get("provenance") or "measured"
    for i, row in enumerate(ranked[1:], 1):
        if row["per_layer_us"] > best["per_layer_us"] * (1 + TIE_MARGIN):
            break
        if row["impl"] == best["impl"] and (row.get("provenance") or "measured") == kind \
                and is_default(row):
            return [row, *ranked[:i], *ranked[i + 1:]]
    return ranked


# ---------------------------------------------------------------------------------------------
# Typed entries


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise EntryError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _typed(value, typ, name: str, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, typ):
        kind = typ.__name__ + (" or null" if optional else "")
        raise EntryError(f"{name} must be {kind}, got {value!r}")
    return value


def _params_of(value, name: str = "params") -> dict:
    """Parameters as a dict: a mapping, or (a database column) JSON text of an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise EntryError(f"{name} is not JSON: {str(exc)[:80]}") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise EntryError(f"{name} must be an object, got {value!r}")
    return dict(value)


def _ro(d: dict) -> types.MappingProxyType:
    return types.MappingProxyType(dict(d))


@dataclass(frozen=True)
class Candidate:
    """An implementation with its parameters and its measured step latency."""

    impl: str
    params: types.MappingProxyType
    median_us: float
    per_layer_us: float

    @classmethod
    def parse(cls, d, num_layers, where: str) -> Candidate:
        if not isinstance(d, Mapping):
            raise EntryError(f"{where} must be an object")
        median = _number(d.get("median_us"), f"{where}.median_us")
        return cls(_typed(d.get("impl"), str, f"{where}.impl"),
                   _ro(_params_of(d.get("params"), f"{where}.params")), median,
                   per_layer_us(median, num_layers))


_INT_FIELDS = ("sm", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "batch", "ctx_len")


def _check_problem(d: Mapping, where: str) -> dict:
    """The problem fields of an entry or a database row, type-checked (SQLite columns take any
    type); returns the integer ones."""
    ints = {f: _typed(d.get(f), int, f"{where}{f}") for f in _INT_FIELDS}
    for f in ("mask", "dtype", "layout"):
        _typed(d.get(f), str, f"{where}{f}")
    for f in ("window", "page_size"):
        _typed(d.get(f), int, f"{where}{f}", optional=True)
    return ints


@dataclass(frozen=True, eq=False)
class Entry(Mapping):
    """One tuned entry, checked and typed once. It also reads as the JSON object it came from
    (`entry["batch"]`, `entry.get("provenance")`), with `per_layer_us` the computed value."""

    sm: int
    shape: tuple  # values of SHAPE_FIELDS
    batch: int
    ctx_len: int
    winner: Candidate
    alternatives: tuple  # of Candidate, ranked
    num_layers: int
    kind: str  # "measured" or "predicted"
    doc: types.MappingProxyType

    @classmethod
    def parse(cls, d, where: str = "entry") -> Entry:
        """The typed entry of JSON object `d`; EntryError naming the field when it is unusable."""
        if not isinstance(d, Mapping):
            raise EntryError(f"{where} is not an object")
        ints = _check_problem(d, f"{where}.")
        layers = _typed(d.get("num_layers", 1), int, f"{where}.num_layers", optional=True) or 1
        winner = Candidate.parse(d, layers, where)
        stored = d.get("per_layer_us")
        if stored is not None and not math.isclose(_number(stored, f"{where}.per_layer_us"),
                                                    winner.per_layer_us, rel_tol=1e-6):
            raise EntryError(f"{where}.per_layer_us {stored!r} is not median_us / num_layers "
                             f"({winner.per_layer_us:.6g})")
        alts = d.get("alternatives") or []
        if not isinstance(alts, list):
            raise EntryError(f"{where}.alternatives must be a list")
        prov = d.get("provenance")
        if prov is not None and not isinstance(prov, Mapping):
            raise EntryError(f"{where}.provenance must be an object")
        kind = (prov or {}).get("kind") or "measured"
        if kind not in ("measured", "predicted"):
            raise EntryError(f"{where}.provenance.kind must be measured or predicted, got {kind!r}")
        doc = {**d, "per_layer_us": winner.per_layer_us}
        return cls(ints["sm"], tuple(d.get(f) for f in SHAPE_FIELDS), ints["batch"], ints["ctx_len"],
                   winner, tuple(Candidate.parse(a, layers, f"{where}.alternatives[{i}]")
                                 for i, a in enumerate(alts)),
                   layers, kind, _ro(doc))

    # -- derived ----------------------------------------------------------------------------
    @property
    def key(self) -> tuple:
        return (self.sm, *self.shape, self.batch, self.ctx_len)

    @property
    def buckets(self) -> tuple:
        return (bucket(self.batch), bucket(self.ctx_len))

    @property
    def per_layer_us(self) -> float:
        return self.winner.per_layer_us

    @property
    def rank(self) -> tuple:
        return rank_key(self.kind, self.winner.per_layer_us)

    @property
    def candidates(self) -> tuple:
        return (self.winner, *self.alternatives)

    @property
    def provenance(self) -> Mapping:
        return self.doc.get("provenance") or {}

    # -- the JSON object it came from ------------------------------------------------------
    def __getitem__(self, name):
        return self.doc[name]

    def __iter__(self):
        return iter(self.doc)

    def __len__(self) -> int:
        return len(self.doc)


# ---------------------------------------------------------------------------------------------
# Database rows -> entries (shared by the runtime's database reader and `tuner export`)


def sync_count(row) -> int | None:
    """Blocking host waits per step of a result row (a dict, or anything with `.get`): the most
    any detector layer saw (`SYNC_COLUMNS`); None when none measured (NULL or NaN everywhere).
    The one rule: the runtime's entries, `tuner show`, `bench decode` and tuner.syncs use it."""
    vals = [row.get(k) for k in SYNC_COLUMNS]
    vals = [v for v in vals if v is not None and v == v]  # NaN (a pandas NULL) != NaN
    return max(vals) if vals else None


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def row_regime(row: Mapping) -> str:
    """The regime a result row was timed in (REGIMES)."""
    return "sustained" if (row.get("sustain_s") or 0) > 0 else "burst"


def row_load(row: Mapping) -> str | None:
    """What held a sustained row's state (SUSTAIN_LOADS); None for a burst row."""
    if row_regime(row) == "burst":
        return None
    return row.get("sustain_load") or "self"


def check_sustain_load(load: str) -> str:
    if load not in SUSTAIN_LOADS:
        raise ValueError(f"sustain load {load!r} is not one of {', '.join(SUSTAIN_LOADS)}")
    return load


def check_regime(regime: str) -> str:
    if regime not in REGIMES:
        raise ValueError(f"regime {regime!r} is not one of {', '.join(REGIMES)}")
    return regime


def default_regime() -> str:
    """$DRAFTER_REGIME when it names a regime, else "burst" (an unknown value warns once a
    process: the runtime never fails a serving step over it)."""
    value = os.environ.get(REGIME_ENV, "").strip()
    if not value:
        return "burst"
    if value not in REGIMES:
        warnings.warn(f"${REGIME_ENV}={value!r} is not one of {', '.join(REGIMES)}; using burst",
                      RuntimeWarning, stacklevel=2)
        return "burst"
    return value


def _age(row: dict) -> tuple:
    # Timestamps have millisecond resolution, so two rows of one sweep can tie: the later
    # insert (higher id) breaks the tie.
    return (str(row.get("created_at") or ""), row.get("row_order") or 0)


def _row_rank(row: dict) -> tuple:
    return rank_key(row.get("provenance") or "measured", row["per_layer_us"])


def _clean_row(row: dict) -> dict:
    """A result row with its params parsed and its per-layer latency; EntryError when unusable."""
    _check_problem(row, "")
    out = dict(row)
    out["params"] = _params_of(row.get("params"))
    layers = _typed(row.get("num_layers"), int, "num_layers", optional=True)
    out["per_layer_us"] = per_layer_us(_number(row.get("median_us"), "median_us"), layers)
    _typed(row.get("impl"), str, "impl")
    return out


def _entry_of(ranked: list[dict]) -> dict:
    best = ranked[0]
    layers = best.get("num_layers") or 1
    return {"sm": best["sm"], **{f: best[f] for f in SHAPE_FIELDS},
            "batch": best["batch"], "ctx_len": best["ctx_len"],
            "bucket": {"batch": bucket(best["batch"]), "ctx_len": bucket(best["ctx_len"])},
            "impl": best["impl"], "params": best["params"],
            "median_us": best["median_us"], "num_layers": layers, "per_layer_us": best["per_layer_us"],
            "attention_median_us": best.get("attention_median_us"),
            "store_median_us": best.get("store_median_us"),
            "syncs": sync_count(best),
            "graph_capturable": None if best.get("graph_capturable") is None
            else bool(best["graph_capturable"]),
            "kv_bytes": best.get("kv_bytes"), "workspace_bytes": best.get("workspace_bytes"),
            "candidates": len(ranked),
            "alternatives": [{"impl": r["impl"], "params": r["params"], "median_us": r["median_us"],
                              "per_layer_us": r["per_layer_us"]}
                             for r in ranked[1:1 + MAX_ALTERNATIVES]],
            "provenance": {"kind": best.get("provenance") or "measured",
                           "regime": row_regime(best), "sustain_s": best.get("sustain_s") or None,
                           "sustain_load": row_load(best),
                           "sweep": best.get("sweep_id"), "date": best.get("created_at"),
                           "gpu": best.get("gpu_name"), "driver": best.get("driver"),
                           "cuda": best.get("cuda"), "sources_hash": best.get("sources_hash"),
                           "versions": {v: best.get(v) for v in VERSION_FIELDS},
                           "commit": None, "env_id": best.get("env_id"),
                           "preset": best.get("preset")}}


def row_key(row: dict) -> tuple:
    """The key of a (clean) result row: the key of the entry it competes for."""
    return (row["sm"], *(row[f] for f in SHAPE_FIELDS), row["batch"], row["ctx_len"])


def candidate_of(row: dict) -> tuple:
    """What competes within a key: (impl, canonical params JSON, provenance kind)."""
    return (row["impl"], _canonical(row["params"]), row.get("provenance") or "measured")


def group_rows(rows, *, include_predicted: bool = False, where: str = "profile database",
               regime: str = "burst") -> dict[tuple, list[dict]]:
    """Result rows (dicts with at least the columns of `DB_ROWS_SQL`) by key (`row_key`), each
    key's candidates ranked by `rank_key`: the newest row of each candidate (`candidate_of`)
    counts, with its params parsed and its `per_layer_us`. Predicted rows are left out unless
    `include_predicted`. Rows of a reference-only backend (`registry.reference_only`, e.g.
    `reference-syncing`) are never candidates. `rank_rows` orders each key. Rows that cannot be read (params that are not
    JSON, a latency that is not a number) are left out with one warning. Keys come in sorted
    order. `regime` (REGIMES): which timings compete; a sustained key without sustained rows
    is decided on its burst rows, and one with them keeps its burst winner unless another
    candidate leads it there by more than SUSTAINED_MARGIN. Of a key's sustained rows, those
    under a co-runner's load (`row_load` "gemm") alone compete where there are any."""
    from drafter_attn.kernels import registry

    check_regime(regime)
    groups: dict[tuple, dict[tuple, dict]] = {}
    fallback: dict[tuple, dict[tuple, dict]] = {}  # sustained: each key's burst rows
    skipped: list[tuple[str, str]] = []
    for i, raw in enumerate(rows):
        kind = raw.get("provenance") or "measured"
        if kind == "predicted" and not include_predicted:
            continue
        if isinstance(raw.get("impl"), str) and registry.reference_only(raw["impl"]):
            continue  # measured to compare against (e.g. reference-syncing), never a candidate
        try:
            row = _clean_row(raw)
            key = row_key(row)
        except (EntryError, KeyError) as exc:
            skipped.append((f"row {raw.get('row_order', i)}", str(exc)))
            continue
        if row_regime(row) != regime:
            if regime == "burst":
                continue  # a sustained timing never decides a burst key
            seen = fallback.setdefault(key, {})
        else:
            seen = groups.setdefault(key, {})
        # a candidate's rows under each load, and of each layer count, apart
        cand = (row_load(row), candidate_of(row), row.get("num_layers") or 1)
        old = seen.get(cand)
        if old is None or _age(row) >= _age(old):
            seen[cand] = row
    warn_skipped(where, "rows", skipped, stacklevel=4)
    out = {}
    for key in sorted(groups.keys() | fallback.keys(), key=lambda k: tuple(-1 if v is None else v for v in k)):
        if key in fallback:
            fallback[key] = _most_layers(_under_one_load(fallback[key]))
        if key not in groups:  # sustained, never measured so: its burst rows decide
            out[key] = rank_rows(list(fallback[key].values()))
            continue
        groups[key] = _most_layers(_under_one_load(groups[key]))
        out[key] = rank_rows(list(groups[key].values()))
        if key in fallback:
            out[key] = _keep_burst_winner(out[key], groups[key], rank_rows(list(fallback[key].values()))[0])
    return out


def _most_layers(rows: dict) -> dict:
    """A key's rows, keyed (candidate, layers), as {candidate: row} of its steps of the most
    layers. A step's fixed cost (its launch, the graph's start) is spread over its layers, so
    per-layer times of steps of different layer counts do not compare: a one-layer row
    (`bench.attention_table` records them) would rank a candidate behind the same kernel's
    whole-step rows. The most layers are the closest to a deployment's step."""
    most = max(layers for _, layers in rows)
    return {c: r for (c, layers), r in rows.items() if layers == most}


def _under_one_load(rows: dict) -> dict:
    """A key's competing rows, keyed (load, candidate, layers), as {(candidate, layers): row}
    under one load: for sustained rows the co-runner's where any candidate was timed so, else
    the step's own (burst rows have no load)."""
    loads = {load for load, _, _ in rows}
    keep = "gemm" if "gemm" in loads else ("self" if "self" in loads else None)
    return {(c, layers): r for (load, c, layers), r in rows.items() if load == keep}


def _keep_burst_winner(ranked: list[dict], sustained: dict, burst_winner: dict) -> list[dict]:
    """A sustained key's ranking with the burst winner's sustained row first unless the best
    sustained row leads it by more than SUSTAINED_MARGIN."""
    own = sustained.get(candidate_of(burst_winner))
    if own is None or own is ranked[0] or own["per_layer_us"] > ranked[0]["per_layer_us"] * (1 + SUSTAINED_MARGIN):
        return ranked
    return [own, *(r for r in ranked if r is not own)]


def gpu_group(gpu: str | None, classes: Mapping | None) -> str | None:
    """The class of `classes` ({class: [GPU names]}) that holds `gpu` (or is it), else `gpu`:
    the GPUs whose measurements decide one set of keys."""
    return next((name for name, members in (classes or {}).items()
                 if gpu == name or gpu in members), gpu)


def select_entries(rows, *, include_predicted: bool = False, where: str = "profile database",
                   regime: str = "burst", gpu_classes: Mapping | None = None) -> list[dict]:
    """Winners per (SM, shape, batch, context) from result rows (`group_rows`, in `regime`), as
    tuned-table entries: the best candidate with up to MAX_ALTERNATIVES runners-up. Each GPU's
    rows (or a class's, where `gpu_classes` puts it in one) decide its own entries: an entry is
    used only on the GPU it was measured on, so another GPU's faster row must not take the key."""
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(str(gpu_group(r.get("gpu_name"), gpu_classes)), []).append(r)
    return [_entry_of(ranked) for group in groups.values() for ranked in
            group_rows(group, include_predicted=include_predicted, where=where, regime=regime).values()]


def make_table(entries: list, source: dict | None = None, created_at: str | None = None,
               gpu_classes: dict | None = None) -> dict:
    """A tuned table (the JSON document `tuner export` writes) around `entries`."""
    import datetime as _dt

    doc = {"format": TABLE_FORMAT, "version": TABLE_VERSION,
           "created_at": created_at or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "source": dict(source or {}), "metric": "per_layer_us", "rules": dict(RULES),
           "entries": [dict(e) for e in entries]}
    if gpu_classes:
        doc["gpu_classes"] = {k: list(v) for k, v in gpu_classes.items()}
    return doc


# ---------------------------------------------------------------------------------------------
# The environment an entry runs in; an entry measured elsewhere is a miss


@dataclass(frozen=True)
class Environment:
    """What a tuned entry is compared with at load. None: unknown here, not compared."""

    gpu_name: str | None = None
    sources_hash: str | None = None
    versions: Mapping = field(default_factory=lambda: types.MappingProxyType({}))


def current_environment() -> Environment:
    """This process: the current CUDA GPU's name (None without one), the hash of the kernel
    sources and the versions of the libraries that build the kernels. Never raises."""
    from importlib import metadata

    from drafter_attn.kernels import nvrtc

    def attempt(fn):
        try:
            return fn()
        except Exception:
            return None

    def gpu():
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None

    versions = {"nvrtc": attempt(lambda: ".".join(map(str, nvrtc.nvrtc_version()))),
                "cutlass": attempt(lambda: metadata.version("nvidia-cutlass"))}
    return Environment(attempt(gpu), attempt(nvrtc.sources_digest), _ro(versions))


def gpu_matches(recorded, gpu: str, classes: Mapping) -> bool:
    """`recorded` (a GPU name or a class of `classes`) covers `gpu`."""
    if recorded == gpu:
        return True
    return any(gpu in members and (recorded == name or recorded in members)
               for name, members in classes.items())


def _versions_checked(impls: set) -> tuple:
    if impls <= {"reference"}:
        return ()  # the torch reference compiles nothing
    return ("nvrtc", "cutlass") if "cutlass" in impls else ("nvrtc",)


def mismatch(entry: Entry, env: Environment, classes: Mapping) -> str | None:
    """Why `entry` does not belong to `env` (field, expected and found), or None."""
    return _mismatch(entry.provenance, {c.impl for c in entry.candidates}, env, classes)


def row_mismatch(row: Mapping, env: Environment) -> str | None:
    """Why a profile database's result row was not measured where `env` runs (as `mismatch`)."""
    prov = {"gpu": row.get("gpu_name"), "sources_hash": row.get("sources_hash"),
            "versions": {v: row.get(v) for v in VERSION_FIELDS}}
    return _mismatch(prov, {row.get("impl")}, env, {})


def _mismatch(prov: Mapping, impls: set, env: Environment, classes: Mapping) -> str | None:
    if env.gpu_name is not None and not gpu_matches(prov.get("gpu"), env.gpu_name, classes):
        return (f"gpu: expected {env.gpu_name!r} (or a gpu_classes entry listing it), "
                f"found {prov.get('gpu')!r}")
    checked = _versions_checked(impls)
    found = prov.get("sources_hash")
    if checked and env.sources_hash is not None and found != env.sources_hash:
        short = lambda h: h[:12] if isinstance(h, str) else h  # noqa: E731 (hashes are long)
        return (f"sources_hash: expected {short(env.sources_hash)!r} (these kernel sources), "
                f"found {short(found)!r}")
    recorded = prov.get("versions") if isinstance(prov.get("versions"), Mapping) else {}
    for lib in checked:
        want, found = env.versions.get(lib), recorded.get(lib)
        # NVRTC: the same major version compiles the same sources to close code (a pip install
        # resolves the newest 13.x while a GPU machine keeps its toolkit's): used, and said so
        # (`nvrtc_drift`); CUTLASS's headers are part of the code, so its version must match
        same = _major(found) == _major(want) if lib == "nvrtc" else found == want
        if want is not None and not same:
            return f"{lib} version: expected {want!r}, found {found!r}"
    return None


def _major(version) -> str | None:
    return str(version).split(".")[0] if version else None


def nvrtc_drift(entry: Entry, env: Environment) -> tuple[str, str] | None:
    """(measured, here) when `entry` was measured with another minor NVRTC version than this
    process compiles with (a matching entry otherwise), else None."""
    if not _versions_checked({c.impl for c in entry.candidates}):
        return None
    versions = entry.provenance.get("versions")
    found = versions.get("nvrtc") if isinstance(versions, Mapping) else None
    want = env.versions.get("nvrtc")
    return (found, want) if want is not None and found != want else None


# ---------------------------------------------------------------------------------------------
# Loading


def unreplayed_wal(path: Path, error: type) -> None:
    """Raise `error` when `path` has rows in its write-ahead log (`-wal` beside it: a writer that
    died, or one still writing) that an immutable open, which reads the main file only, would
    silently leave out."""
    wal = Path(f"{path}-wal")
    if wal.is_file() and wal.stat().st_size > 0:
        raise error(f"{path}: its write-ahead log {wal.name} holds writes a read-only open cannot "
                    f"read here (no write access to make its -shm file); open the database once "
                    f"where it can be written (e.g. `tuner show --db` on a writable copy of both "
                    f"files) to fold them in")


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """Read-only, without writing a journal: a WAL database on read-only storage (an installed
    package) cannot create its shared-memory file, so it is opened immutable instead."""
    base = "file:" + urllib.parse.quote(str(path.resolve()))
    try:
        conn = sqlite3.connect(base + "?mode=ro", uri=True, timeout=10)
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.Error:
        pass
    unreplayed_wal(path, TableError)  # what an immutable open would not read
    try:
        return sqlite3.connect(base + "?mode=ro&immutable=1", uri=True, timeout=10)
    except sqlite3.Error as exc:
        raise TableError(f"{path}: cannot open the profile database read-only: {exc}") from exc


def read_db_rows(path) -> list[dict]:
    """The result rows the runtime needs, read from a profile database opened read-only."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"no profile database at {path}")
    conn = _connect_read_only(path)
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
                             f"this runtime reads versions {', '.join(DB_READS_VERSIONS)}; export a tuned "
                             f"table with a matching tuner")
        have = {r[1] for r in conn.execute("PRAGMA table_info(results)")}
        sql = DB_ROWS_SQL
        for col in ("sustain_s", "sustain_load"):  # columns of schemas 4 and 5
            if col not in have:
                sql = sql.replace(f"r.{col}", f"NULL AS {col}")
        return [dict(r) for r in conn.execute(sql)]
    except sqlite3.Error as exc:
        raise TableError(f"{path} is not a readable profile database: {exc}") from exc
    finally:
        conn.close()


def parse_json(text, where: str, is_not: str = "not a JSON tuned table"):
    """A JSON document; TableError (never RecursionError) for text that is not one."""
    try:
        return json.loads(text)
    except RecursionError:
        raise TableError(f"{where} is {is_not}: its JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise TableError(f"{where} is {is_not}: {exc}") from None


def _check_gpu_classes(value, where: str) -> dict:
    if value is None:
        return {}
    ok = isinstance(value, dict) and all(
        isinstance(v, list) and all(isinstance(g, str) for g in v) for v in value.values())
    if not ok:
        raise TableError(f"{where}: gpu_classes must map class names to lists of GPU names")
    return value


def validate_table(doc, where: str = "<table>") -> list:
    """Check a tuned-table document (format, version, rules, gpu_classes); returns its raw
    entries. Raises TableError naming the problem; entries themselves are checked by `parse`."""
    if not isinstance(doc, dict):
        raise TableError(f"{where} is not a tuned table (a JSON object is expected, got "
                         f"{type(doc).__name__})")
    if doc.get("format") != TABLE_FORMAT:
        raise TableError(f"{where} is not a drafter-attn tuned table (format {doc.get('format')!r}, "
                         f"expected {TABLE_FORMAT!r})")
    version = doc.get("version")
    if isinstance(version, bool) or version != TABLE_VERSION:  # true == 1 in Python: not a version
        raise TableError(f"{where} is tuned-table version {version!r}, but this runtime "
                         f"reads version {TABLE_VERSION} only; export it again with a matching tuner")
    rules = doc.get("rules")
    if rules != RULES:
        raise TableError(f"{where} states bucket rules {rules!r}; this runtime applies {RULES!r}")
    _check_gpu_classes(doc.get("gpu_classes"), where)
    if not isinstance(doc.get("entries"), list):
        raise TableError(f"{where}: 'entries' must be a list")
    return doc["entries"]


def _backend_problem(entry: Entry) -> str | None:
    """Why the entry's implementations cannot be built as recorded (unknown backend, unknown
    or out-of-range parameters), or None. Unavailable backends are left to the pick."""
    from drafter_attn.kernels import registry

    for c in entry.candidates:
        if c.impl not in registry.names():
            return f"unknown backend {c.impl!r} (known: {', '.join(registry.names())})"
        if registry.reference_only(c.impl):
            return f"backend {c.impl!r} is never a tuned pick: {registry.reference_only(c.impl)}"
        try:
            registry.check_params(registry.get(c.impl), dict(c.params))
        except registry.BackendUnavailable:
            continue
        except Exception as exc:  # ValueError naming the parameter, or a broken backend
            return f"{c.impl}: {exc}"
    return None


def parse_entries(raw, where: str, *, env: Environment | None = None, gpu_classes=None,
                  include_predicted: bool = False) -> list[Entry]:
    """Typed entries of `raw` (JSON objects or Entry); each unusable one (bad field, unknown
    backend or parameter, another GPU, kernel sources or library version) is left out, with one
    warning for all of them. `env` None: no environment comparison."""
    out, skipped, drift = [], [], collections.Counter()
    for i, d in enumerate(raw):
        try:
            typed = isinstance(d, Entry)  # already checked when it was loaded
            e = d if typed else Entry.parse(d, f"entries[{i}]")
            why = (None if typed else _backend_problem(e)) or (
                mismatch(e, env, gpu_classes or {}) if env else None)
            if not why and env and (versions := nvrtc_drift(e, env)):
                drift[versions] += 1
        except EntryError as exc:
            why = str(exc).removeprefix(f"entries[{i}].").removeprefix(f"entries[{i}] ")
        except Exception as exc:  # whatever an entry holds, loading goes on
            why = f"{type(exc).__name__}: {exc}"
        if why:
            skipped.append((f"entries[{i}]", why))
        elif include_predicted or e.kind != "predicted":
            out.append(e)
    warn_skipped(where, "entries", skipped)
    for versions, n in drift.items():
        warnings.warn(f"{where}: {n} entries measured with NVRTC {versions[0]} run with NVRTC "
                      f"{versions[1]} here: used as measured (the same major version; its code "
                      f"may differ a little: `tuner refine --with-winners` times them again)",
                      RuntimeWarning, stacklevel=2)
    return out


def load_table(path, *, include_predicted: bool = False, env: Environment | None = None,
               regime: str = "burst") -> tuple[list[Entry], str]:
    """Typed entries of a tuned table (.json) or a profile database, and a text naming the
    source. Raises TableError only for a missing, corrupt or foreign file. `regime`: which
    timings of a profile database decide its keys (a tuned table was exported for one regime,
    `source.regime`, and is read as it is)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise TableError(f"cannot read the tuned table {path}: {exc.strerror or exc}") from None
    if head.startswith(b"SQLite format 3\x00"):
        source = f"profile database {path}" + (f" ({regime} regime)" if regime != "burst" else "")
        rows = read_db_rows(path)
        if env is not None:
            # rows measured elsewhere (another GPU, other kernel sources) never compete: a key
            # whose fastest row was of yesterday's sources still has today's to run
            verdicts = [(r, row_mismatch(r, env)) for r in rows]
            rows = [r for r, why in verdicts if not why]
            skipped = [(f"row {r.get('row_order')}", why) for r, why in verdicts if why]
            warn_skipped(source, "rows", skipped,
                         effect="measured elsewhere; each key is decided by the rows measured here")
        raw = select_entries(rows, include_predicted=include_predicted, where=source, regime=regime)
        classes = {}
    else:
        source = f"tuned table {path}"
        try:
            doc = parse_json(path.read_bytes(), str(path),
                             "neither a profile database nor a JSON tuned table")
        except OSError as exc:
            raise TableError(f"cannot read the tuned table {path}: {exc.strerror or exc}") from None
        raw = validate_table(doc, str(path))
        classes = doc.get("gpu_classes") or {}
    return parse_entries(raw, source, env=env, gpu_classes=classes,
                         include_predicted=include_predicted), source


def load_entries(path, *, include_predicted: bool = False) -> tuple[list[Entry], str]:
    """`load_table` without an environment comparison (for tools that read another machine's
    measurements, such as `tuner auto`)."""
    return load_table(path, include_predicted=include_predicted)


# ---------------------------------------------------------------------------------------------
# Warnings: one per load, each distinct reason once


def warn_skipped(where: str, what: str, skipped: list[tuple[str, str]], stacklevel: int = 3,
                 effect: str = "misses; the default heuristic answers for them") -> None:
    """One warning for everything a load left out: (item, why) pairs grouped by why."""
    if not skipped:
        return
    groups: dict[str, list[str]] = {}
    for item, why in skipped:
        groups.setdefault(why, []).append(item)
    detail = "; ".join(f"{why} ({len(items)}x, first {items[0]})" for why, items in groups.items())
    warnings.warn(f"{where}: {len(skipped)} {what} left out ({effect}): {detail}", RuntimeWarning,
                  stacklevel=stacklevel)
