"""AUTO: paged or arena for a deployment, with reasons drawn from measurements; and the cost of
rounding a prefix hit to a page boundary. Pure functions (no GPU, no database).

`recommend(deployment, entries)` weighs, for one SM:

- step latency: the best measured paged kernel at the deployment's page size against the best
  arena kernel, at the measured batch nearest the concurrency, over the measured context lengths
  up to the maximum context (tuned-table entries, `kernels.dispatch`);
- KV memory: the arena is dense in max_ctx (every slot holds max_ctx tokens whatever the real
  lengths); the paged pool holds pages of the tokens it has (the same at max context, plus page
  rounding and the block table; less below it): the memory model of `kernels.footprint`;
- prefix reuse: only the paged pool can share a prefix hit's pages or receive the drafter's
  context from another worker; an arena slot recomputes or copies it;
- disaggregated serving: the prefill workers hand the KV over in pages, which only the paged pool
  can take;
- host syncs: a layout whose measured step waits on the host loses to one measured at zero;
- long contexts: for a deployment whose max_ctx reaches LONG_CTX (128k), the paged-against-arena
  latency measured at contexts from 128k up to max_ctx (at batch 1-4, where such contexts fit),
  at the measured batch nearest the concurrency. Those rows come from `bench decode --ctx
  128k,512k --batch 1,4` (scripts/long_ctx.sh) or the attention table, recorded into a profile
  database; `merge_entries` (and `tuner auto --with PATH`) adds them to a shipped table's entries.

The decision, in order: disaggregated -> paged; a host sync measured in one layout but not the
other -> the other; prefix hits expected -> paged; then, for a long-context deployment (max_ctx
of 128k or more, and a mean context, when given, of 128k or more), the long-context latency; else
the measured latency (paged unless it is slower than the arena by more than
`latency_tolerance`, 1% by default: the design's goal). When the latency that would decide is not
measured, the recommendation is None and says what to run; long contexts not measured are listed
as missing, and the latency over the shorter contexts decides.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

from drafter_attn.kernels.footprint import DEFAULT_PAGES, arena_bytes, paged_bytes, token_bytes
from drafter_attn.kernels.presets import get_preset
from drafter_attn.kernels.spec import Geometry, is_power_of_two

SERVING = ("agg", "disagg")
LONG_CTX = 131072  # from here on a context is long: measured at small batch (issue 12)


@dataclass(frozen=True)
class Deployment:
    """What AUTO decides for. `prefix_hit`: expected fraction of prompt tokens found in the prefix
    cache (0..1). `mean_ctx`: optional typical context length (for memory below max_ctx)."""

    preset: str
    page_size: int
    max_ctx: int
    concurrency: int
    prefix_hit: float = 0.0
    serving: str = "agg"
    mean_ctx: int | None = None
    geometry: Geometry | None = None  # default: the preset's

    def __post_init__(self):
        if self.geometry is None:
            object.__setattr__(self, "geometry", get_preset(self.preset))
        if not is_power_of_two(self.page_size):
            raise ValueError(f"page_size must be a power of two, got {self.page_size!r}")
        for name in ("max_ctx", "concurrency"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0.0 <= float(self.prefix_hit) <= 1.0:
            raise ValueError(f"prefix_hit must be in [0, 1], got {self.prefix_hit!r}")
        if self.serving not in SERVING:
            raise ValueError(f"serving={self.serving!r} is unknown; known: {', '.join(SERVING)}")
        if self.mean_ctx is not None and not 0 <= self.mean_ctx <= self.max_ctx:
            raise ValueError(f"mean_ctx must be in [0, max_ctx={self.max_ctx}], got {self.mean_ctx!r}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["geometry"] = asdict(self.geometry)
        return d


@dataclass(frozen=True)
class Reason:
    kind: str  # latency | long_context | memory | workspace | prefix_reuse | serving | host_syncs | page_rounding
    favors: str | None  # "paged", "arena" or None (neutral / unknown)
    basis: str  # "measured" (profile rows), "model" (arithmetic), "deployment" (what was given),
    #             or "missing" (the measurement is not there)
    text: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Recommendation:
    layout: str | None  # "paged", "arena", or None when a missing measurement would decide
    decided_by: str | None
    deployment: Deployment
    sm: int | None
    reasons: tuple
    missing: tuple  # measurements that were not there

    def as_dict(self) -> dict:
        return {"recommendation": self.layout, "decided_by": self.decided_by, "sm": self.sm,
                "deployment": self.deployment.as_dict(),
                "reasons": [asdict(r) for r in self.reasons], "missing": list(self.missing)}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    def to_text(self) -> str:
        d = self.deployment
        head = (f"AUTO for {d.preset} on {'an unknown SM' if self.sm is None else f'sm{self.sm}'}: page {d.page_size}, max ctx {d.max_ctx}, "
                f"concurrency {d.concurrency}, prefix hits {d.prefix_hit:.0%}, {d.serving} serving")
        verdict = (f"recommendation: {self.layout} (decided by {self.decided_by})" if self.layout
                   else "recommendation: none: the measurement that would decide is missing")
        lines = [head, verdict, ""]
        for r in self.reasons:
            tag = {"paged": "+paged", "arena": "+arena"}.get(r.favors, "  ----")
            lines.append(f" {tag}  {r.kind} ({r.basis}): {r.text}")
        if self.missing:
            lines += ["", "missing measurements:"] + [f"  - {m}" for m in self.missing]
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---------------------------------------------------------------------------------------------
# page rounding


def hidden_tokens(hit_len: int, page_size: int) -> int:
    """Context tokens a prefix hit of `hit_len` tokens hides from the drafter when an unpaired
    pool rounds the first stored position up to a page boundary: ceil(L / S) * S - L, in
    [0, S - 1] (0 without a hit)."""
    if hit_len < 0:
        raise ValueError(f"hit length must be >= 0, got {hit_len}")
    return -hit_len % page_size


def _nearest_rank(sorted_values: list[int], q: float) -> int:
    """Percentile by the nearest-rank method: the value at rank ceil(q * n)."""
    n = len(sorted_values)
    return sorted_values[max(0, math.ceil(q * n) - 1)]


def page_rounding(hit_lengths, page_sizes=DEFAULT_PAGES) -> dict[int, dict]:
    """Per page size, the distribution of tokens hidden from the drafter over `hit_lengths`
    (prefix-hit lengths in tokens): mean, p50 / p90 (nearest rank), max, the share of hits that
    lose nothing, the hidden tokens in total and as a share of the hit tokens, and the histogram
    {hidden tokens: hits}."""
    lengths = [int(x) for x in hit_lengths]
    if not lengths:
        raise ValueError("hit_lengths is empty")
    out = {}
    for s in page_sizes:
        if not is_power_of_two(s):
            raise ValueError(f"page size must be a power of two, got {s!r}")
        hidden = [hidden_tokens(x, s) for x in lengths]
        ordered = sorted(hidden)
        total_hit = sum(lengths)
        out[s] = {
            "hits": len(hidden),
            "mean": sum(hidden) / len(hidden),
            "p50": _nearest_rank(ordered, 0.5),
            "p90": _nearest_rank(ordered, 0.9),
            "max": ordered[-1],
            "bound": s - 1,
            "zero_fraction": hidden.count(0) / len(hidden),
            "total_hidden": sum(hidden),
            "hidden_fraction": sum(hidden) / total_hit if total_hit else 0.0,
            "histogram": dict(sorted(Counter(hidden).items())),
        }
    return out


def page_rounding_text(stats: dict[int, dict]) -> str:
    lines = ["page  hits   mean   p50   p90   max  zero%  hidden/hit-tokens"]
    for s, r in stats.items():
        lines.append(f"{s:>4} {r['hits']:>5} {r['mean']:>6.1f} {r['p50']:>5} {r['p90']:>5} "
                     f"{r['max']:>5} {r['zero_fraction']:>6.1%} {r['hidden_fraction']:>10.3%}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the decision


def _matches(e: dict, g: Geometry, layout: str, page: int | None, sm: int) -> bool:
    return (e["sm"] == sm and e["num_q_heads"] == g.num_q_heads and e["num_kv_heads"] == g.num_kv_heads
            and e["head_dim"] == g.head_dim and e["block_size"] == g.block_size and e["mask"] == g.mask
            and e.get("window") == g.window and e["dtype"] == g.dtype and e["layout"] == layout
            and e.get("page_size") == page)


def _per_layer(e: dict) -> float:
    return e.get("per_layer_us") or e["median_us"] / (e.get("num_layers") or 1)


def merge_entries(*sources) -> list:
    """Tuned entries (kernels.tuned_table.Entry) of several sources as one list: where two hold
    the same problem (`Entry.key`), the later source's entry counts. So measured long-context rows (e.g. the
    database of scripts/long_ctx.sh) can join a shipped table. Each source holds one entry a
    problem (`tuner auto` takes one GPU's where a source measured several)."""
    merged: dict[tuple, object] = {}
    for entries in sources:
        for e in entries:
            key = e.key
            merged.pop(key, None)  # the later one, in the later position
            merged[key] = e
    return list(merged.values())


def latency_pairs(entries, d: Deployment, sm: int, min_ctx: int = 0) -> tuple[int | None, list[dict]]:
    """Paged (page_size) and arena entries measured at the same batch and context, at the measured
    batch nearest the concurrency (log scale; ties: the larger) among those measured at contexts
    up to max_ctx, with those contexts; where no batch is measured that short, the smallest
    context measured, at the batch nearest the concurrency there (its pairs say `beyond_max_ctx`).
    With `min_ctx` (long contexts), only pairs from min_ctx to max_ctx count, and none when none
    is measured there."""
    g = d.geometry
    paged = {(e["batch"], e["ctx_len"]): e for e in entries if _matches(e, g, "paged", d.page_size, sm)}
    arena = {(e["batch"], e["ctx_len"]): e for e in entries if _matches(e, g, "arena", None, sm)}
    common = sorted(set(paged) & set(arena))
    if min_ctx:
        common = [(b, c) for b, c in common if min_ctx <= c <= d.max_ctx]
    if not common:
        return None, []
    # the batch is chosen among the pairs that speak for this deployment: a batch measured only
    # past max_ctx must not outvote its neighbours measured within it
    shortest = min(c for _, c in common)
    pool = [(b, c) for b, c in common if c <= d.max_ctx] or [(b, c) for b, c in common if c == shortest]
    batches = sorted({b for b, _ in pool})
    batch = min(batches, key=lambda b: (abs(math.log2(b) - math.log2(d.concurrency)), -b))
    within = [c for b, c in pool if b == batch]
    pairs = []
    for c in within:
        p, a = paged[(batch, c)], arena[(batch, c)]
        pairs.append({"batch": batch, "ctx_len": c, "paged_us": _per_layer(p), "arena_us": _per_layer(a),
                      "overhead": _per_layer(p) / _per_layer(a) - 1.0,
                      "paged_impl": p["impl"], "arena_impl": a["impl"],
                      "paged_syncs": p.get("syncs"), "arena_syncs": a.get("syncs"),
                      "paged_workspace": p.get("workspace_bytes"),
                      "arena_workspace": a.get("workspace_bytes"), "beyond_max_ctx": c > d.max_ctx})
    return batch, pairs


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _subject(d: Deployment, sm: int | None) -> str:
    return f"{d.preset} page {d.page_size} and arena on " + ("an unknown SM" if sm is None else f"sm{sm}")


def _latency_reasons(d: Deployment, entries, sm: int | None, sms: list[int],
                     tolerance: float) -> tuple[list[Reason], list[str], list[dict]]:
    """The measured paged-against-arena latency -> (reasons, missing, the pairs compared)."""
    if sm is None:
        return [], [f"no SM chosen (the measurements hold SMs {sms or 'none'}): give one"], []
    batch, pairs = latency_pairs(entries, d, sm)
    if not pairs:
        missing = (f"step latency of {_subject(d, sm)} at the same batch and context: none measured; "
                   f"run `tuner sweep` with presets = [{d.preset!r}], page_sizes = [{d.page_size}], "
                   f"arena = true")
        return [Reason("latency", None, "missing", "paged against arena: not measured", {})], [missing], []
    overhead = _median([p["overhead"] for p in pairs])
    favors = "arena" if overhead > tolerance else "paged"
    span = ", ".join(f"ctx {p['ctx_len']}: {p['paged_us']:.2f} vs {p['arena_us']:.2f} us "
                     f"({p['overhead']:+.1%})" for p in pairs)
    note = "" if batch == d.concurrency else f" (nearest measured batch to concurrency {d.concurrency})"
    if any(p["beyond_max_ctx"] for p in pairs):
        note += f" (no pair measured at max_ctx {d.max_ctx} or shorter: the shortest measured stands in)"
    reason = Reason("latency", favors, "measured",
                    f"paged step per layer against arena at batch {batch}{note}: median {overhead:+.2%} "
                    f"[{span}]; tolerance {tolerance:.1%}",
                    {"batch": batch, "median_overhead": overhead, "pairs": pairs, "tolerance": tolerance})
    return [reason], [], pairs


def long_context_applies(d: Deployment) -> bool:
    """Whether the deployment serves long contexts: max_ctx of LONG_CTX or more."""
    return d.max_ctx >= LONG_CTX


def long_context_decides(d: Deployment) -> bool:
    """Whether the long-context latency decides (in place of the latency over every context):
    a long-context deployment whose mean context, when given, is long too (long steps cost the
    most time: a 512k step reads 64 times the bytes of an 8k one)."""
    return long_context_applies(d) and (d.mean_ctx is None or d.mean_ctx >= LONG_CTX)


def _long_context_reasons(d: Deployment, entries, sm: int | None,
                          tolerance: float) -> tuple[list[Reason], list[str]]:
    """The measured paged-against-arena latency at contexts from LONG_CTX to max_ctx."""
    if sm is None or not long_context_applies(d):
        return [], []
    batch, pairs = latency_pairs(entries, d, sm, min_ctx=LONG_CTX)
    if not pairs:
        missing = (f"step latency of {_subject(d, sm)} at long contexts ({LONG_CTX // 1024}k to "
                   f"{d.max_ctx}): none measured; run `bench decode --ctx 128k,512k --batch 1,4 --page "
                   f"{d.page_size} --db long.db` (scripts/long_ctx.sh) and add it: `tuner auto --with "
                   f"long.db`")
        return [Reason("long_context", None, "missing",
                       f"paged against arena at contexts of {LONG_CTX // 1024}k and more: not measured; "
                       f"the latency over the shorter contexts decides", {})], [missing]
    overhead = _median([p["overhead"] for p in pairs])
    favors = "arena" if overhead > tolerance else "paged"
    span = ", ".join(f"ctx {p['ctx_len'] // 1024}k: {p['paged_us']:.2f} vs {p['arena_us']:.2f} us "
                     f"({p['overhead']:+.1%})" for p in pairs)
    note = "" if batch == d.concurrency else f" (nearest measured batch to concurrency {d.concurrency})"
    role = "" if long_context_decides(d) else (f"; not deciding: the mean context {d.mean_ctx} is "
                                                f"below {LONG_CTX // 1024}k")
    return [Reason("long_context", favors, "measured",
                   f"paged step per layer against arena at long contexts, batch {batch}{note}: median "
                   f"{overhead:+.2%} [{span}]; tolerance {tolerance:.1%}{role}",
                   {"batch": batch, "median_overhead": overhead, "pairs": pairs,
                    "tolerance": tolerance, "min_ctx": LONG_CTX})], []


def _memory_reasons(d: Deployment, pairs: list[dict]) -> list[Reason]:
    """The footprint model (arena dense in max_ctx, paged by the pages used), and the measured
    step workspace when the compared pairs have it."""
    g, P = d.geometry, d.page_size
    arena = arena_bytes(g, d.concurrency, d.max_ctx)
    paged_max = paged_bytes(g, d.concurrency, d.max_ctx, P, d.max_ctx)
    data = {"arena_bytes": arena, "paged_bytes_at_max_ctx": paged_max, "token_bytes": token_bytes(g)}
    text = (f"arena is dense in max ctx: {d.concurrency} x {d.max_ctx} tokens = {_gib(arena)} whatever "
            f"the real lengths; paged at max ctx: {_gib(paged_max)} (pages + block table)")
    favors = None
    if d.mean_ctx is not None:
        paged_mean = paged_bytes(g, d.concurrency, d.mean_ctx + g.block_size, P, d.max_ctx)
        data["paged_bytes_at_mean_ctx"] = paged_mean
        text += f"; at mean ctx {d.mean_ctx}: {_gib(paged_mean)} ({paged_mean / arena:.0%} of the arena)"
        favors = "paged" if paged_mean < arena else None
    if d.prefix_hit > 0:
        text += "; shared prefix pages are held once in the paged pool, once per slot in the arena"
    reasons = [Reason("memory", favors, "model", text, data)]
    workspaces = [(p["ctx_len"], p["paged_workspace"], p["arena_workspace"]) for p in pairs
                  if p["paged_workspace"] is not None and p["arena_workspace"] is not None]
    if workspaces:
        ctx, pw, aw = workspaces[-1]
        reasons.append(Reason("workspace", None, "measured",
                              f"measured step workspace at ctx {ctx}: paged "
                              f"{pw / 2**20:.1f} MiB, arena {aw / 2**20:.1f} MiB", {"paged": pw, "arena": aw}))
    return reasons


def _prefix_reasons(d: Deployment, hit_lengths) -> list[Reason]:
    """Prefix reuse (only pages can be shared or handed over) and what page rounding of a hit
    hides from the drafter."""
    P = d.page_size
    if d.prefix_hit <= 0:
        return [Reason("prefix_reuse", None, "deployment", "no prefix hits expected: nothing to reuse",
                       {"prefix_hit": 0.0})]
    reuse = Reason(
        "prefix_reuse", "paged", "deployment",
        f"{d.prefix_hit:.0%} of prompt tokens are expected from the prefix cache: only the paged "
        f"pool can reuse (share pages) or transfer the drafter's context of a hit; an arena slot "
        f"must recompute or copy it into its private slot",
        {"prefix_hit": d.prefix_hit})
    rounding = {"bound": P - 1, "mean_if_uniform": (P - 1) / 2}
    text = (f"a pool not paired with the target's rounds a hit's first stored position up to a "
            f"page: up to {P - 1} context tokens hidden from the drafter per hit (mean "
            f"{(P - 1) / 2:.1f} when hit lengths are uniform modulo {P})")
    if hit_lengths:
        stats = page_rounding(hit_lengths, sorted({*DEFAULT_PAGES, P}))
        rounding["distribution"] = stats
        r = stats[P]
        text += (f"; over the {r['hits']} given hit lengths at page {P}: mean {r['mean']:.1f}, "
                 f"p90 {r['p90']}, max {r['max']}")
    return [reuse, Reason("page_rounding", None, "model", text, rounding)]


def _serving_reason(d: Deployment) -> Reason:
    if d.serving == "disagg":
        return Reason("serving", "paged", "deployment",
                      "disaggregated: the prefill workers hand the KV (and the drafter's "
                      "context) over in pages; only the paged pool can take it, an arena "
                      "would recompute the drafter's context on the decode worker", {})
    return Reason("serving", None, "deployment", "aggregated: no KV hand-over between workers", {})


def _host_sync_reasons(d: Deployment, sm: int | None, pairs: list[dict]) -> tuple[list[Reason], list[str]]:
    """Measured host waits per step: a layout measured at zero beats one that waits."""
    if not pairs:
        missing = [f"host syncs of {_subject(d, sm)}: not measured"] if sm is not None else []
        return [Reason("host_syncs", None, "missing", "not measured", {})], missing
    ps = [p["paged_syncs"] for p in pairs]
    as_ = [p["arena_syncs"] for p in pairs]
    missing = []
    if any(v is None for v in ps + as_):
        missing.append(f"host syncs of {_subject(d, sm)}: not measured for every pair")
    pm = max((v for v in ps if v is not None), default=None)
    am = max((v for v in as_ if v is not None), default=None)
    if pm is None or am is None:
        return [], missing
    favors = "arena" if pm > 0 and am == 0 else "paged" if am > 0 and pm == 0 else None
    return [Reason("host_syncs", favors, "measured", f"blocking host waits per step: paged {pm}, arena {am}",
                   {"paged": pm, "arena": am})], missing


def _decide(reasons: list[Reason], long_decides: bool = False) -> tuple[str | None, str | None]:
    """The first deciding kind, in order: serving, host syncs, prefix reuse, long-context latency
    (when `long_decides`), latency."""
    favors = {r.kind: r.favors for r in reasons}
    order = ("serving", "host_syncs", "prefix_reuse") + (("long_context",) if long_decides else ()) + ("latency",)
    for kind in order:
        if favors.get(kind):
            return favors[kind], kind
    return None, None


def recommend(d: Deployment, entries, sm: int | None = None, *, latency_tolerance: float = 0.01,
              hit_lengths=None) -> Recommendation:
    """Paged or arena for deployment `d` from tuned-table `entries` (kernels.dispatch) of SM `sm`
    (default: the only SM in the entries)."""
    entries = list(entries)
    sms = sorted({e["sm"] for e in entries})
    if sm is None and len(sms) == 1:
        sm = sms[0]
    reasons, missing, pairs = _latency_reasons(d, entries, sm, sms, latency_tolerance)
    long_reasons, long_missing = _long_context_reasons(d, entries, sm, latency_tolerance)
    reasons += long_reasons
    missing += long_missing
    reasons += _memory_reasons(d, pairs)
    reasons += _prefix_reasons(d, hit_lengths)
    reasons.append(_serving_reason(d))
    sync_reasons, sync_missing = _host_sync_reasons(d, sm, pairs)
    reasons += sync_reasons
    missing += sync_missing
    layout, by = _decide(reasons, long_context_decides(d))
    return Recommendation(layout, by, d, sm, tuple(reasons), tuple(missing))
