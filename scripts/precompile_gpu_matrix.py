"""Compile, in parallel processes, every kernel variant a GPU run will load, so the tests and
tables do not compile one module after another (CuTe modules take 15-30 s each).

    python scripts/precompile_gpu_matrix.py [SPEC ...]          # the GPU test matrix (default: its BACKENDS;
                                                               # PADDED_SPECS add their padded-wgmma cases)
    python scripts/precompile_gpu_matrix.py --table "cupy;cutlass" --no-tests
                                                               # what bench.attention_table loads
    python scripts/precompile_gpu_matrix.py --table "auto" --shapes 1x2k,8x8k --no-tests
                                                               # (auto: the runtime's pick per shape)
    python scripts/precompile_gpu_matrix.py --sweep tuner/specs/sm90.toml --no-tests [--db DB]
                                                               # what a tuner sweep of a spec loads
    python scripts/precompile_gpu_matrix.py --no-tests --calls "cupy:ws=3,stages=9" 4 128k 64 ...
                                                               # the calls of a diag script's cases
    python scripts/precompile_gpu_matrix.py --refine profiles/sm90.json --set q_step=1 --where ws \
        [--max-batch N] [--min-batch N] [--with-winners] --no-tests [--db DB]
                                                               # what `tuner refine` measures
                                                               # (into DB: what it still measures)
    python scripts/precompile_gpu_matrix.py --shipped --no-tests
                                                               # tests/test_shipped_picks_gpu.py's picks
"""
import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from drafter_attn.kernels import registry  # noqa: E402
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset  # noqa: E402
from drafter_attn.kernels.spec import Problem  # noqa: E402
from drafter_attn.tuner.sizes import parse_size  # noqa: E402
from tests import test_backends_gpu as matrix  # noqa: E402


def _compile(job):
    module_name, defines, sm = job
    module = sys.modules.get(module_name) or __import__(module_name, fromlist=["x"])
    res = module.compile_variant(dict(defines), sm)
    return res.seconds, res.cached


def _job(backend, problem, sm):
    """The (module, defines, sm) of `problem`'s attention kernel, or None if unsupported."""
    if backend.supports(problem):
        return None
    kern, geom = backend.family, problem.geometry
    d = kern.variant_defines(geom.dtype, geom.head_dim, problem.page_size, geom.block_size,
                             geom.group, backend.params_for(problem), sm)
    return kern.module, tuple(sorted(d.items())), sm


def matrix_jobs(specs, sm):
    out = set()
    for spec in specs:
        backend = registry.from_spec(spec)
        kern = backend.family
        # a padded-wgmma, row-split or ws_rows spec outside BACKENDS runs only its own cases
        # (test_padded_wgmma_*, test_row_split_*, test_ws_rows_*)
        own = [cases() for specs, cases in ((matrix.PADDED_SPECS, matrix._padded_cases),
                                            (matrix.ROW_SPLIT_SPECS, matrix._row_split_cases),
                                            (matrix.WS_ROWS_SPECS, matrix._ws_rows_cases))
               if spec in specs]
        cases = matrix._cases() if spec in matrix.BACKENDS or not own else []
        cases = cases + [case for group in own for case in group]
        for case in cases:
            geom, page, lens, _ = case.values
            for layout, ps in (("paged", page), ("arena", None)):
                if layout == "paged" and not page:  # a padded case of the arena
                    continue
                out.add(_job(backend, Problem(geom, layout, ps, len(lens), 0), sm))
        for dtype in ("bfloat16", "float16"):  # store modules (block 1, group 1, defaults)
            for ps in (*kern.PAGE_SIZES, None):
                for hd in kern.HEAD_DIMS:
                    d = kern.variant_defines(dtype, hd, ps, 1, 1, kern.Params(), sm)
                    out.add((kern.module, tuple(sorted(d.items())), sm))
    return out


