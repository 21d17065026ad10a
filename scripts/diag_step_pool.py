"""Why a paged call can time slower in the attention table than in diag_page_order's pool: the
table times the attention of a one-layer `DecodeStep` (tuner/step.py), whose pool has room for
the step's store and whose lengths include the stored block (ctx + Qb: the last page part-full),
where diag_page_order's pool holds exactly `ctx` tokens a request. This times one spec's call on
each, interleaved in rounds of CUDA-graph replays (L2 flushed before each), with the pools in
between:

    plain      diag_page_order's shuffled pool, lengths ctx
    plus_qb    the same kind of pool for lengths ctx + Qb, with the step's extra page a request
    step       DecodeStep(...).attention_only, what bench.attention_table times
    step_ctx   the step's own pool and table, lengths set back to ctx
    arena      diag_page_order's arena

each timed with the L2 flushed before every replay (`cold`, as the diag scripts time) and without
(`warm`: back-to-back replays, as bench.attention_table and the tuner time a step of more than
four L2 sizes, tuner.measure.FLUSH_BELOW_L2_MULTIPLE).

    [ROUNDS=8] [REPS=20] [MODES=cold,warm] python scripts/diag_step_pool.py [SPEC B CTX PAGE] ...

(on a GPU). Default: the table's B=8 32k page-128 pick (pair). Prints one line a round and mode
(with nvidia-smi's clocks, power and throttle reasons after the round), then each layout's and
mode's fastest round and the median of its rounds.
"""
from __future__ import annotations

import math
import os
import statistics
import sys

import torch

from diag_page_order import inputs  # (scripts/ is the path's first entry when run)
from diag_slow_rounds import SMI, parse_cases, timed_round, warm_up
from drafter_attn.kernels import registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import timing
from drafter_attn.tuner.step import DecodeStep

CASES = [("cupy:ws=3,tile_n=32,stages=6,lean=1,early_ids=1,one_trip=1,pair=1", 8, 32768, 128)]
ROUNDS, REPS = int(os.environ.get("ROUNDS", 8)), int(os.environ.get("REPS", 20))
MODES = os.environ.get("MODES", "cold,warm").split(",")


def calls(spec: str, batch: int, ctx: int, page: int) -> dict:
    """The five calls of the module docstring, by name."""
    g = get_preset(MAIN_PRESET).with_(num_layers=1)
    backend = registry.from_spec(spec)
    data = inputs(g, batch, ctx, page)
    q = data["q"]
    qb = g.block_size
    extra = math.ceil((ctx + qb) / page) - math.ceil(ctx / page)
    gen = torch.Generator().manual_seed(batch * 7 + ctx + 1)
    plus = random_paged_context(g, [ctx + qb] * batch, page, "cuda", gen, extra_pages=extra)
    step = DecodeStep(Problem(g, "paged", page, batch, ctx), backend)
    step.attention_only()  # lengths after the store
    lens_ctx = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    kw = dict(mask=g.mask, window=g.window)

    def step_ctx():
        return backend.paged_attention(step.q[0], step.k_blk[0], step.v_blk[0], step.k_cache[0],
                                       step.v_cache[0], step.table, lens_ctx, **kw)

    return {"plain": lambda: backend.paged_attention(*q, *data["shuffled"], **kw),
            "plus_qb": lambda: backend.paged_attention(*q, *plus, **kw),
            "step": step.attention_only,
            "step_ctx": step_ctx,
            "arena": lambda: backend.arena_attention(*q, *data["arena"], **kw)}


def main() -> int:
    for spec, batch, ctx, page in parse_cases(sys.argv[1:], CASES):
        graphs = {name: timing.capture(fn) for name, fn in calls(spec, batch, ctx, page).items()}
        warm_up(graphs)
        print(f"\n{spec} B={batch} ctx={ctx} page={page}: {ROUNDS} rounds of {REPS} replays, "
              f"medians us (p10/p90); then {SMI}", flush=True)
        meds = {(name, mode): [] for mode in MODES for name in graphs}
        for r in range(ROUNDS):
            for mode in MODES:
                got = timed_round(graphs, REPS, f"{r:3d} {mode}", cold_l2=mode == "cold")
                for name, t in got.items():
                    meds[name, mode].append(t.median_us)
        for (name, mode), m in meds.items():
            print(f"{name:9} {mode}: fastest {min(m):.1f}, median of rounds {statistics.median(m):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
