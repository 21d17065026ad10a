"""One drafter layer's attention, paged (several page sizes) against arena against the baselines,
over batches and context lengths, with the copy roofline and the read floor measured in the same run.

    python -m drafter_attn.bench.attention_table --preset qwen3-8b-dflash-b16 --batch 1,8,32 \\
        --ctx 2k,8k,32k --page 16,64,128 --impl cupy --baseline auto --out results/sm90-attention

Each kernel point is a one-layer decode step measured by tuner.measure, exactly as `tuner sweep`
and `bench decode` measure (checked against the torch reference first, then CUDA graph replays,
L2 flushed, the attention and store halves timed alone), and recorded in the profile database.
The table shows the attention half beside the read floor of the attention's own bytes. The
baselines (kernels.baselines: flashinfer-fa2, flashinfer-fa2-graph, trtllm-xqa) are measured by
tuner.measure.measure_baseline. Prints a table and writes attention.csv (after every row),
attention.json and attention.md under --out.

`--impl auto` measures what kernels.Runtime runs: at each point and layout, the pick of the tuned
table ($DRAFTER_TUNED_TABLE, else $DRAFTER_DB, else the table shipped for this GPU's SM, else the
default heuristic); the `pick` column names the kernel and parameters that ran. `auto:sustained`
picks from the sustained regime's table (kernels.tuned_table.REGIMES), `auto:burst` from the
burst one, so that one run can time both tables' picks side by side.

Ratios of a few percent (paged over arena, one variant over another) drift with the machine
between measurements minutes apart more than within one. `--rounds N` measures every point's
columns N times, interleaved (all of a point's kernels, then all again), computes each ratio
within a round, and adds a summary per point: the median over rounds and the ratios' range
(attention_rounds.md / .csv).

`sm_mhz` is the SM clock the GPU ran at while the point's step was timed (NVML; empty without
it). Under a sustained memory-bound load the H200 holds its power limit by lowering that clock,
and the warp-specialised kernels slow with it where the pipelined ones do not: `--sustain S`
replays each point's step back to back for S seconds before each of its timings, so that the
table compares the kernels in the clock state their own load brings the GPU to, as in a serving
loop, rather than in short bursts on a cool GPU (the read floors are timed without it: a
streaming read does not slow with the SM clock).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import uuid
from pathlib import Path

import pandas as pd

from drafter_attn.bench.options import sizes
from drafter_attn.bench.output import markdown_table, text_table
from drafter_attn.tuner.cli_checks import add_sustain_load, load_without_sustain, non_negative_float, write_whole
from drafter_attn.tuner.sizes import parse_size
from drafter_attn.kernels import baselines, registry
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem

COLUMNS = ("impl", "pick", "layout", "page", "batch", "ctx", "round", "attn_us", "read_floor_us", "x_floor",
           "copy_floor_us", "p10_us", "p90_us", "sm_mhz", "over_arena", "rel_err", "status", "reason")
POINT = ["impl", "layout", "page", "batch", "ctx"]


AUTO = "auto"


def auto_regime(spec: str) -> str | None:
    """The clock regime whose tuned table an --impl item picks from: "auto" the runtime's
    default ($DRAFTER_REGIME, else burst), "auto:burst" / "auto:sustained" that regime's; None
    for a kernel spec. SystemExit for an unknown regime."""
    from drafter_attn.kernels.tuned_table import REGIMES, default_regime

    name, sep, regime = spec.partition(":")
    if name != AUTO:
        return None
    if not sep:
        return default_regime()
    if regime not in REGIMES:
        raise SystemExit(f"--impl {spec}: the regime must be one of {', '.join(REGIMES)}")
    return regime


def _candidate(spec: str, geometry, layout: str, page: int | None, batch: int, ctx: int, preset: str):
    from drafter_attn.tuner.spec import Candidate

    name, params = registry.parse_spec(spec)
    problem = Problem(geometry.with_(num_layers=1), layout, page, batch, ctx)
    return Candidate(problem, name, tuple(sorted(params.items())), None, preset)


def pick_spec(dispatcher, geometry, layout: str, page: int | None, batch: int, ctx: int, sm: int | None) -> str:
    """The backend spec (registry.format_spec) of what the runtime's dispatcher picks for one
    point."""
    pick = dispatcher.pick(Problem(geometry.with_(num_layers=1), layout, page, batch, ctx), sm)
    return registry.format_spec(pick.impl, pick.params)


def measure_kernel(spec: str, geometry, layout: str, page: int | None, batch: int, ctx: int, *,
                   reps: int, preset: str, record, label: str | None = None, sustain_s: float = 0.0,
                   sustain_load: str = "") -> dict:
    """One kernel point: a one-layer step through tuner.measure, recorded; its attention half
    beside the read floor of the attention's bytes. The row's impl is `label` (default `spec`),
    its pick `spec`; each timing after `sustain_s` of back-to-back replays, or of
    `sustain_load`'s co-runner."""
    import torch

    from drafter_attn.tuner import floors, roofline
    from drafter_attn.tuner.measure import measure_candidate

    cand = _candidate(spec, geometry, layout, page, batch, ctx, preset).sustained(sustain_s, sustain_load)
    result = measure_candidate(cand.to_wire(), reps=reps)
    record(cand, result)
    row = dict(impl=label or spec, pick=spec, layout=layout, page=page or 0, batch=batch, ctx=ctx,
               status=result["status"], reason=result.get("reason"), rel_err=result.get("rel_err"),
               sm_mhz=result.get("sm_clock_mhz"))
    if result.get("attention_median_us") is not None:  # ok, or a timed diagnostic variant
        attn = result["attention_median_us"]
        # the step's attention runs after its store: it reads ctx + Qb context rows a request
        # (tuner.step.roofline_bytes), the baselines ctx (their floors are their own)
        nbytes = roofline.call_bytes(geometry, batch, ctx + geometry.block_size, page)
        floor = floors.read_floor(nbytes).median_us
        row.update(attn_us=attn, p10_us=result["attention_p10_us"], p90_us=result["attention_p90_us"],
                   read_floor_us=floor, x_floor=attn / floor, bytes=nbytes,
                   copy_floor_us=nbytes / roofline.copy_bandwidth() * 1e6)
    torch.cuda.empty_cache()
    return row