def table_jobs(specs, preset, pages, sm, shapes=()):
    """drafter_attn.bench.attention_table's variants: `preset` at each page size and the arena (params do
    not depend on batch or context beyond the split count, a launch argument); `auto` is the
    runtime's pick at each of `shapes` ((batch, ctx) pairs), as the table resolves it."""
    from drafter_attn.bench import attention_table as at
    from drafter_attn.bench.decode import load_dispatcher

    geom = get_preset(preset).with_(num_layers=1)
    out = set()
    for spec in specs:
        regime = at.auto_regime(spec)
        dispatcher = None if regime is None else load_dispatcher(None, sm, regime)[0]
        for ps in (*pages, None):
            layout = "paged" if ps else "arena"
            if regime is None:
                out.add(_job(registry.from_spec(spec), Problem(geom, layout, ps, 1, 0), sm))
            for b, c in shapes if regime is not None else ():
                one = at.pick_spec(dispatcher, geom, layout, ps, b, c, sm)
                out.add(_job(registry.from_spec(one), Problem(geom, layout, ps, b, c), sm))
    return out


def candidate_jobs(candidates, sm, db=None):
    """Every variant `candidates` load (each attention module, and the store's module per layout
    at default parameters, as the step loads it), less those `db` holds a row of on today's
    kernel sources."""
    from drafter_attn.kernels.nvrtc import sources_digest
    from drafter_attn.tuner.db import ProfileDB

    done = set()
    if db and os.path.exists(db):
        with ProfileDB(db, readonly=True) as profile:
            done = profile.done_candidates(None, sources_hash=sources_digest())
    out = set()
    for c in candidates:
        if c.key() in done:
            continue
        backend = registry.get(c.impl)
        kern = getattr(backend, "family", None)
        if kern is None:  # the torch reference compiles nothing
            continue
        p, g = c.problem, c.problem.geometry
        out.add(_job(backend.with_params(**c.params_dict), p, sm))
        d = kern.variant_defines(g.dtype, g.head_dim, p.page_size, 1, 1, kern.Params(), sm)
        out.add((kern.module, tuple(sorted(d.items())), sm))
    return out


def sweep_jobs(paths, sm, db=None):
    """Every variant the candidates of the sweep specs `paths` load: each attention module, and
    the store's module per layout (a minimal geometry at default parameters, as the step loads it).
    With `db` (a profile database), only the candidates it holds no row of on today's kernel
    sources: what a sweep into it still measures."""
    from drafter_attn.tuner.spec import load_spec

    return candidate_jobs([c for path in paths for c in load_spec(path).candidates()], sm, db)


