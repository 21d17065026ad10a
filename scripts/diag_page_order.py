"""What paging costs, split into addressing and scatter: one layer of the main preset, paged with
the pool's pages handed out in a random order (what every table measures), paged with them in
order (each request's pages adjacent, as an allocator that never frees would lay them out), and
the arena, on the same random values' distribution, timed in interleaved rounds (CUDA-graph
replays, L2 flushed before each).

If the in-order pool runs at the arena's time, what paging costs there is the scatter of the
pages over the pool (DRAM and TLB locality), not the kernel's page-table reads.

    [ROUNDS=3] [SHAPES=8x32768,1x8192] [PAGE=128] python scripts/diag_page_order.py [SPEC ...]
    (on a GPU; default: the two kernels, shapes and page size below)

Each output is first checked against the torch reference (relative error printed).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.tuner import timing

SPECS = sys.argv[1:] or ["cupy:ws=3,tile_n=32,lean=1,stages=6,early_ids=1", "cupy"]
SHAPES = [tuple(int(x) for x in s.split("x")) for s in os.environ["SHAPES"].split(",")] \
    if os.environ.get("SHAPES") else [(1, 32768), (1, 131072), (8, 8192)]
PAGE, REPS = int(os.environ.get("PAGE", 64)), 50
ROUNDS = int(os.environ.get("ROUNDS", 3))  # interleaved rounds per point


def inputs(geometry, batch, ctx, page=PAGE):
    """q, k_blk, v_blk and three contexts of the same random values' distribution (seeded by the
    shape): the pool's pages shuffled, the same pool in order, and the arena."""
    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    shape = (batch, geometry.block_size, geometry.num_q_heads, geometry.head_dim)
    kv_shape = (batch, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
    q, kb, vb = (torch.randn(s, generator=gen).to(geometry.torch_dtype).cuda() for s in (shape, kv_shape, kv_shape))
    lens = [ctx] * batch
    return dict(
        q=(q, kb, vb),
        shuffled=random_paged_context(geometry, lens, page, "cuda", gen, shuffle_pages=True),
        in_order=random_paged_context(geometry, lens, page, "cuda", gen, shuffle_pages=False),
        arena=random_arena_context(geometry, lens, ctx, "cuda", gen))


def layout_calls(backend, data) -> dict:
    """`backend`'s call on each of `inputs`' three contexts, by layout name."""
    q = data["q"]
    return {"shuffled": lambda: backend.paged_attention(*q, *data["shuffled"]),
            "in_order": lambda: backend.paged_attention(*q, *data["in_order"]),
            "arena": lambda: backend.arena_attention(*q, *data["arena"])}


def main() -> None:
    g = get_preset(MAIN_PRESET).with_(num_layers=1)
    print(f"{'spec':<48} {'B':>2} {'ctx':>6}  {'shuffled':>9} {'in order':>9} {'arena':>9}  "
          f"{'shuf/arena':>10} {'order/arena':>11}  rel err (shuffled, in order, arena)", flush=True)
    for batch, ctx in SHAPES:
        data = inputs(g, batch, ctx)
        q = data["q"]
        for spec in SPECS:
            calls = layout_calls(registry.from_spec(spec), data)
            errs = []
            for name, fn in calls.items():
                ref = (reference.paged_attention(*q, *data[name]) if name != "arena"
                       else reference.arena_attention(*q, *data[name]))
                out = fn()
                errs.append(float((out.double() - ref.double()).norm() / ref.double().norm()))
            graphs = {name: timing.capture(fn) for name, fn in calls.items()}
            times = {name: [] for name in calls}
            for _ in range(ROUNDS):
                for name, graph in graphs.items():
                    times[name].append(timing.time_graph(graph, reps=REPS))
            med = {name: statistics.median(t.median_us for t in ts) for name, ts in times.items()}
            print(f"{spec:<48} {batch:>2} {ctx // 1024:>5}k  {med['shuffled']:9.2f} {med['in_order']:9.2f} "
                  f"{med['arena']:9.2f}  {med['shuffled'] / med['arena']:10.4f} {med['in_order'] / med['arena']:11.4f}"
                  f"  {', '.join(f'{e:.1e}' for e in errs)}", flush=True)
            for name, ts in times.items():  # each round's spread: a bimodal call shows here
                print(f"    {name:<9} p10/median/p90 by round: "
                      + "  ".join(f"{t.p10_us:.1f}/{t.median_us:.1f}/{t.p90_us:.1f}" for t in ts), flush=True)
            del graphs
        del data
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
