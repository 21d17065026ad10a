"""Does the host's enqueue leak into the timed replays? Each case's graph timed as tuner.timing
times it (an L2 flush, a start event, the replay, an end event, per replay, one sync at the end),
once as is and once behind a GPU-side sleep that lets the host queue every replay before the GPU
reaches the first, interleaved over rounds. If the host enqueues a replay more slowly than the
GPU runs the flush and the replay before it, the GPU records the start event and then waits for
the replay's launch, inside the timed interval.

    python scripts/diag_lead.py [--rounds 3] [--reps 100]
"""
import argparse
import statistics
import time

import torch

from drafter_attn.kernels import registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import get_preset
from drafter_attn.tuner import floors, timing

PICKS = {  # the shipped sm90 table's picks at page 64 (session 24)
    (1, 2048): "combine=2,early_ids=1,lean=1,one_trip=1,q_step=1,stages=9,tile_n=32,ws=3",
    (1, 8192): "combine=2,lean=1,one_trip=1,stages=9,tile_n=32,ws=3",
    (1, 32768): "combine=2,early_ids=1,lean=1,one_trip=1,q_step=1,stages=6,tile_n=32,ws=3",
    (8, 8192): "early_ids=1,lean=1,one_trip=1,stages=6,tile_n=32,ws=3",
}


def timed(graph, reps: int, lead_us: float) -> tuple[timing.Timing, float]:
    """tuner.timing's loop over `graph`, behind a GPU sleep of `lead_us` (0: none); also the
    host's enqueue time a replay."""
    torch.cuda.synchronize()
    if lead_us:
        torch.cuda._sleep(int(lead_us * 1980))  # cycles at the H200's 1980 MHz
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    t0 = time.perf_counter()
    for start, end in zip(starts, ends):
        timing.flush_l2()
        start.record()
        graph.replay()
        end.record()
    host_us = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    return timing.summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]), host_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=100)
    args = ap.parse_args()
    g = get_preset("qwen3-8b-dflash-b16")
    graphs, keep = {}, []
    x = torch.zeros(1, device="cuda")
    graphs["empty graph"] = timing.capture(lambda: x.add_(0))
    for nbytes in (8_388_608, 33_554_432):
        ways, k = floors.streaming_reads(nbytes)
        keep.append(k)
        graphs[f"floor bulk {nbytes >> 20} MB"] = timing.capture(dict(ways)["bulk"])
    for (b, ctx), spec in PICKS.items():
        cache = random_paged_context(g, [ctx] * b, 64, "cuda", torch.Generator().manual_seed(0))
        q = torch.randn(b, 16, 32, 128, device="cuda", dtype=torch.bfloat16)
        kb = torch.randn(b, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        vb = torch.randn_like(kb)
        keep.append((cache, q, kb, vb))
        impl = registry.from_spec(f"cupy:{spec}")
        graphs[f"pick B={b} ctx={ctx}"] = timing.capture(
            lambda impl=impl, q=q, kb=kb, vb=vb, cache=cache: impl.paged_attention(q, kb, vb, *cache))
    rows = {(name, lead): [] for name in graphs for lead in (0, 1)}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            for lead in (0, 1):
                rows[name, lead].append(timed(graph, args.reps, 150.0 * args.reps if lead else 0))
    print(f"{'case':24} {'lead':>5} {'median':>8} {'p10':>8} {'p90':>8} {'host/replay':>12}  (us; "
          f"medians over {args.rounds} rounds of {args.reps} replays)")
    for (name, lead), ts in rows.items():
        med = lambda f: statistics.median(f(t) for t in ts)  # noqa: E731
        print(f"{name:24} {'yes' if lead else 'no':>5} {med(lambda t: t[0].median_us):8.2f} "
              f"{med(lambda t: t[0].p10_us):8.2f} {med(lambda t: t[0].p90_us):8.2f} "
              f"{med(lambda t: t[1]):12.1f}")


if __name__ == "__main__":
    main()
