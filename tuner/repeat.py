"""Repeatability of a sweep: the same spec measured twice, compared key by key (issue 14: the same
winner for at least 95% of keys and a median spread of at most 2%).

    tuner repeat A.db B.db [--figure repeat.png] [--format json] [--gate]
    tuner repeat all.db all.db --sweep-a ID1 --sweep-b ID2      (two sweeps merged into one file)

The two runs are two profile databases (a sweep run twice into fresh files), or two sweeps of one
database (`--sweep-a`, `--sweep-b`). Rows are read as `tuner export` reads them (ok, measured,
the newest row of each candidate; kernels.tuned_table.group_rows), so a key is a tuned-table
entry: SM, shape, batch and context. Per key:

- the candidates (implementation and parameters) measured in both runs; the winner of each run
  is the best of those by the tuned table's ranking (`kernels.tuned_table.rank_rows`: step
  latency per layer, the default parameters kept unless another set is more than 1% faster);
- each candidate's relative difference between the runs, d = B / A - 1 of its median; the
  spread is |d|;
- a winner flip is *within noise* when, in each run, the two winners' p10..p90 ranges of
  replay times overlap (neither run separates them);
- the cost of a flip: how much slower A's winner is than B's winner as run B measures them (what
  a table exported from A gives away, judged by B), and the margin A's winner had in A.

The summary gives the share of keys with the same winner, the flips and how many are within
noise, the median (and p90, max) spread over every candidate and over the winners, and whether
the targets hold. `figure` draws the histogram of the differences beside the flips.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from drafter_attn.kernels import dispatcher, tuned_table
from drafter_attn.tuner.db import ProfileDB

MIN_SAME_WINNER = 0.95  # issue 14's targets
MAX_MEDIAN_SPREAD = 0.02

ROWS_SQL = """
SELECT e.sm, e.gpu_name, r.id AS row_order, r.*
FROM results r JOIN environments e USING (env_id)
WHERE r.status = 'ok' AND r.median_us IS NOT NULL AND r.median_us > 0
  AND (r.accepted IS NULL OR r.accepted = r.block_size)
