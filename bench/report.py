"""`bench report`: plots and a short markdown summary from the profile database (no GPU needed).

Rows are the database's `ok` results (from `bench decode` and `tuner sweep` alike), the latest per
environment and candidate, and of several parameter sets of one implementation for one problem
(a tuning sweep) the fastest. For each GPU (SM, name) and geometry: one PNG of step latency against
context (one panel per batch; arena, each page size, and the FlashInfer baseline, whose one-layer
attention rows are scaled by the layer count), and in report.md the paged-over-arena overhead per
page size, a latency table and, where a row syncs the host or Nsight Systems measured it, the
host syncs of every layer side by side.

Context steps (`bench prefill`) are rows whose stored rows per request (the `accepted` column)
exceed the block size; they are summarised apart from decode steps, as "context <rows>".
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import pandas as pd

from drafter_attn.bench.options import BenchError
from drafter_attn.bench.output import BASELINE_DASH, ctx_axis, markdown_table, save_figure
from drafter_attn.kernels import baselines, tuned_table
from drafter_attn.tuner.cli_checks import write_whole

GEOM_COLS = ["num_q_heads", "num_kv_heads", "head_dim", "block_size", "mask", "window", "num_layers", "dtype"]


def load(db_path, sm: int | None = None, preset: str | None = None) -> pd.DataFrame:
    from drafter_attn.tuner.db import ProfileDB, SchemaError

    sql = ("SELECT r.*, r.id AS row_order, e.gpu_name, e.sm "
           "FROM results r JOIN environments e ON r.env_id = e.env_id "
           "WHERE r.status = 'ok' AND (r.median_us IS NOT NULL OR "
           f"(r.impl IN ({', '.join(repr(n) for n in baselines.NAMES)}) "
           "AND r.attention_median_us IS NOT NULL))")
    args: list = []
    if sm is not None:
        sql += " AND e.sm = ?"
        args.append(sm)
    try:
        with ProfileDB(db_path, readonly=True) as db:
            rows = db.query(sql, args)
    except SchemaError as exc:  # missing, foreign, empty or corrupt: nothing is written
        raise BenchError(f"bench report: {exc}") from None
    # the report compares burst timings: rows timed after a sustained load (`--sustain`,
    # another clock regime) would stand beside them as if the kernel had slowed
    df = pd.DataFrame([r for r in rows if tuned_table.row_regime(r) == "burst"])
    if df.empty:
        where = f" for SM {sm}" if sm is not None else ""
        raise BenchError(f"bench report: no measured (ok) results{where} in {db_path}; run "
                         f"`bench decode` on a GPU{where and f' of SM {sm}'} first")
    # newest last; rows stamped in the same millisecond keep their insert order. A candidate
    # measured again on the same GPU model under another environment (new kernel sources after
    # `tuner rekey`, a new driver) is its newest measurement: the older rows stay in the
    # database for the record, but one row per candidate and GPU enters the report.
    gpu = ["sm", "gpu_name"]
    df = df.sort_values(["created_at", "row_order"]).drop_duplicates([*gpu, "candidate_key"],
                                                                     keep="last")
    # several parameter sets of one implementation (a tuning sweep, the shipped profiles): its
    # fastest stands for it, so paged and arena are compared one row each
    same = [*gpu, "impl", *GEOM_COLS, "layout", "page_size", "accepted", "batch", "ctx_len"]
    df = (df.sort_values(["median_us", "row_order"], na_position="last")
          .drop_duplicates(same, keep="first").sort_values("row_order"))
    df["window"] = df["window"].astype("Int64")
    df["step"] = [step_label(a, b) for a, b in zip(df["accepted"], df["block_size"])]
    df = _attach_baseline(df)
    if preset is not None:
        df = df[df["preset"] == preset]
        if df.empty:
            raise BenchError(f"bench report: no measured results for preset {preset!r} in {db_path}")
    return df


def step_label(accepted, block_size) -> str:
    """A row's step: a context step of `accepted` rows, a decode step storing the whole block
    (NULL or Qb), or one storing fewer (`bench decode --accepted`): apart in every table and
    plot, since a step that stores fewer rows is another workload."""
    if pd.isna(accepted) or accepted == block_size:
        return "decode"
    return f"context {accepted:g}" if accepted > block_size else f"decode {accepted:g} rows"


def _attach_baseline(df: pd.DataFrame) -> pd.DataFrame:
    """Put the baseline rows beside every drafter geometry of the same shape (same SM): rows
    measured over its layer count in one call (`bench decode`) as they are, else one layer's
    (the attention table, and `bench decode` before it timed every layer) times its layer
    count, labelled so: that charges the baseline a launch per layer, which a step pays once."""
    is_base = df["impl"].map(baselines.is_baseline).astype(bool)
    base, ours = df[is_base], df[~is_base]
    keys = [c for c in GEOM_COLS if c != "num_layers"]
    shape = [c for c in ("impl", "page_size", "batch", "ctx_len", "sustain_s", "sustain_load") if c in df]
    extra = []
    for _, g in ours.drop_duplicates(["sm", *GEOM_COLS]).iterrows():
        match = base[base["sm"] == g["sm"]]
        for k in keys:
            same = (match[k] == g[k]).fillna(False).astype(bool) if pd.notna(g[k]) else match[k].isna()
            match = match[same]
        L = int(g["num_layers"])
        whole = match[match["num_layers"] == L].copy()
        one = match[match["num_layers"] == 1].copy() if L != 1 else match.iloc[0:0]
        if not whole.empty and not one.empty:  # a shape measured over all L layers needs no scaling
            have = pd.MultiIndex.from_frame(whole[shape].astype(str))
            one = one[~pd.MultiIndex.from_frame(one[shape].astype(str)).isin(have)]
        for m, scale, label in ((whole, 1, "attention only"), (one, L, f"attention, 1 layer x{L}")):
            if m.empty:
                continue
            for c in ("median_us", "p10_us", "p90_us"):  # its time is in attention_* (no step latency)
                m[c] = m[f"attention_{c}"].fillna(m[c]) * scale
            m["num_layers"] = L
            m["preset"] = g["preset"]
            m["impl"] = [f"{impl} ({label})" for impl in m["impl"]]
            extra.append(m)
    return pd.concat([ours, *extra], ignore_index=True) if extra else ours.reset_index(drop=True)


def _geometry_label(row) -> str:
    from drafter_attn.bench.options import describe
    from drafter_attn.kernels.spec import Geometry

    g = Geometry(int(row["num_q_heads"]), int(row["num_kv_heads"]), int(row["head_dim"]),
                 int(row["block_size"]), row["mask"], None if pd.isna(row["window"]) else int(row["window"]),
                 int(row["num_layers"]), row["dtype"])
    return describe(g)


def overheads(df: pd.DataFrame) -> pd.DataFrame:
    """Paged over arena, percent, per (group, impl, accepted, page, batch, ctx)."""
    keys = ["sm", "gpu_name", *GEOM_COLS, "step", "impl", "accepted", "batch", "ctx_len"]
    d = df.copy()
    d["accepted"] = d["accepted"].fillna(-1)
    arena = d[d["layout"] == "arena"].set_index(keys)["median_us"]
    paged = d[(d["layout"] == "paged") & ~d["impl"].map(baselines.is_baseline).astype(bool)].copy()
    if paged.empty or arena.empty:
        return paged.assign(overhead_pct=pd.Series(dtype=float))
    idx = pd.MultiIndex.from_frame(paged[keys])
    paged["overhead_pct"] = (paged["median_us"].to_numpy() / arena.reindex(idx).to_numpy() - 1) * 100
    return paged.dropna(subset=["overhead_pct"])


def _series(r) -> str:
    if r["layout"] == "arena":
        return f"{r['impl']} arena"
    return f"{r['impl']} page {int(r['page_size'])}"


def plot_group(g: pd.DataFrame, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(g["step"].unique(), key=lambda s: s != "decode")
    batches = sorted(g["batch"].unique())
    fig, axes = plt.subplots(len(steps), len(batches), squeeze=False,
                             figsize=(4.6 * len(batches), 3.6 * len(steps)))
    pages = sorted(g.loc[g["layout"] == "paged", "page_size"].dropna().unique())
    cmap = plt.get_cmap("viridis")
    for i, step in enumerate(steps):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            panel = g[(g["step"] == step) & (g["batch"] == batch)].copy()
            panel["series"] = [_series(r) for _, r in panel.iterrows()]
            panel = panel.sort_values(["created_at", "row_order"]).drop_duplicates(
                ["series", "ctx_len", "accepted"], keep="last")
            for label, s in panel.groupby("series"):
                s = s.sort_values("ctx_len")
                r0 = s.iloc[0]
                if baselines.is_baseline(r0["impl"]):
                    style = dict(color="tab:red", linestyle=BASELINE_DASH.get(str(r0["impl"]).split(" (")[0], "--"),
                                 marker="x")
                elif r0["layout"] == "arena":
                    style = dict(color="black", marker="s", linewidth=2)
                else:
                    k = pages.index(r0["page_size"])
                    style = dict(color=cmap(0.15 + 0.7 * k / max(1, len(pages) - 1)), marker="o")
                x = s["ctx_len"].clip(lower=1)
                lo = (s["median_us"] - s["p10_us"].fillna(s["median_us"])).clip(lower=0)
                hi = (s["p90_us"].fillna(s["median_us"]) - s["median_us"]).clip(lower=0)
                ax.errorbar(x, s["median_us"], yerr=[lo, hi],
                            label=label, capsize=2, markersize=4, **style)
            ctx_axis(ax, sorted({max(int(c), 1) for c in panel["ctx_len"]}))
            ax.set_ylim(bottom=0)
            ax.set_ylabel("latency, median (us)")
            ax.set_title(f"{step}, batch {batch}", fontsize=10)
            ax.legend(fontsize=7)
    save_figure(fig, path, title)


SYNC_COLUMNS = {"syncs_debug": "debug", "syncs_profiler": "profiler", "syncs_nsys": "nsys",
                "sync_host_us": "blocked us (profiler)", "sync_host_us_nsys": "blocked us (nsys)"}


def sync_table(g: pd.DataFrame) -> pd.DataFrame:
    """The rows of `g` that Nsight Systems measured or that sync the host, with every layer's
    figures side by side (empty when there are none)."""
    if g.empty or not set(SYNC_COLUMNS) <= set(g.columns):
        return pd.DataFrame()
    counts = g[list(tuned_table.SYNC_COLUMNS)].apply(pd.to_numeric)
    keep = g["syncs_nsys"].notna() | (counts.fillna(0) > 0).any(axis=1)
    if not keep.any():
        return pd.DataFrame()
    t = g[keep].copy()
    t["layout"] = [f"paged {int(p)}" if lay == "paged" else "arena" for lay, p in zip(t["layout"], t["page_size"])]
    t = t[["step", "impl", "layout", "batch", "ctx_len", *SYNC_COLUMNS]].rename(columns=SYNC_COLUMNS)
    for c in ("debug", "profiler", "nsys"):
        t[c] = pd.to_numeric(t[c]).astype("Int64")
    return t.sort_values(["step", "impl", "layout", "batch", "ctx_len"]).reset_index(drop=True)


def _provenance_counts(df: pd.DataFrame) -> str:
    """"54 measured rows", or "3 measured and 54 predicted rows" (tuner predict's projections)."""
    predicted = int((df["provenance"] == "predicted").sum()) if "provenance" in df else 0
    measured = len(df) - predicted
    return (f"{measured} measured and {predicted} predicted rows" if predicted
            else f"{measured} measured rows")


def build(df: pd.DataFrame, out: Path, db_path) -> tuple[Path, list[Path]]:
    """Write the PNGs and report.md under `out`; returns the markdown's path and the PNGs'."""
    out.mkdir(parents=True, exist_ok=True)
    ov = overheads(df)
    slugs: set[str] = set()
    lines = [f"# bench report, {dt.date.today():%Y-%m-%d}", "",
             f"From `{db_path}`: {_provenance_counts(df)} (latest per candidate; of several parameter "
             f"sets of one implementation for one problem, the fastest), "
             f"{df['env_id'].nunique()} environment(s).",
             "Latency is the whole drafter step (every layer: store + attention), median of CUDA graph "
             "replays; baseline rows are every layer's attention, no store (\"1 layer xL\": one layer timed "
             "alone, times the layer count). The goal: paged "
             "within 1% of arena at page sizes 64 and 128.", ""]
    plots: list[Path] = []
    groups = df.groupby(["sm", "gpu_name", *GEOM_COLS], dropna=False, sort=True)
    for key, g in groups:
        sm, gpu = int(key[0]), key[1]
        first = g.iloc[0]
        names = sorted({p for p in g["preset"].dropna().unique()})
        geom = _geometry_label(first)
        label = f"{', '.join(names)} ({geom})" if names else geom
        png = out / f"report-sm{sm}-{_slug(names[0] if names else geom, slugs)}.png"
        plot_group(g, png, f"{gpu} (SM {sm}): {label}")
        plots.append(png)
        lines += [f"## SM {sm}, {gpu}: {label}", "", f"![latency]({png.name})", ""]
        gov = ov.merge(g[["uid"]], on="uid") if not ov.empty else ov
        if not gov.empty:
            s = (gov.groupby(["step", "impl", "page_size"])["overhead_pct"]
                 .agg(median="median", min="min", max="max", rows="count").reset_index())
            within = gov.assign(ok=gov["overhead_pct"] <= 1).groupby(["step", "impl", "page_size"])["ok"].mean()
            s["within 1%"] = [f"{within[(a, b, c)]:.0%}" for a, b, c in zip(s["step"], s["impl"], s["page_size"])]
            s["page_size"] = s["page_size"].astype(int)
            s = s.rename(columns={"median": "median overhead %", "min": "min %", "max": "max %"})
            lines += ["Paged over arena (percent of the arena step's median latency):", "", markdown_table(s), ""]
        t = g.copy()
        t["series"] = [_series(r) for _, r in t.iterrows()]
        wide = (t.pivot_table(index=["step", "batch", "ctx_len"], columns="series", values="median_us", aggfunc="last")
                .reset_index())
        wide.columns.name = None
        lines += ["Median latency (us):", "", markdown_table(wide), ""]
        syncs = sync_table(g)
        if not syncs.empty:
            lines += ["Host syncs per step, every layer that ran (debug: torch sync-debug mode, profiler: "
                      "torch profiler, nsys: Nsight Systems; blocked: host time inside the blocking calls):",
                      "", markdown_table(syncs), ""]
    path = write_whole(out / "report.md", lambda tmp: tmp.write_text("\n".join(lines)))
    return path, plots


def _slug(name: str, taken: set) -> str:
    """A file-name part from a preset or geometry name: the database's text is untrusted, so
    anything but letters, digits, '.', '-' and '_' becomes '_' (no '/' or '..' can leave --out),
    and a name already used gets a number."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", name).replace("..", "_").strip("._-") or "geometry"
    slug, n = base[:80], 2
    while slug in taken:
        slug, n = f"{base[:80]}-{n}", n + 1
    taken.add(slug)
    return slug
