"""The `tuner` command: sweeps into the profile database, and what it holds.

    tuner sweep SPEC [--db PATH]          measure a sweep spec (a TOML file, or "default")
    tuner refine TABLE --set K=V [--where K] [--max-batch N] [--min-batch N] [--with-winners] [--with-default]
                [--min-ctx N] [--max-ctx N] [--min-tokens N] [--preset NAME] [--sustain S]
                                          a tuned table's winners again with parameters changed
    tuner show [filters] [--format F]     the database's results as a table, CSV or JSON
    tuner compile --sm 90,107 | all       static compile profiles (no GPU needed)
    tuner merge DST SRC [SRC ...]         merge databases (e.g. from several machines)
    tuner export --sm 90 --out F.json     tuned table for the runtime (kernels.dispatch)
    tuner rekey [--from COMMIT]           carry rows across a kernel-source edit that left their
                                          machine code unchanged (no GPU)
    tuner diff A.json B.json [--gate]     winner flips and slowdowns between two tables
    tuner repeat A.db B.db [--figure F]   the same sweep run twice: winner flips and spread
    tuner predict --sm 100 [--from 90]    roofline-projected rows (provenance predicted)
    tuner auto --preset P --page 64 ...   paged or arena for a deployment, with reasons
    tuner rounding --hits 100,2000        context hidden from the drafter by page rounding
"""

from __future__ import annotations

import argparse
import json
import sys

from drafter_attn.kernels import tuned_table
from drafter_attn.tuner.cli_checks import (add_sustain_load, int_list, load_without_sustain,
                                            non_negative_float, positive_float, positive_int, positive_size)
from drafter_attn.tuner.db import ProfileDB, SchemaError, default_path

DB_HELP = """\
profile database: --db PATH, else $DRAFTER_DB, else profiles/profile.db of the source checkout
this tuner runs from (when it has a profiles/ folder), else
~/.local/share/drafter-attn/profile.db ($XDG_DATA_HOME/drafter-attn/profile.db): sweeps,
refine and compile write there. Commands that only read (show, export) read it where it holds
rows of the SM asked, else the profile database shipped for that SM (profiles/sm<SM>.db).
Currently: {path}"""

TABLE_COLUMNS = ["gpu_name", "sm", "preset", "mask", "layout", "page_size", "batch", "ctx_len", "impl",
                 "params", "status", "median_us", "p10_us", "p90_us", "attention_median_us",
                 "store_median_us", "roofline_fraction", "syncs", "kv_mib", "reason"]

# Shown beside `syncs` when a row has Nsight Systems figures: each detector layer's count and the
# host time blocked.
SYNC_COLUMNS = [*tuned_table.SYNC_COLUMNS, "sync_host_us", "sync_host_us_nsys"]

# Table-view headers (CSV and JSON keep the database's column names).
SHORT_HEADERS = {"page_size": "page", "ctx_len": "ctx", "attention_median_us": "attn_us",
                 "store_median_us": "store_us", "roofline_fraction": "roofline", "gpu_name": "gpu",
                 "syncs_debug": "s_debug", "syncs_profiler": "s_prof", "syncs_nsys": "s_nsys",
                 "sync_host_us": "blocked_us", "sync_host_us_nsys": "blocked_us_nsys"}
INT_COLUMNS = {"sm", "page_size", "batch", "ctx_len", "window", "count", "syncs", "syncs_debug",
               "syncs_profiler", "syncs_nsys", "dtoh_copies", "kv_bytes", "workspace_bytes", "peak_bytes",
               "registers", "spill_bytes", "smem_dynamic", "smem_static", "num_layers"}


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="PATH", help="profile database (default: see `tuner --help`)")


def _db_path(args):
    return args.db or default_path()


# ---------------------------------------------------------------------------------------------
# sweep (and refine: a table's winners with parameters changed)


def _list_candidates(candidates, source) -> int:
    """--dry-run: each candidate's label on stdout, the count on stderr."""
    for c in candidates:
        print(c.label())
    print(f"{len(candidates)} candidates from {source}", file=sys.stderr)
    return 0


