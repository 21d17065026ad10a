"""The tiered pick: which implementation runs a problem, from typed tuned entries.

`Dispatcher` indexes the entries of a tuned table or profile database (kernels.tuned_table) once
and picks an implementation per problem in tiers:

    exact     the same SM, geometry, mask/window, dtype, layout/page size, batch and context
    bucketed  the same SM and shape; batch and context rounded up to powers of two (the query's
              own bucket, else the nearest measured bucket)
    family    the same, measured on another SM of the same family (sm // 10: 100 and 103)
    default   cupy with its default parameters for the SM (kernels.cupy_backend.SM_BUDGETS)
              where it supports the problem, else the reference

Every candidate is checked with the backend's `supports()` for the SM (whose shared memory it
must fit: an entry of SM 80 is no use on SM 86) before it is chosen; a pick says
which tier gave it and why, never raises and never touches the GPU. Picks are cached per key.
"""

from __future__ import annotations

import math
import threading
import types
from dataclasses import dataclass, field

from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.kernels.tuned_table import (SHAPE_FIELDS, Entry, Environment, bucket, family,
                                              load_table, parse_entries)

TIERS = ("exact", "bucketed", "family", "default")
# `Dispatcher.load`'s default: compare entries with the environment of this process.
CURRENT = "current"


@dataclass(frozen=True)
class Pick:
    """What to run for one problem, and why. `params` is read-only (picks are cached, shared)."""

    impl: str
    params: types.MappingProxyType
    tier: str  # one of TIERS
    reason: str
    source: str  # the table or database it came from, or "default heuristic"
    entry: Entry | None = field(default=None, compare=False, repr=False)  # the table row behind it

    def as_dict(self) -> dict:
        return {"impl": self.impl, "params": dict(self.params), "tier": self.tier,
                "reason": self.reason, "source": self.source}


def _pick(impl, params, tier, reason, source, entry=None) -> Pick:
    return Pick(impl, types.MappingProxyType(dict(params)), tier, reason, source, entry)


def reference_pick(reason: str, source: str = "default heuristic") -> Pick:
    return _pick("reference", {}, "default", reason, source)


def problem_key(problem: Problem, sm: int | None) -> tuple:
    g = problem.geometry
    return (sm, g.num_q_heads, g.num_kv_heads, g.head_dim, g.block_size, g.mask, g.window, g.dtype,
            problem.layout, problem.page_size, problem.batch, problem.ctx_len)


def describe_key(key: tuple) -> str:
    sm, hq, hkv, d, qb, mask, window, dtype, layout, page, batch, ctx = key
    cache = f"page{page}" if layout == "paged" else "arena"
    m = mask if window is None else f"{mask}:{window}"
    return f"sm{sm} {hq}/{hkv}x{d} Qb={qb} {m} {dtype} {cache} B={batch} ctx={ctx}"


def fmt_params(params) -> str:
    return "[" + ",".join(f"{k}={v}" for k, v in dict(params).items()) + "]" if params else ""


def _log2(x: int) -> float:
    return math.log2(max(x, 1))


def _supports(impl: str, params, problem: Problem, sm: int | None = None) -> str | None:
    """None when `impl` with `params` can run `problem` on SM `sm`, else why not (never
    raises)."""
    from drafter_attn.kernels import registry

    try:
        return registry.supports(registry.bind(registry.get(impl), dict(params)), problem, sm)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def default_pick(problem: Problem, note: str = "", source: str = "default heuristic",
                 sm: int | None = None) -> Pick:
    """The safe default: cupy at its default parameters for SM `sm` (kernels.cupy_backend's
    per-SM defaults; a GPU that runs PTX gets those of the PTX's compute capability) where it
    supports the problem, else the torch reference (which runs everything)."""
    from drafter_attn.kernels import registry

    prefix = f"default: {note}; " if note else "default: "
    try:
        cupy = registry.get("cupy")
        reason = registry.supports(cupy, problem, sm)
        if reason is None:
            which = "its default parameters" if sm is None else f"its defaults for SM {sm}"
            return _pick("cupy", registry.default_params(cupy, problem, sm), "default",
                         prefix + f"cupy supports this problem ({which})", source)
        why = f"cupy does not support it ({reason})"
    except Exception as exc:
        why = f"cupy is unavailable ({type(exc).__name__}: {exc})"
    return reference_pick(prefix + why + "; the torch reference runs it", source)