def measure_base(name: str, geometry, page: int, batch: int, ctx: int, *, reps: int, preset: str,
                 seed: int, record, sustain_s: float = 0.0, sustain_load: str = "") -> dict:
    from drafter_attn.tuner.measure import measure_baseline
    from drafter_attn.tuner.spec import Candidate

    result = measure_baseline(name, geometry, page, batch, ctx, reps=reps, seed=seed, sustain_s=sustain_s,
                              sustain_load=sustain_load)
    cand = Candidate(Problem(geometry.with_(num_layers=1), "paged", page, batch, ctx), name, (), None,
                     preset).sustained(sustain_s, sustain_load)
    record(cand, result)
    row = dict(impl=name, pick=name, layout="paged", page=page, batch=batch, ctx=ctx,
               status=result["status"], reason=result.get("reason"), sm_mhz=result.get("sm_clock_mhz"))
    if result["status"] == "ok":
        row.update(attn_us=result["median_us"], p10_us=result["p10_us"], p90_us=result["p90_us"],
                   read_floor_us=result["read_floor_us"], x_floor=result["median_us"] / result["read_floor_us"],
                   bytes=result["bytes_moved"],
                   copy_floor_us=result["bytes_moved"] / (result["copy_bandwidth_gbs"] * 1e3))
    return row


def with_overheads(df: pd.DataFrame) -> pd.DataFrame:
    """Paged over arena (same impl, batch, context and round), for the kernels (baselines have
    no arena)."""
    if "attn_us" not in df:
        return df
    if "round" not in df:
        df["round"] = 0
    arena = df[df.layout == "arena"].set_index(["impl", "batch", "ctx", "round"])["attn_us"]
    df["over_arena"] = [r.attn_us / arena.get((r.impl, r.batch, r.ctx, r.round), float("nan"))
                        if r.layout == "paged" and not baselines.is_baseline(r.impl) else float("nan")
                        for r in df.itertuples()]
    return df


# Sizes this close read in the same time within the timing's resolution (a paged call's bytes
# and the arena's differ by the block table's few hundred bytes).
SAME_FLOOR_BYTES = 0.005


