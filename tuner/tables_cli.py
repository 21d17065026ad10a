"""`tuner` subcommands for tuned tables and deployment decisions (registered by tuner.cli):

    tuner export --sm 90 --out profiles/sm90.json     tuned table (JSON) for the runtime
    tuner rekey [--from COMMIT] [--dry-run]           carry rows across a source edit that left
                                                     their kernels' machine code unchanged
    tuner diff A.json B.json [--threshold 0.05] [--gate]
    tuner repeat A.db B.db [--figure F.png] [--gate]  the same sweep twice: winner flips, spread
    tuner predict --sm 100 [--from 90] [--gpu B200]  roofline-projected rows (provenance predicted)
    tuner auto --preset P --page 64 --max-ctx 32768 --concurrency 64 --prefix-hit 0.3 --serving agg
    tuner rounding --hits 100,2000,@hits.txt [--pages 16,32,64,128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from drafter_attn.kernels import tuned_table
from drafter_attn.tuner.cli_checks import OutputError, int_list, non_negative_float, positive_size, writable_file
from drafter_attn.tuner.db import SchemaError, default_path, reading_path


def _gpu_class(text: str) -> tuple[str, list[str]]:
    """CLASS=GPU[,GPU...]: GPUs whose entries serve each other (e.g. H200 and H200 NVL)."""
    name, eq, gpus = text.partition("=")
    members = [g.strip() for g in gpus.split(",") if g.strip()]
    if not eq or not name.strip() or not members:
        raise argparse.ArgumentTypeError(f"expected CLASS=GPU[,GPU...], got {text!r}")
    return name.strip(), members


def _hit_lengths(text: str) -> list[int]:
    """Comma-separated lengths; @FILE reads whitespace/comma-separated lengths from a file."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("@"):
            try:
                words = Path(part[1:]).read_text().replace(",", " ").split()
            except OSError as exc:
                raise argparse.ArgumentTypeError(f"cannot read {part[1:]}: {exc.strerror}") from None
        else:
            words = [part]
        for w in words:
            if not w.isdigit():
                raise argparse.ArgumentTypeError(f"hit lengths must be non-negative integers, got {w!r}")
            out.append(int(w))
    if not out:
        raise argparse.ArgumentTypeError("no hit lengths given")
    return out


def _one_gpu(entries: list, gpu: str | None) -> list:
    """`entries` with one entry a problem: where a source holds a problem measured on several
    GPUs (export decides each GPU's keys on its rows), the entry of GPU `gpu` (its name, else a
    unique part of one), else of this machine's GPU; ValueError when neither tells. A paged entry
    of one GPU never decides against another's arena entry."""
    by_problem: dict[tuple, list] = {}
    for e in entries:
        by_problem.setdefault(e.key, []).append(e)
    shared = [v for v in by_problem.values() if len(v) > 1]
    if not shared:
        return entries
    gpu_of = lambda e: str((e.get("provenance") or {}).get("gpu"))  # noqa: E731
    gpus = sorted({gpu_of(e) for v in shared for e in v})
    if gpu is None:
        from drafter_attn.kernels.tuned_table import current_environment

        gpu = current_environment().gpu_name
        if gpu not in gpus:
            raise ValueError(f"the measurements hold problems measured on several GPUs "
                             f"({', '.join(gpus)}): give --gpu")
    chosen = ([g for g in gpus if g.lower() == gpu.lower()]
              or [g for g in gpus if gpu.lower() in g.lower()])
    if len(chosen) != 1:
        raise ValueError(f"--gpu {gpu!r} matches {chosen or 'none'} of the GPUs measured: {', '.join(gpus)}")
    return [e for v in by_problem.values() for e in v if len(v) == 1 or gpu_of(e) == chosen[0]]


def _default_source(sm, kinds) -> Path:
    """$DRAFTER_TUNED_TABLE/$DRAFTER_DB, else what ships for the SM (--sm, else this GPU's; the
    only SM shipped when neither says), else the default database."""
    from drafter_attn.kernels.shipped import find_default, only_shipped

    sms = [sm] if isinstance(sm, int) else list(sm or [])
    found = find_default(sms[0] if len(sms) == 1 else None, kinds)
    if found is None and not sms:
        found = next(filter(None, (only_shipped(kind) for kind in kinds)), None)
    return found or default_path()


