"""What `bench decode` / `bench prefill` show and write: a rich table in the terminal, and CSV,
JSON (rows plus environment and command line) and a PNG plot (step latency against context, one
line per page size, arena and the baseline beside) in the results folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from drafter_attn.kernels.baselines import is_baseline
from drafter_attn.kernels.footprint import fmt_bytes
from drafter_attn.kernels.tuned_table import SYNC_COLUMNS
from drafter_attn.tuner.cli_checks import write_whole

# Line style of each baseline in the plots (colour follows the page size).
BASELINE_DASH = {"flashinfer-fa2": "--", "flashinfer-fa2-graph": ":", "trtllm-xqa": "-."}

# CSV column order (anything else a row carries follows).
COLUMNS = (
    "step", "chunk", "preset", "impl_option", "impl", "params", "impl_note", "scope", "layout",
    "page_size", "table_capacity", "max_ctx_hint", "batch", "ctx", "accepted", "rows_stored", "layers",
    "status", "reason",
    "median_us", "p10_us", "p90_us", "mean_us", "min_us", "count", "repeat_median_us", "l2_flushed",
    "overhead_pct", "over_fitted_pct", "attention_median_us", "attention_p10_us", "attention_p90_us",
    "store_median_us", "store_p10_us", "store_p90_us",
    "syncs", "syncs_debug", "syncs_profiler", "sync_host_us", "dtoh_copies", "syncs_nsys",
    "sync_host_us_nsys", "graph_capturable", "sync_note",
    "bytes_moved", "bandwidth_gbs", "copy_bandwidth_gbs", "roofline_fraction", "rel_err",
    "kv_concurrency", "kv_max_ctx", "kv_model_bytes", "kv_arena_model_bytes", "kv_arena_over_paged",
    "kv_bytes", "workspace_bytes", "peak_bytes", "elapsed_s",
)


INT_COLUMNS = ("chunk", "page_size", "table_capacity", "batch", "ctx", "layers", "count", "syncs", "syncs_debug",
               "syncs_profiler", "dtoh_copies", "syncs_nsys", "bytes_moved", "kv_concurrency",
               "kv_max_ctx", "kv_model_bytes", "kv_arena_model_bytes", "kv_bytes", "workspace_bytes",
               "peak_bytes")


# Ratios judged against targets a hundredth apart (paged over arena at most 1.01, a kernel
# within 1.05x of its read floor): four decimals, so that 1.0104, a miss, never reads 1.01.
RATIO_COLUMNS = ("x_floor", "over_arena", "over_arena_min", "over_arena_max")


def _cell(x, ratio: bool = False) -> str:
    if x is None or (isinstance(x, float) and x != x) or x is pd.NA:
        return ""
    if isinstance(x, float):
        return f"{x:.4f}" if ratio else f"{x:.4g}"
    return str(x)


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table, floats to 4 significant digits and ratios (`RATIO_COLUMNS`) to
    4 decimals (pandas' to_markdown needs tabulate, which is not a dependency)."""
    if df.empty:
        return "(none)"
    head = [str(c) for c in df.columns]
    ratio = [c in RATIO_COLUMNS for c in head]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(x, r) for x, r in zip(row, ratio)) + " |")
    return "\n".join(lines)


def text_table(df: pd.DataFrame) -> str:
    """`df` for the terminal, in `markdown_table`'s number formats."""
    return df.to_string(index=False, float_format=lambda x: f"{x:.4g}",
                        formatters={c: lambda x: _cell(x, True) for c in RATIO_COLUMNS if c in df})


def frame(rows: list[dict]) -> pd.DataFrame:
    """The rows as a table, known columns first; integer columns stay integers beside blanks."""
    df = pd.DataFrame(rows)
    cols = [c for c in COLUMNS if c in df] + [c for c in df if c not in COLUMNS]
    df = df[cols]
    for c in INT_COLUMNS:
        if c in df:
            df[c] = pd.to_numeric(df[c]).round().astype("Int64")
    return df


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _f(x, fmt: str, none: str = "-") -> str:
    return format(x, fmt) if _num(x) else none