class Dispatcher:
    """An in-memory index of typed tuned entries, and the tiered pick over it."""

    def __init__(self, entries=(), *, source: str = "default heuristic",
                 include_predicted: bool = False, env: Environment | None = None,
                 gpu_classes: dict | None = None):
        self.source = source
        # JSON objects are typed here; each unusable one is a miss with one warning, never an error
        self.entries: list[Entry] = parse_entries(list(entries), source, env=env, gpu_classes=gpu_classes,
                                                  include_predicted=include_predicted)
        self._exact: dict[tuple, Entry] = {}
        # shape -> sm -> (batch bucket, ctx bucket) -> entry
        self._shapes: dict[tuple, dict[int, dict[tuple, Entry]]] = {}
        for e in self.entries:
            self._index(e)
        self._cache: dict[tuple, Pick] = {}
        self._lock = threading.Lock()

    def _index(self, e: Entry) -> None:
        old = self._exact.get(e.key)
        if old is None or e.rank < old.rank:
            self._exact[e.key] = e
        buckets = self._shapes.setdefault(e.shape, {}).setdefault(e.sm, {})
        old = buckets.get(e.buckets)
        # within a bucket the point nearest its upper edge stands for it
        point, old_point = (e.batch, e.ctx_len), old and (old.batch, old.ctx_len)
        if old is None or point > old_point or (point == old_point and e.rank < old.rank):
            buckets[e.buckets] = e

    @classmethod
    def load(cls, path, *, include_predicted: bool = False, env=None, regime: str = "burst") -> Dispatcher:
        """Open a tuned table (.json) or a profile database; raises TableError when the file is
        unusable. With `env` (an Environment, or CURRENT: this process's GPU, kernel sources and
        library versions, as `Runtime` loads), entries measured elsewhere are misses; None reads
        the table as data, with no comparison. `regime` (kernels.tuned_table.REGIMES): which
        timings of a profile database decide its keys."""
        if env == CURRENT:
            from drafter_attn.kernels.tuned_table import current_environment

            env = current_environment()
        entries, source = load_table(path, include_predicted=include_predicted, env=env, regime=regime)
        return cls(entries, source=source, include_predicted=include_predicted)

    @property
    def sms(self) -> list[int]:
        return sorted({e.sm for e in self.entries})

    # -- picking ---------------------------------------------------------------------------
    def pick(self, problem: Problem, sm: int | None = None) -> Pick:
        """The implementation to run `problem` on SM `sm` (None: unknown GPU). Never raises."""
        try:
            key = problem_key(problem, sm)
            hash(key)
        except Exception as exc:  # not a Problem
            return reference_pick(f"not a problem ({exc}); the reference runs anything")
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
        except Exception as exc:  # a broken backend: never fail a step
            try:
                result = default_pick(problem, note=f"picking failed ({type(exc).__name__}: {exc})",
                                      sm=key[0])
            except Exception:
                result = reference_pick(f"picking failed ({type(exc).__name__}: {exc}); the "
                                        f"reference runs anything")
        with self._lock:
            self._cache[key] = result
        return result

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def _pick(self, key: tuple, problem: Problem) -> Pick:
        sm = key[0]
        shape = key[1:1 + len(SHAPE_FIELDS)]
        notes: list[str] = []
        tried: set[int] = set()
        if sm is None:
            return default_pick(problem, note="GPU unknown (no SM): the table is not consulted")
        entry = self._exact.get(key)
        if entry is not None:
            p = self._usable(entry, problem, "exact", "measured at this exact problem", notes, tried, sm)
            if p:
                return p
        else:
            notes.append("no exact entry")
        per_sm = self._shapes.get(shape, {})
        qb = (bucket(key[-2]), bucket(key[-1]))
        if sm in per_sm:
            p = self._from_buckets(per_sm[sm], qb, problem, "bucketed", f"sm{sm}", notes, tried, sm)
            if p:
                return p
        else:
            notes.append(f"no sm{sm} entry of this shape")
        # family: other SMs of sm // 10, nearest SM first
        kin = sorted((s for s in per_sm if s != sm and family(s) == family(sm)), key=lambda s: (abs(s - sm), s))
        for other in kin:
            p = self._from_buckets(per_sm[other], qb, problem, "family",
                                   f"sm{other} (family sm{family(sm)}x)", notes, tried, sm)
            if p:
                return p
        if not kin:
            notes.append(f"no other SM of family sm{family(sm)}x with this shape")
        return default_pick(problem, note="; ".join(notes), source=self.source, sm=sm)

    def _from_buckets(self, buckets: dict, qb: tuple, problem, tier, where, notes, tried, sm):
        entry = buckets.get(qb)
        if entry is not None:
            p = self._usable(entry, problem, tier,
                             f"{where}, same bucket batch<={qb[0]} ctx<={qb[1]} (measured at "
                             f"B={entry.batch} ctx={entry.ctx_len})", notes, tried, sm)
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
                             f"bucket batch<={qb[0]} ctx<={qb[1]}; measured at B={entry.batch} "
                             f"ctx={entry.ctx_len})", notes, tried, sm)
            if p:
                return p
        return None

    def _usable(self, entry: Entry, problem: Problem, tier: str, why: str, notes: list, tried: set,
                sm: int | None):
        if id(entry) in tried:
            return None
        tried.add(id(entry))
        count = entry.get("candidates", len(entry.candidates))
        for i, c in enumerate(entry.candidates):
            reason = _supports(c.impl, c.params, problem, sm)
            if reason is None:
                rank = "winner" if i == 0 else f"alternative {i}"
                text = (f"{tier}: {why}; {rank} of {count} candidates ({entry.kind}, "
                        f"{c.median_us:.1f} us/step)")
                if notes:
                    text += f" [before: {'; '.join(notes)}]"
                return _pick(c.impl, c.params, tier, text, self.source, entry)
            notes.append(f"{tier} {c.impl}{fmt_params(c.params)} skipped: {reason}")
        return None