def cmd_sweep(args) -> int:
    from drafter_attn.tuner.spec import load_spec
    from drafter_attn.tuner.sweep import SweepError, run_sweep

    if _load_without_sustain(args, "sweep"):
        return 2
    if args.ray_gpus and args.ray is None:
        print("tuner sweep: --ray-gpus caps a Ray sweep's GPUs: give --ray too (or --devices for "
              "local GPUs)", file=sys.stderr)
        return 2
    spec = load_spec(args.spec)
    candidates = [c.sustained(args.sustain, args.sustain_load) for c in spec.candidates()]
    if args.dry_run:
        return _list_candidates(candidates, spec.source)
    path = _db_path(args)
    where = "local GPUs" if args.ray is None else f"Ray cluster {args.ray or '(new, local)'}"
    print(f"sweep {spec.name!r}: {len(candidates)} candidates on {where} -> {path}", file=sys.stderr)
    common = dict(timeout_s=args.timeout or spec.timeout_s,
                  options=dict(reps=spec.reps, nsys=spec.nsys),
                  retry_failed=args.retry_failed, progress=not args.no_progress, name=spec.name)
    if args.ray is not None:
        from drafter_attn.tuner.ray_sweep import run_ray_sweep

        if args.devices:
            raise SweepError("--devices is for local sweeps; with --ray every GPU of the cluster is used "
                             "(--ray-gpus N caps how many)")
        out = run_ray_sweep(candidates, path, address=args.ray or None, max_gpus=args.ray_gpus, **common)
    else:
        devices = [d for d in args.devices.split(",") if d] if args.devices else None
        out = run_sweep(candidates, path, devices=devices, **common)
    print(f"sweep {out.sweep_id}: {out.summary()}", file=sys.stderr)
    return 0


SUSTAIN_HELP = ("replay each candidate's step back to back this long before each of its timings: "
                "the clock state of a sustained load (the H200 lowers its SM clock to hold its power "
                "limit, and some kernels slow with it). Such rows are the sustained regime's "
                "candidates, apart from a burst's (`tuner export --regime sustained`), measured "
                "once each: a second run resumes; each row records its SM clock either way")


def _load_without_sustain(args, command: str) -> bool:
    """A co-runner's load asked without --sustain: said, True."""
    problem = load_without_sustain(args.sustain_load, args.sustain)
    if problem:
        print(f"tuner {command}: {problem}", file=sys.stderr)
    return problem is not None