def _layout(r: dict) -> str:
    """'paged 64', 'arena'; a block table sized for more than the context adds 't128k' (its
    capacity in tokens) and '+hint' when the attention got the max_ctx hint: 'paged 64 t128k+hint'
    ('paged 64 +hint' on a fitted table)."""
    if r["layout"] != "paged":
        return "arena"
    text = f"paged {r['page_size']} "
    if _num(r.get("table_capacity")):
        text += f"t{_ctx(int(r['table_capacity']))}"
    if r.get("max_ctx_hint") is True:
        text += "+hint"
    return text.rstrip()


def _ctx(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // (1 << 20)}M" if n % (1 << 20) == 0 else f"{n // 1024}k"
    return str(n)


def sort_key(r: dict):
    base = is_baseline(r["impl"])
    table = r.get("table_capacity")
    return (r["step"], r.get("chunk") or 0, r["batch"], r["ctx"], base, r["impl_option"],
            r["layout"] != "arena", r.get("page_size") or 0, table if _num(table) else 0,
            r.get("max_ctx_hint") is True)


def _over(r: dict) -> str:
    over = r.get("overhead_pct")
    if not _num(over):
        return "-"
    style = "green" if abs(over) <= 1 else ("yellow" if over <= 5 else "red")
    return f"[{style}]{over:+.3f}%[/]"  # three decimals: +1.004% is a miss of the 1% goal


def _syncs(r: dict) -> str:
    """Blocking host syncs per step from each layer side by side: sync-debug mode / torch
    profiler / Nsight Systems ("-" where a layer did not run), red when any is not zero."""
    if r.get("status") != "ok":
        return "-"
    layers = [r.get(k) for k in SYNC_COLUMNS]
    if all(not _num(v) for v in layers):
        return "n/a"
    text = "/".join(str(int(v)) if _num(v) else "-" for v in layers)
    return f"[red]{text}[/]" if any(_num(v) and v for v in layers) else text


def _blocked(r: dict) -> str:
    """Host time blocked per step (us): torch profiler / Nsight Systems."""
    if r.get("status") != "ok":
        return "-"
    layers = [r.get(k) for k in ("sync_host_us", "sync_host_us_nsys")]
    if all(not _num(v) for v in layers):
        return "-"
    return "/".join(_f(v, ".1f") for v in layers)


def _status(r: dict, width: int = 80) -> str:
    from rich.markup import escape

    if r.get("status") == "ok":
        return "ok"
    reason = str(r.get("reason") or "").strip().splitlines()
    return f"[red]{escape(str(r.get('status')))}[/]" + (f": {escape(reason[0][:width])}" if reason else "")


def _over_fitted(r: dict) -> str:
    over = r.get("over_fitted_pct")
    if not _num(over):
        return "-"
    style = "green" if over <= 3 else ("yellow" if over <= 10 else "red")
    return f"[{style}]{over:+.2f}%[/]"


def _x_floor(r: dict) -> str:
    """How far above the read floor of its own bytes a row is (1.00x = at the floor)."""
    floor, median = r.get("read_floor_us"), r.get("median_us")
    return f"{median / floor:.3f}x" if _num(floor) and _num(median) and floor > 0 else "-"


def _impl(r: dict) -> str:
    """The implementation a row ran, after the option that chose it when they differ
    (`auto->cupy`), so `--impl auto,cupy` rows stay apart."""
    option = r.get("impl_option") or r["impl"]
    return r["impl"] if option == r["impl"] else f"{option}->{r['impl']}"


# (header, justify, cell, view): view None shows in both tables, "wide" only with --wide, "narrow"
# only without it, "table" only when some row has a --table-capacity table. The default (narrow)
# set fits a 120-column terminal.
TABLE_COLUMNS = (
    ("step", "left", lambda r: r["step"] + (f" {_ctx(r['chunk'])}" if r.get("chunk") else ""), None),
    ("impl", "left", lambda r: _impl(r) + (" (attn only)" if r.get("scope", "step") != "step" else ""), None),
    ("layout", "left", _layout, None),
    ("B", "right", lambda r: str(r["batch"]), None),
    ("ctx", "right", lambda r: _ctx(r["ctx"]), None),
    ("median us", "right", lambda r: _f(r.get("median_us"), ".1f"), None),
    ("p10-p90 us", "right", lambda r: f"{_f(r.get('p10_us'), '.1f')}-{_f(r.get('p90_us'), '.1f')}"
     if r.get("status") == "ok" else "-", "wide"),
    ("attn us", "right", lambda r: _f(r.get("attention_median_us"), ".1f"), None),
    ("store us", "right", lambda r: _f(r.get("store_median_us"), ".1f"), "wide"),
    ("vs arena", "right", _over, None),
    ("vs fit", "right", _over_fitted, "table"),
    ("x floor", "right", _x_floor, None),
    ("read floor us", "right", lambda r: _f(r.get("read_floor_us"), ".1f"), "wide"),
    ("syncs", "right", _syncs, None),
    ("blocked us p/n", "right", _blocked, "wide"),
    ("KV (model)", "right", lambda r: fmt_bytes(r["kv_model_bytes"]) if _num(r.get("kv_model_bytes")) else "-", None),
    ("GB/s", "right", lambda r: _f(r.get("bandwidth_gbs"), ".0f"), "wide"),
    ("copy roofline", "right", lambda r: _f(r.get("roofline_fraction"), ".2f"), "wide"),
    ("rel err", "right", lambda r: _f(r.get("rel_err"), ".1e"), "wide"),
    ("status", "left", lambda r: _status(r, 24), "narrow"),
    ("status", "left", _status, "wide"),
)


def print_table(rows: list[dict], title: str, console=None, wide: bool = False) -> None:
    """The rows as a rich table: the essentials (fits 120 columns), or every column with `wide`."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=220 if wide else 120)
    tables = any(_num(r.get("table_capacity")) for r in rows)
    views = (None, "wide" if wide else "narrow") + (("table",) if tables else ())
    columns = [c for c in TABLE_COLUMNS if c[3] in views]
    caption = ("x floor: median over the read floor of the same bytes (1.00x = at the floor); "
               "syncs: blocking host syncs per step, sync-debug mode/torch profiler/Nsight Systems "
               "(- not run); --wide shows every column, the host time they blocked too") if not wide else ""
    if tables:
        caption += ("; tN: the block table sized for N tokens (the pool holds only the pages "
                    "needed); +hint: the attention got the host-side max_ctx; vs fit: over the "
                    "same row with a table fitted to the context")
    t = Table(title=title, title_justify="left", show_lines=False, header_style="bold", box=box.SIMPLE_HEAD,
              padding=(0, 1), pad_edge=False, collapse_padding=True,
              caption=caption.lstrip("; ") or None, caption_justify="left")
    for name, justify, _, _ in columns:
        t.add_column(name, justify=justify, no_wrap=name not in ("status", "impl"),
                     overflow="fold" if name == "impl" else "ellipsis")
    for r in sorted(rows, key=sort_key):
        t.add_row(*(escape(cell(r)) if name == "impl" else cell(r) for name, _, cell, _ in columns))
    console.print(t)


def write_csv(rows: list[dict], path: Path) -> None:
    write_whole(path, lambda tmp: frame(rows).to_csv(tmp, index=False))


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_json(rows: list[dict], meta: dict, settings: dict, path: Path, summary: list[str]) -> None:
    doc = dict(environment=meta, settings=settings, summary=summary,
               rows=[{k: _jsonable(v) for k, v in r.items()} for r in rows])
    text = json.dumps(doc, indent=1, default=str) + "\n"
    write_whole(path, lambda tmp: tmp.write_text(text))


def series_label(r: dict) -> str:
    if is_baseline(r["impl"]):
        return f"{r['impl']} page {r['page_size']} (attention only)"
    return f"{_impl(r)} {_layout(r)}"


def _style(r: dict, pages: list, cmap) -> dict:
    if is_baseline(r["impl"]):
        k = pages.index(r["page_size"]) if r["page_size"] in pages else 0
        dash = BASELINE_DASH.get(r["impl"], "--")
        return dict(color=("tab:red", "tab:orange", "tab:pink", "tab:brown")[k % 4], linestyle=dash, marker="x")
    if r["layout"] == "arena":
        return dict(color="black", linestyle="-", marker="s", linewidth=2)
    k = pages.index(r["page_size"])
    wide = _num(r.get("table_capacity"))
    dash = (":" if r.get("max_ctx_hint") is True else "--") if wide else "-"
    return dict(color=cmap(0.15 + 0.7 * k / max(1, len(pages) - 1)), linestyle=dash,
                marker="^" if wide else "o")


def ctx_axis(ax, ctxs) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctxs, [_ctx(c) for c in ctxs])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.grid(True, alpha=0.3)


def save_figure(fig, path: Path, title: str) -> None:
    """The plots' common ending: a title, a tight layout, the PNG (whole or none: a full disk
    leaves no truncated file), the figure freed even on failure."""
    import matplotlib.pyplot as plt

    try:
        fig.suptitle(title, fontsize=11)
        fig.tight_layout()
        write_whole(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Per step kind, two rows of panels (one panel per batch): median step latency (p10-p90
    bars) against context, one line per series (arena solid black, pages coloured, the baseline
    dashed); and the paged-over-arena overhead in percent (the 1% goal shaded). False when no
    row was measured ok."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok" and _num(r.get("median_us"))]
    if not ok:
        return False
    steps = sorted({(r["step"], r.get("chunk") or 0) for r in ok}, key=lambda s: (s[0] != "decode", s[1]))
    batches = sorted({r["batch"] for r in ok})
    fig, axes = plt.subplots(2 * len(steps), len(batches), squeeze=False,
                             figsize=(4.6 * len(batches), 3.4 * 2 * len(steps)))
    pages = sorted({r["page_size"] for r in ok if r["layout"] == "paged"})
    cmap = plt.get_cmap("viridis")
    for i, (step, chunk) in enumerate(steps):
        name = step + (f" chunk {_ctx(chunk)}" if chunk else "")
        for j, batch in enumerate(batches):
            ax, ax_over = axes[2 * i][j], axes[2 * i + 1][j]
            panel = [r for r in ok if r["step"] == step and (r.get("chunk") or 0) == chunk and r["batch"] == batch]
            ctxs = sorted({max(r["ctx"], 1) for r in panel})
            for label in sorted({series_label(r) for r in panel}):
                pts = sorted((r for r in panel if series_label(r) == label), key=lambda r: r["ctx"])
                style = _style(pts[0], pages, cmap)
                x = [max(r["ctx"], 1) for r in pts]
                y = [r["median_us"] for r in pts]
                lo = [max(0.0, r["median_us"] - r["p10_us"]) if _num(r.get("p10_us")) else 0 for r in pts]
                hi = [max(0.0, r["p90_us"] - r["median_us"]) if _num(r.get("p90_us")) else 0 for r in pts]
                ax.errorbar(x, y, yerr=[lo, hi], label=label, capsize=2, markersize=4, **style)
                over = [(max(r["ctx"], 1), r["overhead_pct"]) for r in pts if _num(r.get("overhead_pct"))]
                if over:
                    ax_over.plot(*zip(*over), label=label, markersize=4, **style)
            ctx_axis(ax, ctxs)
            ax.set_ylim(bottom=0)
            ax.set_ylabel("step latency, median (us)")
            ax.set_title(f"{name}, batch {batch}", fontsize=10)
            ax.legend(fontsize=7)
            ctx_axis(ax_over, ctxs)
            ax_over.axhspan(-1, 1, color="tab:green", alpha=0.12, label="within 1%")
            ax_over.axhline(0, color="black", linewidth=1)
            ax_over.set_ylabel("paged over arena (%)")
            ax_over.set_title(f"{name}, batch {batch}: paged overhead", fontsize=10)
            ax_over.legend(fontsize=7)
    save_figure(fig, path, title)
    return True
