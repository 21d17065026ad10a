"""The `bench` command.

    bench decode  [--sm N] [--page 64,128] [--preset NAME | --heads 32/8 --head-dim 128 ...]
                  [--batch 1,8,32] [--ctx 2k,8k,32k] [--accepted 3.4] [--impl auto]
                  [--table-capacity 128k] [--max-ctx-hint on|off|both] [--regime burst|sustained]
                  [--baseline auto|none|flashinfer|NAME,...] [--context-chunk 2k] [--syncs fast|all]
                  [--db PATH] [--out DIR]
    bench prefill [--chunk 2k] [--ctx 0,8k] ...    the context step: a prompt chunk stored
    bench memory  [--preset NAME] [--max-ctx 1M] [--concurrency 16] [--ctx ...] [--page ...]
    bench report  [--db PATH] [--sm N] [--preset NAME] [--out DIR]

Exit status: 0 done; 1 measured, but some measurement failed (a wrong or crashing kernel);
2 the command cannot run as asked (options, no CUDA GPU, --sm not this GPU, no database);
130 interrupted (Ctrl-C or SIGTERM): the rows measured so far are recorded and written (decode.csv
holds every row the moment it is measured, so even a run killed outright leaves them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from pathlib import Path

from drafter_attn.bench import options as opt
from drafter_attn.bench.options import BenchError
from drafter_attn.kernels.tuned_table import REGIMES, SUSTAIN_S, default_regime

DECODE_DEFAULTS = dict(page="64,128", batch="1,8,32", ctx="2k,8k,32k")
PREFILL_DEFAULTS = dict(page="64,128", batch="1,8", ctx="0,8k", chunk="2k")


class _Formatter(argparse.HelpFormatter):
    """Shows an option's default when it has a meaningful one (not None, False or empty)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "%(default)" in text or d in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = ",".join(map(str, d)) if isinstance(d, list) else d
        return f"{text} (default: {shown})"


def _measure_options(p: argparse.ArgumentParser, defaults: dict) -> None:
    p.add_argument("--sm", type=opt.sm, default=None,
                   help="SM of the GPU to measure (e.g. 90 for H100/H200, 100 for B200); it must match "
                        "a GPU here. Default: the GPU at hand")
    p.add_argument("--page", type=opt.pages, default=opt.pages(defaults["page"]), metavar="P[,P...]",
                   help="page sizes of the paged cache (powers of two), each against the arena")
    p.add_argument("--batch", type=opt.batches, default=opt.batches(defaults["batch"]), metavar="B[,B...]",
                   help="batch sizes (requests per step)")
    p.add_argument("--ctx", type=opt.contexts, default=opt.contexts(defaults["ctx"]), metavar="N[,N...]",
                   help="committed context lengths (k = 1024, M = 1048576)")
    p.add_argument("--impl", default="auto", metavar="NAME[,NAME...]",
                   help="implementations: auto (kernels.dispatch over $DRAFTER_TUNED_TABLE or the profile "
                        "database; cupy without kernels.dispatch), or registry names (cupy, reference, ...; "
                        "reference-syncing: the cupy attention with a store that syncs the host once per "
                        "layer, a reference showing what a stall costs), each optionally with parameters: "
                        "auto,cupy:ws=2,stages=4 (or ';' between specs)")
    p.add_argument("--concurrency", type=opt.concurrency, default=None,
                   help="requests the KV memory model is sized for (default: each row's batch)")
    p.add_argument("--max-ctx", type=opt.max_ctx, default=None,
                   help="tokens one arena slot holds in the KV memory model (default: largest --ctx "
                        "plus the stored rows)")
    p.add_argument("--table-capacity", type=opt.table_capacities, default=[], metavar="N[,N...]",
                   help="also measure each paged row with a block table sized for N tokens (as an engine "
                        "sizes it for the model's longest context; the pool holds only the pages needed), "
                        "labelled 'paged P tN'; not recorded into the database")
    p.add_argument("--max-ctx-hint", choices=["on", "off", "both"], default=None,
                   help="pass the attention the host-side max_ctx hint (ctx + the stored rows): on, off, or "
                        "both rows (default: both with --table-capacity, else off)")
    p.add_argument("--reps", type=opt.non_negative_int, default=0,
                   help="timed graph replays per timing; 0 picks them from the step's length")
    p.add_argument("--regime", choices=REGIMES, default=None,
                   help="the GPU's clock regime: burst (a cool GPU), or sustained (a serving loop that "
                        "holds it at its power limit, where the H200 lowers its SM clock): auto picks "
                        "from that regime's table, and each timing follows --sustain seconds of the "
                        "step's own load. Default: $DRAFTER_REGIME, else burst")
    p.add_argument("--sustain", type=opt.non_negative_float, default=None, metavar="SECONDS",
                   help=f"the load before each timing (default: {SUSTAIN_S:g} in the sustained regime, "
                        "0 in a burst)")
    opt.add_sustain_load(p)
    p.add_argument("--db", default=None, metavar="PATH",
                   help="profile database to record into (default: $DRAFTER_DB, else profiles/profile.db "
                        "of the checkout, else ~/.local/share/drafter-attn/profile.db)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the CSV/JSON/PNG (default: results/sm<SM>-<YYYY-MM-DD>/; files of an "
                        "earlier run there are replaced)")
    p.add_argument("--wide", action="store_true",
                   help="print every column (p10-p90, store, read floor, GB/s, copy roofline, rel err); "
                        "the CSV and JSON always hold all of them")
    opt.add_geometry_options(p)