def cmd_refine(args) -> int:
    from drafter_attn.kernels.registry import parse_spec
    from drafter_attn.kernels.tuned_table import TableError
    from drafter_attn.tuner.refine import refine_candidates
    from drafter_attn.tuner.sweep import run_sweep

    if _load_without_sustain(args, "refine"):
        return 2
    if args.again and not args.with_winners:
        print("tuner refine: --again measures the winners and runners-up again: give --with-winners",
              file=sys.stderr)
        return 2
    if not args.set and not args.with_winners and not args.with_default:
        print("tuner refine: nothing to measure: give --set NAME=VALUE (a knob to try), or "
              "--with-winners alone (the winners and their runners-up again, side by side), or "
              "--with-default", file=sys.stderr)
        return 2
    if args.preset:
        from drafter_attn.kernels.presets import get_preset
        try:
            get_preset(args.preset)
        except ValueError as exc:
            print(f"tuner refine: --preset: {exc}", file=sys.stderr)
            return 2
    try:
        overrides = parse_spec(f"{args.impl}:{','.join(args.set)}")[1] if args.set else {}
        candidates, skipped = refine_candidates(args.table, overrides, tuple(args.where), args.impl,
                                                args.max_batch, with_winners=args.with_winners,
                                                min_batch=args.min_batch, min_ctx=args.min_ctx,
                                                max_ctx=args.max_ctx, preset=args.preset,
                                                min_tokens=args.min_tokens, with_default=args.with_default)
    except (TableError, ValueError) as exc:  # the table, or a bad --set or --impl
        print(f"tuner refine: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError) as exc:  # an entry without the fields an exported one has
        print(f"tuner refine: {args.table}: an entry is not one `tuner export` writes "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    candidates = [c.sustained(args.sustain, args.sustain_load) for c in candidates]
    # --with-winners: every candidate (winner, runners-up, refined) measured in this sweep,
    # whatever rows it had before. Sustained candidates are keys of their own, measured once:
    # a second run of the same refine resumes where the first stopped
    fresh = {c.key() for c in candidates if not c.sustain_s or args.again} if args.with_winners else set()
    for line in skipped:
        print(f"not applicable: {line}", file=sys.stderr)
    if args.dry_run:
        return _list_candidates(candidates, args.table)
    path = _db_path(args)
    print(f"refine {args.table} with {overrides}: {len(candidates)} candidates -> {path}", file=sys.stderr)
    out = run_sweep(candidates, path, timeout_s=args.timeout, options=dict(reps=0, nsys=False),
                    retry_failed=args.retry_failed, progress=not args.no_progress, name="refine",
                    fresh=fresh)
    print(f"sweep {out.sweep_id}: {out.summary()}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# show


def load_results(path, *, sm=None, gpu=None, preset=None, impl=None, status=None, layout=None,
                 page_size=None, batch=None, ctx_len=None, sweep=None):
    """Results joined with their environment, filtered, as a pandas DataFrame. `status` "failed"
    matches every failed_* status."""
    import pandas as pd

    where, args = [], []
    for column, value in (("e.sm", sm), ("r.preset", preset), ("r.impl", impl), ("r.layout", layout),
                          ("r.page_size", page_size), ("r.batch", batch), ("r.ctx_len", ctx_len),
                          ("r.sweep_id", sweep)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if gpu:
        where.append("e.gpu_name LIKE ?")
        args.append(f"%{gpu}%")
    if status == "failed":
        where.append("r.status LIKE 'failed%'")
    elif status:
        where.append("r.status = ?")
        args.append(status)
    sql = ("SELECT e.gpu_name, e.sm, e.driver, r.* FROM results r JOIN environments e USING (env_id)"
           + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY r.id")
    with ProfileDB(path, readonly=True) as db:
        df = db.frame(sql, args)
    # the most host syncs any detector layer measured (NULL where none ran)
    detectors = df[list(tuned_table.SYNC_COLUMNS)].to_dict("records")
    df["syncs"] = pd.to_numeric(pd.Series([tuned_table.sync_count(r) for r in detectors], index=df.index,
                                          dtype=object))
    df["kv_mib"] = df["kv_bytes"] / 2**20
    return df


def load_compile_profiles(path, sm=None):
    sql = "SELECT * FROM compile_profiles" + (" WHERE sm = ?" if sm is not None else "") + " ORDER BY id"
    with ProfileDB(path, readonly=True) as db:
        return db.frame(sql, [sm] if sm is not None else [])


def _compact_params(text) -> str:
    try:
        return ",".join(f"{k}={v}" for k, v in json.loads(text).items())
    except (TypeError, ValueError):
        return str(text)


def print_frame(df, fmt: str, columns=None, title: str = "") -> None:
    """`columns` of a DataFrame (default: all) as a rich table, CSV or JSON (records) on stdout."""
    columns = [c for c in (columns or df.columns) if c in df.columns]
    if fmt == "csv":
        df[columns].to_csv(sys.stdout, index=False)
        return
    if fmt == "json":
        sys.stdout.write(df[columns].to_json(orient="records", indent=1) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for c in columns:
        table.add_column(SHORT_HEADERS.get(c, c), justify="right" if df[c].dtype.kind in "if" else "left",
                         overflow="fold")
    for row in df[columns].itertuples(index=False):
        cells = []
        for c, v in zip(columns, row):
            if v is None or (isinstance(v, float) and v != v):
                cells.append("")
            elif c == "params":
                cells.append(_compact_params(v))
            elif isinstance(v, float) and c in INT_COLUMNS:  # ints with gaps come back as floats
                cells.append(str(int(v)))
            elif isinstance(v, float):
                cells.append(f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
            else:
                cells.append(str(v))
        table.add_row(*cells)
    # A terminal folds wide cells; piped output keeps each row on one line.
    Console(width=None if sys.stdout.isatty() else 1000).print(table)


def cmd_show(args) -> int:
    from drafter_attn.tuner.db import reading_path

    path = args.db or reading_path(args.sm, "compile_profiles" if args.compile else "results")
    if args.compile:
        df = load_compile_profiles(path, args.sm)
        print_frame(df, args.format, ["sm", "arch", "variant", "kernel", "registers", "spill_bytes",
                                      "smem_dynamic", "compile_s", "created_at"], f"compile profiles in {path}")
        return 0
    df = load_results(path, sm=args.sm, gpu=args.gpu, preset=args.preset, impl=args.impl,
                      status=args.status, layout=args.layout, page_size=args.page_size, batch=args.batch,
                      ctx_len=args.ctx_len, sweep=args.sweep)
    if args.limit:
        df = df.tail(args.limit)
    # The table view shows the usual columns; CSV and JSON (and --all-columns) carry everything.
    columns = TABLE_COLUMNS if args.format == "table" and not args.all_columns else None
    if columns and "syncs_nsys" in df and df["syncs_nsys"].notna().any():
        # every layer side by side where Nsight Systems measured
        at = columns.index("syncs") + 1
        columns = columns[:at] + [c for c in SYNC_COLUMNS if c in df] + columns[at:]
    if columns and "sustain_s" in df and df["sustain_s"].notna().any():
        # a sustained row is another regime's timing: say which rows are, and at what clock
        at = columns.index("p90_us") + 1
        load = ["sustain_load"] if "sustain_load" in df and df["sustain_load"].notna().any() else []
        columns = columns[:at] + ["sustain_s", *load, "sm_clock_mhz"] + columns[at:]
    print_frame(df, args.format, columns, f"{len(df)} results in {path}")
    if df.empty and args.preset:
        with ProfileDB(path, readonly=True) as db:
            have = [r["preset"] for r in db.query("SELECT DISTINCT preset FROM results ORDER BY preset")]
        if args.preset not in have:
            print(f"tuner show: no rows of preset {args.preset!r} in {path} (its presets: "
                  f"{', '.join(map(str, have)) or 'none'})", file=sys.stderr)
            return 2
    return 0


# ---------------------------------------------------------------------------------------------
# compile


def _compile_fail(message) -> int:
    print(f"tuner compile: {message}", file=sys.stderr)
    return 2


def _compile_presets(text: str | None):
    """The presets `--presets` names (None: all); a KeyError names the unknown ones."""
    from drafter_attn.kernels.presets import PRESETS

    if not text:
        return None
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PRESETS]
    if unknown or not names:
        raise KeyError(f"--presets: unknown preset(s) {', '.join(unknown) or repr(text)}; "
                       f"known: {', '.join(PRESETS)}")
    return {p: PRESETS[p] for p in names}


def _compile_variants(args, presets) -> list:
    from drafter_attn.kernels import static_profile

    variants = []
    if args.backend in ("all", "cupy"):
        variants += static_profile.cupy_default_variants(args.pages, presets, sms=args.sm)
    if args.backend in ("all", "cutlass"):
        cutlass = static_profile.cutlass_default_variants(args.pages, presets, sms=args.sm)
        if not cutlass:
            print("tuner compile: no cutlass variants (nvidia-cutlass is not installed: "
                  "pip install -e '.[cutlass]')", file=sys.stderr)
        variants += cutlass
    return variants


def static_profile_sms(text: str):
    from drafter_attn.kernels.static_profile import parse_sms

    return parse_sms(text)


def cmd_compile(args) -> int:
    from drafter_attn.kernels import cupy_backend, nvrtc, static_profile

    bad_pages = [p for p in args.pages if p not in cupy_backend.PAGE_SIZES]
    if bad_pages:
        return _compile_fail(f"--pages: {', '.join(map(str, bad_pages))} not a page size the kernels "
                             f"compile ({', '.join(map(str, cupy_backend.PAGE_SIZES))}; the arena "
                             f"is always compiled)")
    if args.workers is not None and args.workers < 1:
        return _compile_fail(f"--workers: expected a positive number, got {args.workers}")
    try:
        presets = _compile_presets(args.presets)
        args.sm = static_profile.resolve_sms(args.sm)  # needs NVRTC: after the cheap checks
    except KeyError as exc:
        return _compile_fail(exc.args[0])
    except nvrtc.CompileError as exc:  # no cuda-bindings, or an SM this NVRTC cannot build
        return _compile_fail(exc)
    rows = static_profile.compile_variants(args.sm, _compile_variants(args, presets),
                                           workers=args.workers)
    static_profile.print_table(rows)
    if not args.no_db:
        path = _db_path(args)
        with ProfileDB(path) as db:
            n = db.add_compile_rows(rows, nvrtc.sources_digest(), ".".join(map(str, nvrtc.nvrtc_version())))
        print(f"{n} kernel profiles stored in {path}", file=sys.stderr)
    spills = [r for r in rows if r["spill_bytes"]]
    problems = static_profile.sass_problems(rows) + static_profile.smem_problems(rows)
    if spills:
        print(f"tuner compile: {len(spills)} kernel(s) spill registers (red rows)", file=sys.stderr)
    for line in problems:
        print(f"tuner compile: {line}", file=sys.stderr)
    return 1 if spills or problems else 0


# ---------------------------------------------------------------------------------------------
# merge


def cmd_merge(args) -> int:
    from drafter_attn.tuner.db import merge

    added = merge(args.dst, *args.src)
    print(f"merged {len(args.src)} database(s) into {args.dst}: "
          + ", ".join(f"{n} {table}" for table, n in added.items()), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tuner", description=__doc__,
                                 epilog=DB_HELP.format(path=default_path()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sweep", help="measure a sweep spec into the profile database",
                       description="Measure every candidate of a sweep spec, each in a worker process "
                       "(one per visible GPU, or per GPU of a Ray cluster with --ray); results are "
                       "written as they finish, and a sweep run again skips what is done.", epilog=DB_HELP.format(path=default_path()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help='a TOML sweep spec, or "default" for the spec shipped with the tuner')
    _add_db(p)
    p.add_argument("--devices", help="CUDA_VISIBLE_DEVICES entries to use, e.g. 0,1 (default: every visible GPU)")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="spread the sweep over every GPU of a Ray cluster (one actor per GPU): "
                   "ADDRESS 'auto' joins the cluster running here, HOST:PORT that one; no ADDRESS "
                   "starts a local cluster (needs the [ray] extra)")
    p.add_argument("--ray-gpus", type=positive_int, metavar="N", help="with --ray: use at most N of the cluster's GPUs")
    p.add_argument("--timeout", type=positive_float, help="seconds per candidate (default: the spec's timeout_s)")
    p.add_argument("--sustain", type=non_negative_float, default=0.0, metavar="SECONDS", help=SUSTAIN_HELP)
    add_sustain_load(p)
    p.add_argument("--retry-failed", action="store_true", help="measure failed candidates again")
    p.add_argument("--dry-run", action="store_true", help="list the candidates and stop")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("refine", help="measure a tuned table's winners again with parameters changed",
                       description="Measure every measured winner of a tuned table (JSON, `tuner "
                       "export`) whose parameters named by --where are set, once more with --set "
                       "applied, at its own problem and target, into the profile database; `tuner "
                       "export` then keeps the faster at each key. For an opt-in knob, where the "
                       "whole grid again would cost a full sweep.", epilog=DB_HELP.format(path=default_path()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", help="tuned table JSON (e.g. profiles/sm90.json)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter to change (repeatable), e.g. q_step=1; without it, "
                   "--with-winners measures the winners and their runners-up again, nothing new")
    p.add_argument("--where", action="append", default=[], metavar="NAME",
                   help="only winners with this parameter set (true, non-zero; repeatable), e.g. ws")
    p.add_argument("--max-batch", type=positive_int, metavar="N",
                   help="only winners of at most N requests (a knob of the split combine matters "
                   "where calls split: the small batches)")
    p.add_argument("--min-batch", type=positive_int, metavar="N",
                   help="only winners of at least N requests (pair=1 pays where it takes the "
                   "combine away: the batches the split model gives two splits)")
    p.add_argument("--min-ctx", type=positive_size, metavar="TOKENS",
                   help="only winners of keys at least this long (128k, 131072)")
    p.add_argument("--max-ctx", type=positive_size, metavar="TOKENS",
                   help="only winners of keys at most this long")
    p.add_argument("--preset", metavar="NAME", help="only winners of this preset's keys "
                   "(e.g. qwen3-8b-dflash-b16)")
    p.add_argument("--min-tokens", type=positive_size, metavar="TOKENS",
                   help="only winners of keys whose batch x context is at least this (256k: the "
                   "calls whose own load holds the H200 at its power limit, for --sustain)")
    p.add_argument("--with-default", action="store_true",
                   help="also the backend's default parameters at each key (what the runtime runs "
                   "without a table; a table's runners-up need not include it)")
    p.add_argument("--with-winners", action="store_true",
                   help="measure each winner and the runners-up the table lists beside it again, "
                   "right before its refined candidate (that one again too where it has a row), so "
                   "that the export decides each key on rows of one run (it takes each "
                   "candidate's newest)")
    p.add_argument("--again", action="store_true",
                   help="with --with-winners: sustained candidates measured again too, even where "
                   "rows exist (after a change in how sustained timings are taken, so that no key "
                   "is decided on rows of two methods)")
    p.add_argument("--impl", default="cupy", help="the backend whose winners to refine (default cupy)")
    _add_db(p)
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds per candidate")
    p.add_argument("--sustain", type=non_negative_float, default=0.0, metavar="SECONDS", help=SUSTAIN_HELP)
    add_sustain_load(p)
    p.add_argument("--retry-failed", action="store_true", help="measure failed candidates again")
    p.add_argument("--dry-run", action="store_true", help="list the candidates and stop")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_refine)

    p = sub.add_parser("show", help="show results (pandas; table, CSV or JSON)",
                       epilog=DB_HELP.format(path=default_path()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_db(p)
    p.add_argument("--sm", type=int, help="SM of the GPU, e.g. 90")
    p.add_argument("--gpu", help="part of the GPU name, e.g. H200")
    p.add_argument("--preset", help="geometry name (preset or spec geometry)")
    p.add_argument("--impl", help="backend name")
    p.add_argument("--status", help="ok, failed (any failure), failed_runtime, ..., unsupported")
    p.add_argument("--layout", choices=["paged", "arena"])
    p.add_argument("--page-size", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--ctx-len", type=int)
    p.add_argument("--sweep", help="sweep id")
    p.add_argument("--limit", type=positive_int, help="only the last N rows")
    p.add_argument("--all-columns", action="store_true", help="every column in the table view")
    p.add_argument("--compile", action="store_true", help="the static compile profiles instead")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("compile", help="static compile profiles per SM (registers, smem, spills); no GPU",
                       description="Compile the default kernel variants with NVRTC for each SM target, "
                       "print registers / shared memory / spills, store them in the database; exit 1 "
                       "when a kernel spills, traps, lacks tensor-core MMAs or needs more shared "
                       "memory than a CTA gets on its SM.", epilog=DB_HELP.format(path=default_path()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sm", type=static_profile_sms, default=(90, 100, 103),
                   help="SM targets, e.g. 90,100,107, or all (every NVRTC target from SM 80 up)")
    p.add_argument("--presets", help="only these presets (comma-separated; default: all)")
    p.add_argument("--pages", type=int_list, default=(16, 64, 128),
                   help="page sizes of the paged variants (default 16,64,128; the arena is always compiled)")
    p.add_argument("--workers", type=int, help="parallel compiler processes (default: CPU count)")
    p.add_argument("--backend", choices=["all", "cupy", "cutlass"], default="all",
                   help="whose kernels (default: all; cutlass needs the nvidia-cutlass wheel)")
    _add_db(p)
    p.add_argument("--no-db", action="store_true", help="print only; store nothing")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("merge", help="merge profile databases into DST (created when missing)")
    p.add_argument("dst")
    p.add_argument("src", nargs="+")
    p.set_defaults(func=cmd_merge)

    from drafter_attn.tuner import tables_cli

    tables_cli.add_commands(sub, _add_db)
    return ap


def main(argv=None) -> int:
    from drafter_attn.tuner.spec import SpecError
    from drafter_attn.tuner.sweep import SweepError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SchemaError, SpecError, SweepError) as exc:
        print(f"tuner {args.command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the command needs cannot be read or written (full disk, folder)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"tuner {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tuner {args.command}: interrupted (finished results are in the database)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