"""  # as kernels.tuned_table.DB_ROWS_SQL: decode steps that store the whole block


class RepeatError(ValueError):
    """The two runs cannot be compared (no rows, no common keys, a sweep that is not there)."""


# ---------------------------------------------------------------------------------------------
# reading


def read_run(path, sweep: str | None = None, sm: int | None = None) -> dict[tuple, list[dict]]:
    """The measured ok rows of `path` (of sweep `sweep`, SM `sm` when given) by key, each key's
    candidates ranked (kernels.tuned_table.group_rows)."""
    sql, args = ROWS_SQL, []
    if sweep is not None:
        sql += " AND r.sweep_id = ?"
        args.append(sweep)
    if sm is not None:
        sql += " AND e.sm = ?"
        args.append(sm)
    with ProfileDB(path, readonly=True) as db:
        rows = db.query(sql + " ORDER BY r.id", args)
        if not rows:
            sweeps = [r["sweep_id"] for r in db.query(
                "SELECT sweep_id, COUNT(*) n FROM results GROUP BY sweep_id ORDER BY MIN(id)")]
            which = f" of sweep {sweep!r}" if sweep else ""
            which += f" on sm{sm}" if sm is not None else ""
            raise RepeatError(f"{path} holds no ok rows{which} (its sweeps: {', '.join(map(str, sweeps)) or 'none'})")
    return tuned_table.group_rows(rows, where=f"profile database {path}")


# ---------------------------------------------------------------------------------------------
# comparing


def _band(row: dict) -> tuple[float, float]:
    """The p10..p90 range of a row's replay times per layer (its median alone when they are
    missing), in the unit the candidates are ranked in."""
    med, per = row["median_us"], row["per_layer_us"] / row["median_us"]
    lo, hi = row.get("p10_us"), row.get("p90_us")
    return ((med if lo is None else min(lo, med)) * per, (med if hi is None else max(hi, med)) * per)


def _us(row: dict) -> float:
    """What candidates are ranked by, and every difference and margin is taken of: step latency
    per layer (steps of different layer counts compare per layer)."""
    return row["per_layer_us"]


def _overlap(a: dict, b: dict) -> bool:
    (alo, ahi), (blo, bhi) = _band(a), _band(b)
    return alo <= bhi and blo <= ahi


def _label(row: dict) -> str:
    return row["impl"] + dispatcher.fmt_params(row["params"])


def _differ(a: dict, b: dict) -> tuple[str, str]:
    """Two candidates by what tells them apart: the impl when it differs, else the parameters
    whose values differ."""
    if a["impl"] != b["impl"]:
        return _label(a), _label(b)
    pa, pb = a["params"], b["params"]
    names = [k for k in {**pa, **pb} if pa.get(k) != pb.get(k)]
    show = lambda p: a["impl"] + "[" + ",".join(f"{k}={p.get(k)}" for k in names) + "]"  # noqa: E731
    return show(pa), show(pb)


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def compare_key(ranked_a: list[dict], ranked_b: list[dict]) -> dict | None:
    """One key's comparison (see the module docstring); None when no candidate is in both."""
    by_a = {tuned_table.candidate_of(r): r for r in ranked_a}
    by_b = {tuned_table.candidate_of(r): r for r in ranked_b}
    common = [c for c in by_a if c in by_b]  # in A's rank order
    if not common:
        return None
    common = [tuned_table.candidate_of(r) for r in tuned_table.rank_rows([by_a[c] for c in common])]
    diffs = [_us(by_b[c]) / _us(by_a[c]) - 1.0 for c in common]  # A's winner first
    wa = by_a[common[0]]
    wb = tuned_table.rank_rows([by_b[c] for c in common])[0]
    cb = tuned_table.candidate_of(wb)
    flip = cb != common[0]
    wa_in_b, wb_in_a = by_b[common[0]], by_a[cb]
    runner_up = by_a[common[1]] if len(common) > 1 else None
    out = {
        "key": dispatcher.describe_key(tuned_table.row_key(wa)),
        "candidates": len(common), "only_a": len(by_a) - len(common), "only_b": len(by_b) - len(common),
        "winner_a": _label(wa), "winner_b": _label(wb),
        "a_us": wa["per_layer_us"], "b_us": wb["per_layer_us"],
        "flip": flip,
        # A's winner as B measured it (0 when the winner held)
        "winner_change": _us(wa_in_b) / _us(wa) - 1.0,
        "flip_cost": _us(wa_in_b) / _us(wb) - 1.0,
        # how far ahead of the next candidate A's winner was in A (None: it had no rival)
        "margin_a": None if runner_up is None else _us(runner_up) / _us(wa) - 1.0,
        "spreads": [abs(d) for d in diffs], "diffs": diffs,
        "spread_median": statistics.median(abs(d) for d in diffs),
        "within_noise": None,
    }
    if flip:
        out["within_noise"] = _overlap(wa, wb_in_a) and _overlap(wa_in_b, wb)
        out["flip_a"], out["flip_b"] = _differ(wa, wb)
        out["margin_b"] = _us(wa_in_b) / _us(wb) - 1.0
    return out