def build_parser() -> argparse.ArgumentParser:
    from drafter_attn.kernels.presets import MAIN_PRESET

    ap = argparse.ArgumentParser(prog="bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", metavar="{decode,prefill,memory,report}")
    sub.required = True

    d = sub.add_parser(
        "decode", formatter_class=_Formatter,
        help="drafter decode step, paged against arena, on the GPU at hand",
        description="The drafter's whole decode step (every layer: the store of the accepted rows, a "
                    "fixed Qb rows per request with a device-side valid count, then the attention), "
                    "captured in a CUDA graph; paged (each --page) against arena, the baselines beside when "
                    f"installed. Default: {MAIN_PRESET} at pages 64 and 128 against arena.")
    _measure_options(d, DECODE_DEFAULTS)
    d.add_argument("--accepted", type=opt.non_negative_float, default=None, metavar="A",
                   help="mean accepted tokens per request: a step stores A + 1 rows (default: all Qb rows)")
    d.add_argument("--baseline", type=opt.baseline_option, default="auto", metavar="auto|none|flashinfer|NAME[,NAME]",
                   help="baselines beside (every layer's attention in one call, no store): flashinfer-fa2 (per-shape "
                        "plan), flashinfer-fa2-graph (CUDA-graph plan), trtllm-xqa; 'flashinfer' is the "
                        "first two; auto: every one installed that takes the geometry")
    d.add_argument("--context-chunk", type=opt.chunks, default=[], metavar="N[,N...]",
                   help="also measure the context step (a prompt chunk of N rows stored per request)")
    d.add_argument("--syncs", choices=("fast", "all", "nsys"), default="fast",
                   help="host-sync layers per step: fast = torch sync-debug mode and the torch profiler (in "
                        "process); all (or nsys) = those and Nsight Systems (a profiled subprocess per step; nsys "
                        "from PATH, $NSYS or /opt/nvidia; exit 2 when it is missing or lacks a library)")
    d.add_argument("--nsys", action="store_true", help="the same as --syncs all")

    pf = sub.add_parser(
        "prefill", formatter_class=_Formatter,
        help="context step: a prompt chunk stored into the cache, paged against arena",
        description="The context step, as when a request arrives: every layer stores a prompt chunk "
                    "(--chunk rows per request) at the request's context length, then runs the drafter "
                    "attention; timed, split and checked for host syncs like a decode step.")
    _measure_options(pf, PREFILL_DEFAULTS)
    pf.add_argument("--chunk", type=opt.chunks, default=opt.chunks(PREFILL_DEFAULTS["chunk"]), metavar="N[,N...]",
                    help="rows stored per request")

    m = sub.add_parser(
        "memory", formatter_class=_Formatter,
        help="KV footprint, arena against paged (no GPU needed)",
        description="KV-cache bytes of a deployment: a dense arena (one max-context slot per request) "
                    "against a paged cache (pages for the expected context plus the store's Qb rows, "
                    "plus the block table), per page size. The model: kernels/footprint.py.")
    m.add_argument("--max-ctx", type=opt.max_ctx, default=opt.max_ctx("128k"),
                   help="tokens one request may hold (the arena's slot)")
    m.add_argument("--concurrency", type=opt.concurrency, default=16, help="requests served at once")
    m.add_argument("--ctx", type=opt.contexts, default=None, metavar="N[,N...]",
                   help="expected context lengths (default: 1/8 and 1/2 of --max-ctx, and full: max-ctx - Qb)")
    m.add_argument("--page", type=opt.pages, default=[16, 32, 64, 128], metavar="P[,P...]")
    m.add_argument("--json", action="store_true", help="print JSON instead of tables")
    opt.add_geometry_options(m)

    r = sub.add_parser("report", formatter_class=_Formatter,
                       help="plots and a markdown summary from the profile database (no GPU needed)")
    r.add_argument("--db", default=None, metavar="PATH", help="profile database (default as for bench decode)")
    r.add_argument("--sm", type=opt.sm, default=None, help="only this SM")
    r.add_argument("--preset", default=None, metavar="NAME", help="only this preset")
    r.add_argument("--out", default=None, metavar="DIR", help="default: results/report-<YYYY-MM-DD>/")
    return ap