def _fail(command: str, exc: Exception) -> int:
    print(f"tuner {command}: {exc}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------


def cmd_export(args) -> int:
    from drafter_attn.kernels.dispatch import TableError
    from drafter_attn.tuner.export import TODAYS, export_table, write_table

    sms = list(args.sm or [])
    path = args.db or reading_path(sms[0] if len(sms) == 1 else None)
    try:
        table = export_table(path, args.sm, include_predicted=args.include_predicted,
                             resolve_commits=not args.no_commits, gpu_classes=dict(args.gpu_class or []),
                             sources_hash=(_todays_sources() if args.current_sources else
                                           None if args.all_sources else TODAYS),
                             regime=args.regime)
        out = writable_file(args.out)
    except (SchemaError, TableError, OutputError) as exc:
        return _fail("export", exc)
    n = len(table["entries"])
    if not n:
        want = f" for sm {','.join(map(str, args.sm))}" if args.sm else ""
        return _fail("export", f"{path} holds no ok rows{want}; nothing to export")
    write_table(table, out)  # an OSError here (a full disk) is tuner's exit 2 with the file named
    kinds = sorted({e["provenance"]["kind"] for e in table["entries"]})
    regime = ""
    if args.regime != "burst":
        held = sum(e["provenance"]["regime"] == args.regime for e in table["entries"])
        regime = f"; {held} of them timed {args.regime}, the rest burst"
    print(f"{n} tuned entries ({', '.join(kinds)}; sm {', '.join(map(str, table['source']['sms']))}"
          f"{regime}) from {table['source']['rows']} rows of {path} -> {out}", file=sys.stderr)
    return 0


def _todays_sources() -> str:
    from drafter_attn.kernels import nvrtc

    return nvrtc.sources_digest()


def cmd_rekey(args) -> int:
    import subprocess

    from drafter_attn.tuner.rekey import (complete_params, rekey_from_commit, rekey_stale,
                                          summary_text)

    path = args.db or default_path()  # it rewrites rows: never the shipped database unasked
    try:
        if args.from_commit:
            summaries = [rekey_from_commit(path, args.from_commit, jobs=args.jobs, dry_run=args.dry_run)]
        else:
            summaries = rekey_stale(path, jobs=args.jobs, dry_run=args.dry_run)
        completed = complete_params(path, dry_run=args.dry_run)
    except (SchemaError, subprocess.SubprocessError, RuntimeError) as exc:
        return _fail("rekey", exc)
    print("\n".join(map(summary_text, summaries)) or f"every row of {path} is on today's kernel sources")
    if completed["completed"]:
        added = ", ".join(f"{k} ({n})" for k, n in sorted(completed["added"].items()))
        print(f"{'would complete' if args.dry_run else 'completed'} the parameters of "
              f"{completed['completed']} rows on today's sources: {added}")
    return 0


def cmd_diff(args) -> int:
    from drafter_attn.kernels.dispatch import TableError
    from drafter_attn.tuner.export import diff_tables, diff_text, read_table

    try:
        a, b = read_table(args.a), read_table(args.b)
    except TableError as exc:
        return _fail("diff", exc)
    d = diff_tables(a, b, args.threshold)
    if args.format == "json":
        print(json.dumps(d, indent=1))
    else:
        print(diff_text(d, args.a, args.b))
    if args.gate and (d["flips"] or d["slowdowns"]):
        print(f"tuner diff: gate failed: {len(d['flips'])} winner flips, {len(d['slowdowns'])} "
              f"slowdowns beyond {args.threshold:.1%}", file=sys.stderr)
        return 1
    return 0


def cmd_repeat(args) -> int:
    from drafter_attn.kernels.dispatch import TableError
    from drafter_attn.tuner import repeat

    try:
        figure = writable_file(args.figure, "--figure") if args.figure else None
        targets = {k: v for k, v in (("min_same", args.min_same), ("max_spread", args.max_spread))
                   if v is not None}
        report = repeat.compare_paths(args.a, args.b, sweep_a=args.sweep_a, sweep_b=args.sweep_b,
                                      sm=args.sm, **targets)
    except (SchemaError, TableError, OutputError, repeat.RepeatError) as exc:
        return _fail("repeat", exc)
    if figure:
        repeat.figure(report, figure)  # an OSError here (a full disk) is tuner's exit 2
    if args.format == "json":
        print(json.dumps(report, indent=1))
    else:
        print(repeat.text(report))
    if figure:
        print(f"figure: {figure}", file=sys.stderr)
    if args.gate and not report["targets"]["met"]:
        t, s = report["targets"], report["summary"]
        print(f"tuner repeat: gate failed: same winner {s['same_winner_share']:.1%} (target >= "
              f"{t['min_same_winner']:.0%}), median spread {s['spread_median']:.2%} (target <= "
              f"{t['max_median_spread']:.0%})", file=sys.stderr)
        return 1
    return 0


def cmd_predict(args) -> int:
    from drafter_attn.tuner.predict import DatasheetError, default_source, load_datasheets, predict

    try:
        if args.list:
            for g in load_datasheets(args.datasheets):
                star = " (default for its SM)" if g.default_for_sm else ""
                print(f"sm{g.sm:<4} {g.name:<24} {g.bandwidth_tbs:>6.3f} TB/s{star}  [{g.source}]")
            return 0
        if args.sm is None:
            return _fail("predict", "--sm is required (the SM to predict for)")
        dest = args.db or default_path()
        # without --db, a database with nothing measured yet (a fresh install) projects the
        # measurements shipped in profiles/ (read-only) into it
        source = None if args.db else default_source(dest, args.sm, args.from_sm)
        s = predict(dest, args.sm, args.from_sm, gpu=args.gpu, datasheets=args.datasheets,
                    source=source)
    except (SchemaError, DatasheetError) as exc:
        return _fail("predict", exc)
    for src in s["sources"]:
        print(f"from {src['gpu']} ({src['datasheet']}, {src['tbs']} TB/s [{src['source']}])", file=sys.stderr)
    print(f"to {s['target']} sm{s['target_sm']} ({s['target_tbs']} TB/s [{s['target_source']}])",
          file=sys.stderr)
    if s["source_db"] != str(dest):
        print(f"measured rows read from {s['source_db']}; predicted rows stored in {dest}",
              file=sys.stderr)
    older = (f"; {s['superseded']} older timings of a candidate projected from its newest"
             if s["superseded"] else "")
    print(f"{s['written']} predicted rows written from sm{s['from_sm']}; {s['skipped_done']} predicted "
          f"before{older}; {s['skipped_no_bytes']} without bytes_moved", file=sys.stderr)
    if s["skipped_bad"]:
        print(f"tuner predict: skipped {len(s['skipped_bad'])} row(s) whose median_us, bytes_moved or "
              f"split times are not positive numbers (row ids {s['skipped_bad'][:10]})", file=sys.stderr)
    for name in s["no_datasheet"]:
        print(f"tuner predict: no datasheet entry matches {name!r}: its rows were skipped "
              f"(add it to the datasheet table)", file=sys.stderr)
    return 0


def cmd_auto(args) -> int:
    from drafter_attn.kernels.auto import Deployment, merge_entries, recommend
    from drafter_attn.kernels.dispatch import TableError, load_entries

    try:
        d = Deployment(args.preset, args.page, args.max_ctx, args.concurrency, args.prefix_hit,
                       args.serving, args.mean_ctx)
    except ValueError as exc:
        return _fail("auto", exc)
    named = args.table or args.db
    source = Path(named or _default_source(args.sm, ("table", "db")))
    if named and not source.exists():  # named explicitly: a mistyped path is an error, not a note
        return _fail("auto", f"no tuned table or profile database at {source}")
    entries: list = []
    note = None
    try:
        if source.exists():
            entries = _one_gpu(load_entries(source, include_predicted=args.include_predicted)[0],
                               args.gpu)
        else:
            note = f"no tuned table or profile database at {source}: nothing measured"
        more = [_one_gpu(load_entries(Path(extra), include_predicted=args.include_predicted)[0],
                         args.gpu)  # named explicitly: a missing or unusable one is an error
                for extra in args.more or []]
    except (TableError, ValueError) as exc:
        return _fail("auto", exc)
    if more:
        entries = merge_entries(entries, *more)
        note = None if entries else note  # the named sources measured it: nothing is missing
    rec = recommend(d, entries, args.sm, latency_tolerance=args.tolerance, hit_lengths=args.hit_lengths)
    sources = ", ".join([str(source)] + list(args.more or []))
    if args.format == "json":
        out = rec.as_dict()
        out["measurements"] = sources
        if note:
            out["missing"].insert(0, note)
        print(json.dumps(out, indent=1))
    else:
        if note:
            print(note)
        print(f"measurements: {sources}")
        print(rec.to_text())
    return 0


def cmd_rounding(args) -> int:
    from drafter_attn.kernels.auto import page_rounding, page_rounding_text

    try:
        stats = page_rounding(args.hits, args.pages)
    except ValueError as exc:
        return _fail("rounding", exc)
    if args.format == "json":
        print(json.dumps({str(k): v for k, v in stats.items()}, indent=1))
    else:
        print("context tokens hidden from the drafter when an unpaired pool rounds a prefix hit's "
              "first stored position up to a page boundary")
        print(page_rounding_text(stats))
    return 0


# ---------------------------------------------------------------------------------------------


def _gated(p, gate_help: str, func) -> None:
    """The options a comparing command ends with (--gate, --format) and its function."""
    p.add_argument("--gate", action="store_true", help=gate_help)
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(func=func)


def add_commands(sub, add_db) -> None:
    """Register export, rekey, diff, repeat, predict, auto and rounding on tuner's subparsers."""
    p = sub.add_parser("export", help="write a tuned table (JSON) for the runtime",
                       description="Winners per (SM, problem) from the profile database, with the "
                       "bucket rules of the runtime and provenance per entry (sweep, commit of the "
                       "measured kernel sources, date, GPU). Predicted rows are left out unless asked.")
    add_db(p)
    p.add_argument("--sm", type=int_list, help="SMs to export, e.g. 90 or 90,100 (default: all)")
    p.add_argument("--out", required=True, help="output path, e.g. profiles/sm90.json")
    p.add_argument("--include-predicted", action="store_true",
                   help="also rows of provenance 'predicted' (measured rows still win)")
    p.add_argument("--no-commits", action="store_true", help="do not look up commits in git")
    p.add_argument("--gpu-class", action="append", type=_gpu_class, metavar="CLASS=GPU[,GPU...]",
                   help="declare GPUs that may use each other's entries (the runtime uses an entry "
                        "only on the GPU it was measured on, or on a GPU of its class); repeatable")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--current-sources", action="store_true",
                       help="only rows measured on this checkout's kernel sources (leaves out rows "
                            "`tuner rekey` left stale); by default these where the database holds "
                            "any, else every row")
    which.add_argument("--all-sources", action="store_true",
                       help="rows of every kernel-sources hash compete (the runtime uses an entry "
                            "only with the sources it was measured on)")
    p.add_argument("--regime", choices=tuned_table.REGIMES, default="burst",
                   help="the clock regime the table is for: burst (rows timed on a cool GPU; "
                        "default), or sustained (each key decided on its rows timed after a "
                        "sustained load, `--sustain`, where it has any (those under a co-runner's load, "
                        "`--sustain-load gemm`, first), else on its burst rows); "
                        "ship it as profiles/sm<SM>-sustained.json")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("rekey", help="carry rows across a kernel-source edit that left their machine code unchanged",
                       description="Compiles every kernel each row measured on the sources of git commit "
                       "FROM (default: the commit git finds for each stale sources hash) loaded, "
                       "with that commit's kernels package and with this one (no GPU), "
                       "and moves the rows whose SASS and kernel resources are unchanged to today's "
                       "sources hash; the rest stay stale for the next sweep to measure again.")
    add_db(p)
    p.add_argument("--from", dest="from_commit", metavar="COMMIT",
                   help="the git commit whose kernel sources the rows were measured on (default: "
                        "for each stale sources hash in the database, the commit git finds for it)")
    p.add_argument("--jobs", type=int, help="compile processes (default: every core)")
    p.add_argument("--dry-run", action="store_true", help="say what would move; change nothing")
    p.set_defaults(func=cmd_rekey)

    p = sub.add_parser("diff", help="compare two tuned tables (winner flips, slowdowns)")
    p.add_argument("a", help="the old table")
    p.add_argument("b", help="the new table")
    p.add_argument("--threshold", type=non_negative_float, default=0.05,
                   help="slowdown/speedup threshold as a fraction (default 0.05 = 5%%)")
    _gated(p, "exit 1 on any winner flip or slowdown", cmd_diff)

    p = sub.add_parser("repeat", help="the same sweep run twice: winner flips and spread",
                       description="Compare two runs of one sweep spec: two profile databases, or two "
                       "sweeps of one database (--sweep-a/--sweep-b). Per key (SM, shape, batch, "
                       "context): whether the winner flipped, and whether the flip is within noise "
                       "(the two winners' p10-p90 ranges overlap in both runs); per candidate the "
                       "relative difference B / A - 1 of its median. Summary: the share of keys with "
                       "the same winner and the median spread, against the targets.")
    p.add_argument("a", help="profile database of the first run")
    p.add_argument("b", help="profile database of the second run (may be the first with --sweep-b)")
    p.add_argument("--sweep-a", help="only rows of this sweep id in A")
    p.add_argument("--sweep-b", help="only rows of this sweep id in B")
    p.add_argument("--sm", type=int, help="only this SM")
    p.add_argument("--figure", help="write the figure here (PNG, or SVG/PDF by suffix)")
    p.add_argument("--min-same", type=non_negative_float,
                   help="target share of keys with the same winner (default 0.95, issue 14's)")
    p.add_argument("--max-spread", type=non_negative_float,
                   help="target median spread |B/A - 1| (default 0.02 = 2%%, issue 14's)")
    _gated(p, "exit 1 when a target is missed", cmd_repeat)

    p = sub.add_parser("predict", help="roofline-projected rows for an SM you do not own",
                       description="Project the measured rows of the nearest measured SM onto a "
                       "target GPU by datasheet memory bandwidth; stored with provenance 'predicted'. "
                       "Without --db, when the database in use holds no measured rows to project "
                       "from (a fresh install), the measurements shipped in profiles/sm<SM>.db are "
                       "read (never written) and the predictions stored in the database in use.")
    add_db(p)
    p.add_argument("--sm", type=int, help="SM to predict for, e.g. 100")
    p.add_argument("--from", dest="from_sm", type=int, help="measured SM to project from "
                   "(default: the nearest measured, same family first)")
    p.add_argument("--gpu", help="target GPU by name in the datasheet table (default: the SM's default)")
    p.add_argument("--datasheets", help="datasheet table (TOML; default: tuner/datasheets.toml)")
    p.add_argument("--list", action="store_true", help="print the datasheet table and stop")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("auto", help="paged or arena for a deployment, with measured reasons")
    p.add_argument("--preset", required=True, help="drafter geometry preset")
    p.add_argument("--page", type=int, required=True, help="page size of the paged pool")
    p.add_argument("--max-ctx", type=positive_size, required=True,
                   help="maximum context per request (tokens; 32k, 1M)")
    p.add_argument("--concurrency", type=int, required=True, help="requests decoding at once")
    p.add_argument("--prefix-hit", type=float, default=0.0,
                   help="expected fraction of prompt tokens from the prefix cache (0..1)")
    p.add_argument("--serving", choices=["agg", "disagg"], default="agg",
                   help="aggregated, or disaggregated prefill/decode")
    p.add_argument("--mean-ctx", type=positive_size, help="typical context length (memory below max ctx)")
    p.add_argument("--hit-lengths", type=_hit_lengths,
                   help="prefix-hit lengths for the page-rounding distribution (list or @FILE)")
    p.add_argument("--sm", type=int, help="SM of the measurements (default: the only one present)")
    p.add_argument("--gpu", help="where a source holds a problem measured on several GPUs, whose "
                   "entry counts, by its name or a unique part of one (default: this machine's)")
    p.add_argument("--table", help="tuned table or profile database (default: --db, else the default database)")
    add_db(p)
    p.add_argument("--with", dest="more", action="append", metavar="PATH",
                   help="more measurements (tuned table or profile database, e.g. the long-context run's "
                        "database of scripts/long_ctx.sh); their entries replace the main source's for the "
                        "same problem. Repeatable")
    p.add_argument("--include-predicted", action="store_true", help="also use predicted rows")
    p.add_argument("--tolerance", type=non_negative_float, default=0.01,
                   help="paged latency overhead over the arena still accepted (default 0.01 = 1%%)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(func=cmd_auto)

    p = sub.add_parser("rounding", help="tokens hidden from the drafter by page rounding of prefix hits")
    p.add_argument("--hits", type=_hit_lengths, required=True, help="prefix-hit lengths (list or @FILE)")
    p.add_argument("--pages", type=int_list, default=[16, 32, 64, 128], help="page sizes (default 16,32,64,128)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(func=cmd_rounding)
