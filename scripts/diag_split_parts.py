"""Where a split attention call's time goes (issue 11, batch 1): one layer of a preset, timed as
CUDA-graph replays four ways, in one process:

- whole: the call as a decode step makes it (the attention kernel, then the split combine), L2
  cold before each replay, as the attention table times it;
- attention: the attention kernel alone (its plan's launch, on the same packed arguments), cold;
- combine: the combine alone, on the partials the attention kernel left, L2 warm (in a step they
  were written just before it);
- empty: a graph of one empty kernel (the timing method's fixed cost, paid once by each graph).

whole - attention - combine + empty is what the two launches cost beyond their kernels' own
time (the gap between them). Needs a CUDA GPU.

    python scripts/diag_split_parts.py [--shapes 1x2k,1x8k,1x32k,8x8k] [--page 64] [--impl cupy]
"""

from __future__ import annotations

import argparse

import torch

from diag_timeline import one_layer  # (scripts/ is the path's first entry when run)
from drafter_attn.bench.attention_table import shapes as parse_shapes
from drafter_attn.kernels.presets import MAIN_PRESET
from drafter_attn.tuner import floors, timing


def parts(spec: str, preset: str, batch: int, ctx: int, page: int, reps: int) -> dict:
    impl, whole, _ = one_layer(spec, preset, batch, ctx, page)
    plan = list(impl._plans.values())[-1]
    row = dict(impl=spec, batch=batch, ctx=ctx, page=page, splits=plan.splits)
    row["whole_us"] = timing.time_replays(whole, reps=reps).median_us
    whole()  # the packed arguments point at this (eager) stream's workspace again

    def stream():
        return torch.cuda.current_stream().cuda_stream

    row["attention_us"] = timing.time_replays(lambda: plan.attention(stream()), reps=reps).median_us
    if plan.combine is not None:
        row["combine_us"] = timing.time_replays(lambda: plan.combine(stream()), reps=reps,
                                                cold_l2=False).median_us
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x2k,1x8k,1x32k,8x8k")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--impl", default="cupy")
    ap.add_argument("--preset", default=MAIN_PRESET)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    empty = floors.empty_graph_us()
    print(f"empty graph {empty:.2f} us ({torch.cuda.get_device_name()})")
    print("impl | B | ctx | splits | whole | attention | combine (warm) | gap = whole - attn - combine + empty")
    for batch, ctx in parse_shapes(args.shapes):
        r = parts(args.impl, args.preset, batch, ctx, args.page, args.reps)
        comb = r.get("combine_us", 0.0)
        gap = r["whole_us"] - r["attention_us"] - comb + (empty if comb else 0.0)
        print(f"{r['impl']} | {batch} | {ctx} | {r['splits']} | {r['whole_us']:.2f} | "
              f"{r['attention_us']:.2f} | {comb:.2f} | {gap:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