# ---------------------------------------------------------------------------------------------
# decode / prefill


def _measure_plan(args, geometry, label: str):
    """The steps `bench decode` or `bench prefill` measures, planned from the options."""
    from drafter_attn.bench import decode

    preset = None if label.startswith("custom:") else label
    impls = decode.split_impls(args.impl)
    regime = args.regime or default_regime()
    if args.command == "decode":
        return decode.plan("decode", geometry, label, preset, pages=args.page, batches=args.batch,
                           ctxs=args.ctx, impls=impls, accepted=args.accepted,
                           context_chunks=args.context_chunk, baseline=args.baseline, reps=args.reps,
                           nsys=args.nsys or args.syncs in ("all", "nsys"), concurrency=args.concurrency,
                           max_ctx=args.max_ctx, table_capacities=args.table_capacity,
                           max_ctx_hint=args.max_ctx_hint, regime=regime, sustain_s=args.sustain,
                           sustain_load=args.sustain_load)
    return decode.plan("prefill", geometry, label, preset, pages=args.page, batches=args.batch,
                       ctxs=args.ctx, impls=impls, context_chunks=args.chunk, decode=False,
                       baseline="none", reps=args.reps, concurrency=args.concurrency, max_ctx=args.max_ctx,
                       table_capacities=args.table_capacity, max_ctx_hint=args.max_ctx_hint,
                       regime=regime, sustain_s=args.sustain, sustain_load=args.sustain_load)


def _select_gpu(args, command: str):
    """The GPU asked for (--sm), made the current CUDA device."""
    import torch

    from drafter_attn.bench import gpu as gpu_mod

    gpu = gpu_mod.require_gpu(args.sm, command, db_path=args.db)
    if torch.cuda.is_available():
        torch.cuda.set_device(gpu.index)
    return gpu


def _open_db(args, command: str):
    from drafter_attn.tuner.db import ProfileDB, SchemaError

    try:
        return ProfileDB(args.db)
    except SchemaError as exc:
        raise BenchError(f"{command}: {exc}") from None