def lowest_floors(df: pd.DataFrame) -> pd.DataFrame:
    """Every row's read floor the lowest measured in the run for its bytes or for any size within
    `SAME_FLOOR_BYTES` of them (a floor is a lower bound, and one timing of it can come out high:
    an H200 run timed B=1 8k's paged bytes at 20.2 us and the arena's, 512 bytes fewer, at 11.5),
    `x_floor` over that."""
    if "read_floor_us" not in df:
        return df
    sizes, same, start = sorted(df["bytes"].dropna().unique()), {}, None
    for size in sizes:  # consecutive sizes within the tolerance of their run's first share it
        if start is None or size > start * (1 + SAME_FLOOR_BYTES):
            start = size
        same[size] = start
    df["read_floor_us"] = df.groupby(df["bytes"].map(same))["read_floor_us"].transform("min")
    df["x_floor"] = df["attn_us"] / df["read_floor_us"]
    return df


def rounds_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per point over its rounds: the median attention time, its smallest and largest round, and
    paged over arena as the median, smallest and largest of the per-round ratios (empty when no
    point was timed)."""
    if "attn_us" not in df:
        return pd.DataFrame(columns=POINT)
    ok = df.dropna(subset=["attn_us"])
    g = ok.groupby(POINT, sort=False)
    picked = {"pick": ("pick", "first")} if "pick" in ok else {}  # what `auto` ran
    out = g.agg(**picked, rounds=("attn_us", "size"), attn_us=("attn_us", "median"),
                attn_min_us=("attn_us", "min"), attn_max_us=("attn_us", "max"),
                over_arena=("over_arena", "median"), over_arena_min=("over_arena", "min"),
                over_arena_max=("over_arena", "max"))
    return out.reset_index()


def shapes(text: str) -> list[tuple[int, int]]:
    """'1x2k,8x32k' -> [(1, 2048), (8, 32768)]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, x, ctx = part.lower().partition("x")
        if not x:
            raise argparse.ArgumentTypeError(f"{part!r} is not BATCHxCONTEXT (e.g. 8x32k)")
        try:
            out.append((parse_size(batch), parse_size(ctx)))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{part!r}: {exc}") from None
    return out


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of rounds >= 1")
    return n


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m drafter_attn.bench.attention_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=MAIN_PRESET)
    ap.add_argument("--batch", type=sizes, default=[1, 8, 32])
    ap.add_argument("--ctx", type=sizes, default=sizes("2k,8k,32k"))
    ap.add_argument("--page", type=sizes, default=[16, 64, 128])
    ap.add_argument("--shapes", type=shapes, default=None, metavar="BxCTX[,BxCTX]",
                    help="measure these (batch, context) pairs instead of every --batch x --ctx, "
                         "e.g. 1x2k,1x8k,8x8k,32x8k")
    ap.add_argument("--impl", default="cupy",
                    help="';'-separated registry names, each optionally with params: "
                         "'cupy;cupy:tile_n=128,stages=2'; 'auto' is the runtime's tuned pick at "
                         "each point (the `pick` column names it), 'auto:sustained' / 'auto:burst' "
                         "the pick of that clock regime's table")
    ap.add_argument("--baseline", default="auto",
                    help="'auto' (every baseline installed that takes the geometry), 'none', or a "
                         f"comma list of {', '.join(baselines.NAMES)}")
    ap.add_argument("--reps", type=int, default=0, help="timed replays per timing (0: from the step's length)")
    ap.add_argument("--rounds", type=_positive, default=1,
                    help="measure each point's columns this many times, interleaved, and summarize "
                         "the per-round ratios (default 1)")
    ap.add_argument("--sustain", type=non_negative_float, default=0.0, metavar="SECONDS",
                    help="replay each point's step back to back this long before each of its timings "
                    "(the clock state of a sustained load; default 0: none)")
    add_sustain_load(ap)
    ap.add_argument("--db", default=None, metavar="PATH", help="profile database to record into "
                    "(default: as tuner: $DRAFTER_DB, else the checkout's profiles/profile.db)")
    ap.add_argument("--out", default=None, help="folder for CSV/JSON/markdown")
    args = ap.parse_args(argv)
    problem = load_without_sustain(args.sustain_load, args.sustain)
    if problem:
        ap.error(problem)
    return args


