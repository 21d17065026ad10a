"""A new knob measured where it matters: a tuned table's winners again, with parameters changed.

A knob added to a backend (an opt-in define that leaves every other variant's machine code as it
was) would otherwise need a sweep spec of its own, or the whole grid measured again, before the
runtime could pick it. `tuner refine TABLE --set q_step=1 --where ws` measures each winner of the
table that runs the warp-specialised kernel once more with `q_step=1`, at that winner's own
problem and target, into the profile database; `tuner export` then picks whichever of the two is
faster at each key. Nothing else of the grid is measured, so a knob that would only win with
other parameters changed as well is not found this way.

    tuner refine profiles/sm90.json --set q_step=1 --where ws --db profiles/sm90.db
    tuner refine profiles/sm90.json --set one_trip=1 --max-batch 8 --with-winners --db profiles/sm90.db
    tuner refine profiles/sm90.json --with-winners --min-ctx 128k --max-batch 4 --db profiles/sm90.db

Without `--with-winners` the export weighs each refined row, measured today, against its
winner's row from the sweep that found it, maybe days before on another lease (and a refined
candidate measured before is not measured again). With it, each winner, the runners-up the
table lists beside it (`alternatives`, its next three) and its refined candidate are measured in
this sweep, one right after another, whatever rows they had (the export takes each candidate's
newest row), so the comparisons that decide a key are of one run. (Refreshing the winner alone
is not enough: on the H200, of 10 keys whose winner changed after its winner was measured again,
9 went to a runner-up's older row, 0-4% apart; results/sm90-2026-12-04/session25/
refine-with-winners/.) Without `--set`, `--with-winners` alone measures each winner and its
runners-up again side by side and nothing new: for keys whose winner and runners-up came from
different runs and lie within a few percent, where the table's pick is a lease's word against
another's.
"""

from __future__ import annotations

import json
from pathlib import Path

from drafter_attn.kernels import registry, tuned_table
from drafter_attn.tuner.spec import Candidate, problem_from_key


def refine_candidates(table: str | Path, overrides: dict, where: tuple[str, ...] = (),
                      impl: str = "cupy", max_batch: int | None = None,
                      with_winners: bool = False,
                      min_batch: int | None = None, min_ctx: int | None = None,
                      max_ctx: int | None = None,
                      preset: str | None = None,
                      min_tokens: int | None = None,
                      with_default: bool = False) -> tuple[list[Candidate], list[str]]:
    """(candidates, skipped): every measured winner of `table` run by `impl` whose parameters
    named in `where` are all set (true, non-zero), and of at most `max_batch` and at least
    `min_batch` requests where given, with `overrides` applied over its own parameters;
    `skipped` says, a line each, which winners the overrides do not apply to and why.
    Duplicates (two entries of one key) are measured once. (`max_batch` keeps a knob of the
    split combine, `one_trip`, to the batches whose calls split: the split model gives the large
    ones one split, and there the knob changes nothing that runs; `min_batch` keeps one whose
    gain the split count bounds from below, `pair`, to the batches that split in two.)
    `min_ctx` / `max_ctx` keep the winners of keys within those context lengths, `preset` those
    of one preset's geometry, `min_tokens` those of batch x context at least that.
    `with_winners`: each winner itself (as it was measured) and the entry's alternatives of
    `impl` right before its refined candidate (`tuner refine --with-winners` measures them all
    again); with no `overrides` the refined candidate is the winner itself, so that is a plain
    side-by-side re-measure. `with_default`: also `impl`'s default parameters at the key (what
    the runtime runs without a table), which a table's runners-up need not list."""
    try:
        text = Path(table).read_bytes()
    except OSError as exc:
        raise tuned_table.TableError(f"cannot read {table}: {exc.strerror or exc}") from None
    entries = tuned_table.validate_table(tuned_table.parse_json(text, str(table)), str(table))
    backend = registry.get(impl)
    registry.check_params(backend, overrides)
    known = set(registry.param_schema(backend))
    out: dict[str, Candidate] = {}
    skipped = []
    for e in entries:
        if e["impl"] != impl or e.get("provenance", {}).get("kind", "measured") != "measured":
            continue
        if not all(e["params"].get(w) for w in where):
            continue
        if max_batch is not None and e["batch"] > max_batch:
            continue
        if min_batch is not None and e["batch"] < min_batch:
            continue
        if preset is not None and e.get("provenance", {}).get("preset") != preset:
            continue
        if (min_ctx is not None and e["ctx_len"] < min_ctx) or (max_ctx is not None and e["ctx_len"] > max_ctx):
            continue
        if min_tokens is not None and e["batch"] * e["ctx_len"] < min_tokens:
            continue
        problem, sm = problem_from_key(e), e["sm"]  # an entry holds its problem's key fields
        wanted = {k: v for k, v in e["params"].items() if k in known}
        bound = {**wanted, **overrides}
        why = registry.supports(backend.with_params(**bound), problem, sm)
        if why:
            skipped.append(f"{e['layout']} page {e['page_size']} B={e['batch']} ctx={e['ctx_len']}: {why}")
            continue
        # the winner and its runners-up as they were measured (with_winners), then the refined one
        runners_up = [{k: v for k, v in a["params"].items() if k in known}
                      for a in e.get("alternatives", []) if a["impl"] == impl]
        for chosen in ([wanted, *runners_up] if with_winners else []) + [bound] + ([{}] if with_default else []):
            params = registry.resolve_params(backend, problem, sm, chosen)
            cand = Candidate(problem, impl, tuple(sorted(params.items())), None,
                             e["provenance"].get("preset"), f"sm{sm}")
            out.setdefault(cand.key(), cand)
    return list(out.values()), skipped