def _measure_console(args):
    """A rich console and an `echo` that prints plain text (a reason like "[at x.cu:12]" is not markup)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if not console.is_terminal:
        console = Console(width=220 if args.wide else 120)

    def echo(text: str) -> None:
        console.print(escape(text), soft_wrap=True)

    return console, echo


def _run_plan(p, db, gpu, command: str, label: str, geometry, console, echo, table=None, on_row=None):
    """Announce the run, measure every step into the database (closed after), each row so far
    handed to `on_row`; (env, rows)."""
    from rich.markup import escape

    from drafter_attn.bench import decode

    try:
        env = decode.gpu_environment(gpu)
        base_jobs = p.baseline_jobs(env.get("sm"))
        baseline = f" + {len(base_jobs)} baseline rows ({', '.join(p.baselines)})" if base_jobs else ""
        console.print(f"[bold]{command}[/]: " + escape(f"{gpu.describe()}, driver {env.get('driver')}; {label} "
                                                      f"({opt.describe(geometry)}); {len(p.jobs)} steps{baseline}"))
        echo(f"recording into {db.path}")
        for note in p.notes:
            echo(note)
        # --impl auto: picks from the database given with --db, else from the runtime's table
        return env, decode.execute(p, db, env, echo=echo, table=table, on_row=on_row)
    finally:
        db.close()


def _print_results(rows, title: str, args, console, echo) -> list[str]:
    """The table, the summary lines (returned) and a warning for rows with host syncs."""
    from drafter_attn.bench import decode, output

    output.print_table(rows, title, console, wide=args.wide)
    summary = decode.summary_lines(rows)
    for line in summary:
        echo(line)
    for line in decode.sync_lines(rows):
        echo(line)
    syncing = [r for r in rows if r.get("syncs")]
    if syncing:
        console.print(f"[red]{len(syncing)} row(s) with blocking host syncs inside the step[/] (see the syncs columns)")
    return summary


def _write_results(rows, meta: dict, p, summary, title: str, out: Path, stem: str, echo) -> None:
    """<stem>.csv, <stem>.json and (when a row measured ok) <stem>.png under out."""
    from drafter_attn.bench import output

    output.write_csv(rows, out / f"{stem}.csv")
    output.write_json(rows, meta, p.settings(), out / f"{stem}.json", summary)
    plotted = output.plot(rows, out / f"{stem}.png", title)
    echo(f"wrote {out / (stem + '.csv')}, {out / (stem + '.json')}"
         + (f", {out / (stem + '.png')}" if plotted else " (no plot: no row measured ok)"))


def _measure_exit_status(rows, p, console) -> int:
    """130 interrupted, 1 when a measurement failed, else 0; each said on the console."""
    from drafter_attn.bench import decode

    bad = decode.failed(rows)
    if bad:
        console.print(f"[red]{len(bad)} of {len(rows)} measurements failed[/] (status and reason in the table and CSV)")
    if p.interrupted:
        console.print(f"[yellow]interrupted[/]: {len(rows)} of {p.total} rows measured (all of them recorded and written)")
        return 130
    return 1 if bad else 0


@contextlib.contextmanager
def _term_as_interrupt():
    """SIGTERM (a job scheduler's or `timeout`'s stop) handled as Ctrl-C while measuring: the
    rows measured so far are recorded and written, and the command exits 130."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread (an embedding caller): leave its handlers alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_measure(args, argv) -> int:
    from drafter_attn.bench import decode, output

    command = f"bench {args.command}"
    geometry, label = opt.geometry_from_args(args)
    gpu = _select_gpu(args, command)  # no GPU: said first, whatever else the options need
    p = _measure_plan(args, geometry, label)
    if p.nsys:
        p.notes.append(decode.require_nsys())
    decode.check_memory(p, gpu.memory_bytes, gpu.sm)
    out = _out_dir(command, decode.results_dir(gpu.sm) if args.out is None else args.out)
    db = _open_db(args, command)
    console, echo = _measure_console(args)
    # every row on disk the moment it is measured (the whole CSV rewritten, atomically): what a
    # kill leaves is the rows so far, where the final files below would be lost
    partial = out / f"{args.command}.csv"
    with _term_as_interrupt():
        env, rows = _run_plan(p, db, gpu, command, label, geometry, console, echo, table=args.db,
                              on_row=lambda so_far: output.write_csv(so_far, partial))
    meta = decode.run_metadata(env, argv)
    title = f"{command}: {label} on {gpu.name} (SM {gpu.sm}), {meta['date'][:10]}"
    summary = _print_results(rows, title, args, console, echo)
    _write_results(rows, meta, p, summary, title, out, args.command, echo)
    return _measure_exit_status(rows, p, console)