def baseline_names(option: str, geometry) -> list[str]:
    """--baseline: `auto` is every baseline installed that takes the geometry (at some page size),
    `none` none, else a comma list of kernels.baselines.NAMES (a page size a named baseline does
    not take is skipped per point)."""
    if option == "none":
        return []
    if option == "auto":
        return [n for n in baselines.NAMES if baselines.reason(n, geometry, 128) is None]
    names = [n.strip() for n in option.split(",") if n.strip()]
    unknown = [n for n in names if n not in baselines.NAMES]
    if unknown:
        raise SystemExit(f"--baseline: unknown {unknown} (known: {', '.join(baselines.NAMES)})")
    return names


def check_memory(geometry, points, pages, names, gpu_bytes: int) -> None:
    """SystemExit (before anything is measured) naming the largest point whose one-layer step
    or baseline would not fit `gpu_bytes` of GPU memory (tuner.memory.measurement_bytes)."""
    from drafter_attn.kernels.footprint import fmt_bytes
    from drafter_attn.tuner import memory as step_memory

    g1 = geometry.with_(num_layers=1)
    need = []
    for batch, ctx in points:
        for page in [*pages, None]:
            need.append((step_memory.measurement_bytes(g1, "paged" if page else "arena", page, batch, ctx,
                                                 g1.block_size), f"{'page ' + str(page) if page else 'arena'} "
                                                                 f"B={batch} ctx={ctx}"))
            if page and names:
                need.append((step_memory.baseline_bytes(g1, page, batch, ctx), f"baselines page {page} B={batch} ctx={ctx}"))
    worst, what = max(need)
    usable = int(gpu_bytes * step_memory.USABLE_FRACTION)
    if worst > usable:
        raise SystemExit(f"attention table: {what} needs about {fmt_bytes(worst)} of GPU memory, more "
                         f"than the {fmt_bytes(usable)} usable of this GPU's {fmt_bytes(gpu_bytes)}; "
                         f"lower --batch or --ctx (or --shapes)")