def compare(run_a: dict[tuple, list[dict]], run_b: dict[tuple, list[dict]], *,
            min_same: float = MIN_SAME_WINNER, max_spread: float = MAX_MEDIAN_SPREAD) -> dict:
    """The comparison of two runs (`read_run`): per key and in summary (module docstring)."""
    keys = [k for k in run_a if k in run_b]
    items = [it for it in (compare_key(run_a[k], run_b[k]) for k in keys) if it is not None]
    if not items:
        raise RepeatError(f"the two runs have no candidate of any key in common ({len(run_a)} keys "
                          f"in A, {len(run_b)} in B): not the same sweep spec?")
    spreads = [s for it in items for s in it["spreads"]]
    winner_spreads = [abs(it["winner_change"]) for it in items]
    flips = [it for it in items if it["flip"]]
    noise = [it for it in flips if it["within_noise"]]
    costs = [it["flip_cost"] for it in flips]
    n = len(items)
    choice = [it for it in items if it["candidates"] > 1]
    summary = {
        "keys": n, "keys_only_a": len(run_a) - len(keys), "keys_only_b": len(run_b) - len(keys),
        "keys_with_a_choice": len(choice),
        "candidates": len(spreads),
        "candidates_only_a": sum(it["only_a"] for it in items),
        "candidates_only_b": sum(it["only_b"] for it in items),
        "same_winner": n - len(flips), "same_winner_share": (n - len(flips)) / n,
        "flips": len(flips), "flips_within_noise": len(noise),
        "same_or_noise_share": (n - len(flips) + len(noise)) / n,
        "spread_median": statistics.median(spreads), "spread_p90": _quantile(spreads, 0.9),
        "spread_max": max(spreads),
        "winner_spread_median": statistics.median(winner_spreads),
        "flip_cost_median": statistics.median(costs) if costs else None,
        "flip_cost_max": max(costs) if costs else None,
    }
    targets = {"min_same_winner": min_same, "max_median_spread": max_spread,
               "same_winner_met": summary["same_winner_share"] >= min_same,
               "spread_met": summary["spread_median"] <= max_spread}
    targets["met"] = targets["same_winner_met"] and targets["spread_met"]
    return {"summary": summary, "targets": targets, "keys": items}


def compare_paths(a, b, *, sweep_a: str | None = None, sweep_b: str | None = None,
                  sm: int | None = None, **targets) -> dict:
    """`compare` of two databases (or two sweeps of one), with where each run came from."""
    if Path(a).resolve() == Path(b).resolve() and (sweep_a is None or sweep_b is None or sweep_a == sweep_b):
        raise RepeatError("both runs are the same rows: give two databases, or two sweeps of one "
                          "database with --sweep-a and --sweep-b")
    out = compare(read_run(a, sweep_a, sm), read_run(b, sweep_b, sm), **targets)
    out["a"] = {"db": str(a), "sweep": sweep_a}
    out["b"] = {"db": str(b), "sweep": sweep_b}
    return out


# ---------------------------------------------------------------------------------------------
# output


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def text(report: dict) -> str:
    s, t = report["summary"], report["targets"]
    name = lambda r: r["db"] + (f" (sweep {r['sweep']})" if r.get("sweep") else "")  # noqa: E731
    yes = lambda ok: "yes" if ok else "NO"  # noqa: E731
    lines = [
        f"repeatability: A = {name(report['a'])}, B = {name(report['b'])}" if "a" in report else "repeatability",
        f"{s['keys']} keys measured in both ({s['keys_with_a_choice']} with more than one candidate; "
        f"{s['keys_only_a']} only in A, {s['keys_only_b']} only in B); {s['candidates']} candidates in both "
        f"({s['candidates_only_a']} only in A, {s['candidates_only_b']} only in B)",
        f"same winner: {s['same_winner']}/{s['keys']} keys ({s['same_winner_share']:.1%}); {s['flips']} flips, "
        f"{s['flips_within_noise']} within noise (the two winners' p10-p90 ranges overlap in both runs): "
        f"same or within noise {s['same_or_noise_share']:.1%}",
        f"spread |B/A - 1| per candidate: median {_pct(s['spread_median'])}, p90 {_pct(s['spread_p90'])}, "
        f"max {_pct(s['spread_max'])}; of A's winners: median {_pct(s['winner_spread_median'])}",
    ]
    if s["flips"]:
        lines.append(f"cost of a flip (A's winner against B's, as B measured them): median "
                     f"{_pct(s['flip_cost_median'])}, max {_pct(s['flip_cost_max'])}")
    lines.append(f"targets: same winner >= {t['min_same_winner']:.0%}: {yes(t['same_winner_met'])} "
                 f"({s['same_winner_share']:.1%}); median spread <= {t['max_median_spread']:.0%}: "
                 f"{yes(t['spread_met'])} ({_pct(s['spread_median'])})")
    flips = [it for it in report["keys"] if it["flip"]]
    if flips:
        lines.append("winner flips:")
        for it in flips:
            lines.append(f"  {it['key']}: A {it['flip_a']} {it['a_us']:.2f} us/layer -> B {it['flip_b']} "
                         f"{it['b_us']:.2f} us/layer; margins A {_pct(it['margin_a'])}, B "
                         f"{_pct(it['margin_b'])}; {'within noise' if it['within_noise'] else 'beyond noise'}")
    return "\n".join(lines)