# ---------------------------------------------------------------------------------------------
# memory


def cmd_memory(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from drafter_attn.kernels import footprint as kvmem

    geometry, label = opt.geometry_from_args(args)
    ctxs = args.ctx if args.ctx is not None else kvmem.default_contexts(geometry, args.max_ctx)
    if not ctxs:
        raise BenchError(f"bench memory: --max-ctx {args.max_ctx} is smaller than the block size "
                         f"Qb = {geometry.block_size}; no context fits")
    try:
        fps = kvmem.footprints(geometry, args.concurrency, args.max_ctx, ctxs, args.page)
    except ValueError as exc:
        raise BenchError(f"bench memory: {exc}") from None
    arena = kvmem.arena_bytes(geometry, args.concurrency, args.max_ctx)
    if args.json:
        print(json.dumps(dict(preset=label, geometry=opt.describe(geometry), concurrency=args.concurrency,
                              max_ctx=args.max_ctx, token_bytes=kvmem.token_bytes(geometry),
                              arena_bytes=arena, rows=[f.as_dict() for f in fps]), indent=1))
        return 0
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(f"[bold]bench memory[/]: {label} ({opt.describe(geometry)}), concurrency "
                  f"{args.concurrency}, max context {args.max_ctx:,} tokens")
    console.print(f"K+V per token, all {geometry.num_layers} layers: {kvmem.fmt_bytes(kvmem.token_bytes(geometry))} "
                  f"({kvmem.token_bytes(geometry):,} B)")
    console.print(f"arena (dense: {args.concurrency} slots x {args.max_ctx:,} tokens): "
                  f"[bold]{kvmem.fmt_bytes(arena)}[/] ({arena:,} B)")
    t = Table(title="paged (pages for context + Qb store rows, plus the int32 block table)",
              title_justify="left", header_style="bold")
    for name in ("expected ctx", "page", "pages/request", "paged KV", "block table", "paged total",
                 "arena", "paged/arena", "arena/paged"):
        t.add_column(name, justify="left" if name == "expected ctx" else "right")
    for f in fps:
        t.add_row(f"{f.ctx:,}", str(f.page_size), f"{f.pages_per_request:,}", kvmem.fmt_bytes(f.paged_kv_bytes),
                  kvmem.fmt_bytes(f.table_bytes), kvmem.fmt_bytes(f.paged_bytes), kvmem.fmt_bytes(f.arena_bytes),
                  f"{f.paged_over_arena:.3f}", f"{f.arena_over_paged:.2f}x")
    console.print(t)
    return 0


# ---------------------------------------------------------------------------------------------
# report


def cmd_report(args) -> int:
    import datetime as dt

    from drafter_attn.bench import report
    from drafter_attn.tuner.db import reading_path

    db_path = Path(args.db) if args.db else reading_path(args.sm)
    df = report.load(db_path, sm=args.sm, preset=args.preset)
    out = _out_dir("bench report", args.out or Path("results") / f"report-{dt.date.today():%Y-%m-%d}")
    path, plots = report.build(df, out, db_path)
    print(f"bench report: {len(df)} rows from {db_path}; wrote {path} and {len(plots)} plot(s) in {out}")
    return 0


def _out_dir(command: str, path) -> Path:
    """The results folder, proven writable before anything is measured or read."""
    from drafter_attn.tuner.cli_checks import OutputError, writable_dir

    try:
        return writable_dir(path)
    except OutputError as exc:
        raise BenchError(f"{command}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    from drafter_attn.tuner.db import SchemaError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ("decode", "prefill"):
            return cmd_measure(args, argv)
        if args.command == "memory":
            return cmd_memory(args)
        return cmd_report(args)
    except BenchError as exc:
        print(str(exc), file=sys.stderr)
        return exc.exit_code
    except SchemaError as exc:  # the database failed part way (a full disk, corrupt pages)
        print(f"bench {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a result file could not be written
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"bench {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