def main(argv=None) -> int:
    import torch

    from drafter_attn.bench import decode
    from drafter_attn.tuner import floors, roofline
    from drafter_attn.tuner.db import ProfileDB
    from drafter_attn.tuner.env import fingerprint
    from drafter_attn.tuner.sweep import result_row

    args = parse_args(argv)
    geometry = get_preset(args.preset)
    names = baseline_names(args.baseline, geometry)
    points = args.shapes or [(b, c) for b in args.batch for c in args.ctx]
    if not torch.cuda.is_available():
        raise SystemExit("attention table: no CUDA GPU found (torch.cuda.is_available() is False)")
    gpu_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    check_memory(geometry, points, args.page, names, gpu_bytes)
    env = fingerprint()
    sm = env.get("sm")
    meta = dict(env, copy_bw_gbps=roofline.copy_bandwidth() / 1e9, graph_fixed_us=floors.empty_graph_us(),
                preset=args.preset, commit=decode.git_commit(), sustain_s=args.sustain,
                sustain_load=args.sustain_load if args.sustain else None,
                command=" ".join(["python -m drafter_attn.bench.attention_table", *(argv or sys.argv[1:])]),
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    # auto: what kernels.Runtime reads ($DRAFTER_TUNED_TABLE, $DRAFTER_DB, the shipped table), in
    # each regime asked for
    dispatchers, sources = {}, []
    for spec in args.impl.split(";"):
        regime = auto_regime(spec)
        if regime is not None and regime not in dispatchers:
            dispatchers[regime], source = decode.load_dispatcher(None, sm, regime)
            sources.append(f"{spec}: {source}")
    meta["auto"] = "; ".join(sources) or None
    if meta["auto"]:
        print(f"auto: {meta['auto']}", flush=True)
    print(f"{meta['gpu_name']} sm{sm}: copy {meta['copy_bw_gbps']:.0f} GB/s (read+write); timing method's "
          f"fixed cost (one-kernel graph) {meta['graph_fixed_us']:.2f} us", flush=True)
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    # every point's read floor before anything is measured (floors.time_first)
    floors.time_first([roofline.call_bytes(geometry, batch, ctx, page)
                       for batch, ctx in points for page in [*args.page, None]])
    rows: list[dict] = []
    sweep_id = f"attention-table-{dt.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    with ProfileDB(args.db) as db:
        env_id = db.add_environment(env)
        print(f"recording into {db.path}", flush=True)

        def record(cand, result) -> None:
            db.add_result(result_row(cand, decode.baseline_db_result(result) if baselines.is_baseline(cand.impl)
                                     else result, env_id, sweep_id, "attention-table"))

        def keep(row: dict) -> None:  # every row reaches the disk at once
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "reason" or v}, default=str), flush=True)
            if out:
                # rewritten whole through a temporary file: a kill mid-write keeps the last copy
                write_whole(out / "attention.csv", lambda tmp: pd.DataFrame(rows).to_csv(tmp, index=False))

        seed = 0
        for batch, ctx in points:
            for rnd in range(args.rounds):  # interleaved: every column of the point, then again
                if rnd:
                    floors.read_floor.cache_clear()  # times its floors again (`lowest_floors`)
                for spec in args.impl.split(";"):
                    for page in [*args.page, None]:
                        layout = "paged" if page else "arena"
                        regime = auto_regime(spec)
                        run = spec if regime is None else pick_spec(dispatchers[regime], geometry, layout,
                                                                    page, batch, ctx, sm)
                        keep(dict(measure_kernel(run, geometry, layout, page, batch, ctx, reps=args.reps,
                                                 preset=args.preset, record=record, label=spec,
                                                 sustain_s=args.sustain, sustain_load=args.sustain_load),
                                  round=rnd))
                for name in names:
                    for page in args.page:
                        if baselines.reason(name, geometry, page, sm) is None:
                            seed += 1
                            keep(dict(measure_base(name, geometry, page, batch, ctx, reps=args.reps,
                                                   preset=args.preset, seed=seed, record=record,
                                                   sustain_s=args.sustain, sustain_load=args.sustain_load),
                                  round=rnd))
            torch.cuda.empty_cache()
    df = with_overheads(lowest_floors(pd.DataFrame(rows)))
    table = df[[c for c in COLUMNS if c in df and c != "reason" and (c != "round" or args.rounds > 1)
                and (c != "pick" or (df.pick != df.impl).any())]]
    print(text_table(table))
    if out:
        write_whole(out / "attention.csv", lambda tmp: df.to_csv(tmp, index=False))
        doc = json.dumps(dict(environment=meta, rows=df.to_dict("records")), indent=1, default=str)
        write_whole(out / "attention.json", lambda tmp: tmp.write_text(doc))
        md = (
            f"# {args.preset} attention, {meta['gpu_name']} (sm{sm}), {meta['date']}\n\n"
            f"copy bandwidth {meta['copy_bw_gbps']:.0f} GB/s, timing fixed cost {meta['graph_fixed_us']:.2f} us, "
            f"commit {meta['commit']}\n\n`{meta['command']}`\n\n"
            + (f"auto: {meta['auto']}\n\n" if meta["auto"] else "")
            + "attn_us: one layer's attention (median of graph replays, cold L2); read_floor_us: a streaming "
            "read of the same bytes timed the same way; x_floor = attn_us / read_floor_us; sm_mhz: the "
            "SM clock while the step was timed"
            + (f", each timing after {args.sustain:g} s of " + (
                "back-to-back replays" if args.sustain_load == "self"
                else f"a co-runner's load ({args.sustain_load}), which also ran before every timed replay")
               if args.sustain else "")
            + ".\n\n"
            + markdown_table(table) + "\n")
        write_whole(out / "attention.md", lambda tmp: tmp.write_text(md))
    if args.rounds > 1:
        summary = rounds_summary(df)
        if "pick" in summary and (summary.pick == summary.impl).all():
            summary = summary.drop(columns="pick")
        print(f"\nover {args.rounds} interleaved rounds (ratios taken within a round):")
        print(text_table(summary))
        if out:
            summary.to_csv(out / "attention_rounds.csv", index=False)
            (out / "attention_rounds.md").write_text(
                f"# {args.preset}: {args.rounds} interleaved rounds per point, {meta['gpu_name']}, "
                f"{meta['date']}\n\n`{meta['command']}`\n\nattn_us: median over rounds; "
                "over_arena: median (min, max) of the per-round paged / arena ratios.\n\n"
                + markdown_table(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