def figure(report: dict, out) -> Path:
    """Two panels: the histogram of every candidate's B / A - 1 (A's winners stacked apart), and
    per key the margin A's winner had against the cost its pick has in B, flips marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from drafter_attn.tuner.cli_checks import write_whole

    s, items = report["summary"], report["keys"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    winners = [100 * it["winner_change"] for it in items]
    others = [100 * d for it in items for d in it["diffs"][1:]]
    lim = max(2.5, min(25.0, 1.1 * max(abs(x) for x in winners + others)))
    bins = [lim * (i / 20 - 1) for i in range(41)]
    left.hist([others, winners], bins=bins, stacked=True, color=["#9bb7d4", "#1f5fa8"],
              label=["other candidates", "A's winner"])
    for x in (-100 * report["targets"]["max_median_spread"], 100 * report["targets"]["max_median_spread"]):
        left.axvline(x, color="#d9731a", ls="--", lw=1)
    left.set_xlabel("B / A - 1 of a candidate's median step time a layer (%)")
    left.set_ylabel("candidates")
    left.set_title(f"spread: median {s['spread_median']:.2%}, p90 {s['spread_p90']:.2%} "
                   f"({s['candidates']} candidates)")
    left.legend(loc="upper left", fontsize=9)
    kinds = (("same winner", lambda it: not it["flip"], "o", "#777777"),
             ("flip within noise", lambda it: it["flip"] and it["within_noise"], "^", "#d9731a"),
             ("flip beyond noise", lambda it: it["flip"] and not it["within_noise"], "x", "#c0392b"))
    for label, pick, marker, colour in kinds:
        pts = [(100 * (it["margin_a"] or 0.0), 100 * max(it["flip_cost"], 0.0)) for it in items
               if pick(it) and it["margin_a"] is not None]
        if pts:
            right.scatter(*zip(*pts), marker=marker, color=colour, label=f"{label} ({len(pts)})",
                          s=36 if marker != "o" else 18)
    right.set_xscale("symlog", linthresh=1.0, linscale=0.5)
    top = max([100 * (it["margin_a"] or 0.0) for it in items] + [1.0])
    right.set_xticks([x for x in (0, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500) if x <= 1.5 * top])
    right.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    right.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    right.set_xlabel("A's winner ahead of A's runner-up (%)")
    right.set_ylabel("A's winner slower than B's winner, in B (%)")
    right.set_title(f"same winner {s['same_winner_share']:.1%} of {s['keys']} keys; "
                    f"{s['flips']} flips, {s['flips_within_noise']} within noise")
    right.legend(loc="upper right", fontsize=9)
    fig.suptitle("tuner repeat: the same sweep run twice")
    fig.tight_layout()
    out = Path(out)
    write_whole(out, lambda tmp: fig.savefig(tmp, format=out.suffix.lstrip(".") or "png", dpi=110))
    plt.close(fig)
    return out