def shipped_jobs(sm):
    """The variants tests/test_shipped_picks_gpu.py runs: each distinct pick of the shipped tables
    for `sm` (its parameters are pinned, so its key's batch and context change no define)."""
    from tests import test_shipped_picks_gpu as shipped

    return {_job(registry.from_spec(shipped._spec(e)),
                 Problem(shipped._geometry(e), e["layout"], e["page_size"], e["batch"], e["ctx_len"]), sm)
            for e in shipped.PICKS if e["sm"] == sm}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="*", help="backend specs of the test matrix (default: its BACKENDS)")
    ap.add_argument("--no-tests", action="store_true", help="leave out the test matrix")
    ap.add_argument("--table", default="", help="';'-separated specs as bench.attention_table --impl")
    ap.add_argument("--preset", help=f"with --table: its preset (default {MAIN_PRESET}); with "
                    "--refine: only that preset's keys")
    ap.add_argument("--page", default="16,64,128")
    ap.add_argument("--shapes", default="", help="with --table auto: the BxCTX shapes of the table's --shapes")
    ap.add_argument("--sweep", action="append", default=[], metavar="SPEC",
                    help="also every variant of this sweep spec's candidates (repeatable)")
    ap.add_argument("--refine", metavar="TABLE", help="also every variant `tuner refine TABLE` "
                    "measures with --set and --where")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="with --refine")
    ap.add_argument("--impl", default="cupy", help="with --refine: the backend whose winners it refines")
    ap.add_argument("--where", action="append", default=[], metavar="NAME", help="with --refine")
    ap.add_argument("--max-batch", type=int, metavar="N", help="with --refine")
    ap.add_argument("--min-batch", type=int, metavar="N", help="with --refine")
    ap.add_argument("--min-ctx", type=parse_size, metavar="TOKENS", help="with --refine")
    ap.add_argument("--max-ctx", type=parse_size, metavar="TOKENS", help="with --refine")
    ap.add_argument("--min-tokens", type=parse_size, metavar="TOKENS", help="with --refine")
    ap.add_argument("--sustain", type=float, metavar="SECONDS", help="with --refine: accepted so that "
                    "a refine's arguments pass as they are (the regime compiles nothing of its own)")
    ap.add_argument("--sustain-load", metavar="LOAD", help="with --refine: accepted as --sustain is")
    ap.add_argument("--with-default", action="store_true", help="with --refine: the default "
                    "parameters at each key too")
    ap.add_argument("--with-winners", action="store_true", help="with --refine: the winners and "
                    "their runners-up too (`tuner refine --with-winners` measures them all again, so "
                    "--db leaves none out)")
    ap.add_argument("--again", action="store_true", help="with --refine: accepted as --sustain is "
                    "(with --with-winners every candidate is compiled already)")
    ap.add_argument("--calls", nargs="+", default=[], metavar="SPEC B CTX PAGE",
                    help="also the attention variant of each paged call of the main preset (the "
                    "diag scripts' case lists: SPEC B CTX PAGE, repeated)")
    ap.add_argument("--shipped", action="store_true", help="also every pick of the shipped tuned "
                    "tables (tests/test_shipped_picks_gpu.py)")
    ap.add_argument("--db", help="with --sweep or --refine: leave out the candidates this profile "
                    "database holds")
    ap.add_argument("--sm", type=int, help="target (default: this machine's GPU; no GPU needed if given)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.sm is None:
        props = torch.cuda.get_device_properties(0)
        args.sm = props.major * 10 + props.minor
    sm = args.sm
    todo = set()
    if not args.no_tests:
        todo |= matrix_jobs(args.specs or matrix.BACKENDS, sm)
    if args.table:
        from drafter_attn.bench.attention_table import shapes

        todo |= table_jobs(args.table.split(";"), args.preset or MAIN_PRESET, [int(p) for p in args.page.split(",")], sm,
                           shapes(args.shapes))
    todo |= sweep_jobs(args.sweep, sm, args.db)
    if args.shipped:
        todo |= shipped_jobs(sm)
    if len(args.calls) % 4:
        ap.error("--calls takes SPEC B CTX PAGE groups of four")
    for i in range(0, len(args.calls), 4):
        spec, batch, ctx, page = args.calls[i:i + 4]
        todo.add(_job(registry.from_spec(spec), Problem(get_preset(MAIN_PRESET), "paged", int(page),
                                                         int(batch), parse_size(ctx)), sm))
    if args.refine:
        from drafter_attn.kernels.registry import parse_spec
        from drafter_attn.tuner.refine import refine_candidates

        sets = parse_spec(f"{args.impl}:" + ",".join(args.set))[1] if args.set else {}
        found = refine_candidates(args.refine, sets, tuple(args.where), args.impl, max_batch=args.max_batch,
                                  with_winners=args.with_winners, min_batch=args.min_batch,
                                  min_ctx=args.min_ctx, max_ctx=args.max_ctx, preset=args.preset,
                                  min_tokens=args.min_tokens, with_default=args.with_default)[0]
        todo |= candidate_jobs(found, sm, None if args.with_winners else args.db)
    todo = sorted(j for j in todo if j is not None)
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        results = list(pool.map(_compile, todo))
    print(f"{len(todo)} variants for sm_{sm}: {sum(not c for _, c in results)} compiled, "
          f"{sum(s for s, c in results if not c):.0f} s of compile time")


if __name__ == "__main__":
    main()
