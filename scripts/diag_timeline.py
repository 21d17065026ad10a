"""Where a split attention call's time goes, CTA by CTA (issue 11, small batch): one layer of a
preset run as the runtime runs it (a CUDA graph of the warp-specialised attention kernel and the
split combine, the L2 cold), with both kernels built with TRACE=1 (kernels/cuda/trace.cuh), so
that every CTA records the GPU's %globaltimer when it reaches each step:

    entry -> the context length in hand, Q's copies issued, past the first barrier
      -> page ids in hand (the producer) -> Q landed, first tile landed (consumer 0)
      -> tile loop done (consumer 0; the last consumer) -> output or partial stored
      -> the combine's CTAs: entry, stored

Times are from the first attention CTA's entry, medians over `--samples` replays (each figure
itself a median or the maximum over the CTAs, as named). `whole` is the event-timed replay as the
attention table measures it (untraced kernels, then the traced ones); `whole - span` is what the
graph's launch costs around the kernels' device time. Needs a CUDA GPU; `--impl auto` takes the
shipped table's pick (a warp-specialised one: the only kernel the trace is built into).

    python scripts/diag_timeline.py [--shapes 1x2k,1x8k,1x32k,8x8k] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from drafter_attn.bench import decode
from drafter_attn.bench.attention_table import AUTO, pick_spec
from drafter_attn.bench.attention_table import shapes as parse_shapes
from drafter_attn.kernels import cupy_backend, registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.tuner import floors, timing

ROWS, SLOTS, SM, CLOCK = 4096, 32, 15, 16  # trace.cuh's TRACE_ROWS, TRACE_SLOTS, the SM's slot, clocks'
(ENTRY, IDS, ISSUED, Q, FIRST, LOOP, STORED, LAST_LOOP, LOOP1, MERGE_IN, MERGED, LEN, SYNCED,
 Q_ISSUED) = range(14)
LSE_MAX = 8  # the combine's


def one_layer(spec: str, preset: str, batch: int, ctx: int, page: int):
    """(backend, whole, out): one layer of `preset` on random paged inputs (seeded by the shape),
    `whole()` its attention call as a decode step makes it, run once eagerly (compiled, loaded,
    planned). scripts/diag_split_parts.py and diag_carveout.py build their calls here too."""
    g = get_preset(preset)
    gen = torch.Generator().manual_seed(batch * 100003 + ctx)
    cache = random_paged_context(g, [ctx] * batch, page, "cuda", gen)
    q = torch.randn(batch, g.block_size, g.num_q_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    kb = torch.randn(batch, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    vb = torch.randn_like(kb)
    out = torch.empty_like(q)
    impl = registry.from_spec(spec)

    def whole():
        impl.paged_attention(q, kb, vb, *cache, mask=g.mask, window=g.window, out=out)

    whole()
    torch.cuda.synchronize()
    return impl, whole, out


def trace_call(impl, index: int, **extra):
    """Swap the module the call's last plan launches, if it is a warp-specialised variant, for its
    TRACE=1 build (with `extra` defines), and drop the plans so that the next call launches it;
    the traced module, or None. Only that module: one a process loaded for another shape keeps
    its own build."""
    plan = list(impl._plans.values())[-1]
    for key, mod in list(cupy_backend._loaded.items()):
        if key[1] != index or int(mod.attention) != int(plan.attention.func):
            continue
        defines = dict(key[2])  # the untraced variant's (its key stays the runtime's)
        if not defines.get("WARP_SPEC"):
            return None
        res = cupy_backend.compile_variant({**defines, "TRACE": 1, **extra},
                                           cupy_backend.device_info(index)[1])
        traced = cupy_backend.load_cubin(index, res.cubin_path, cupy_backend.module_smem(defines),
                                         mod.threads)
        cupy_backend._loaded[key] = traced
        impl.clear_plans()
        return traced
    return None


def buffers(mod):
    import cupy

    return [cupy.ndarray((ROWS, SLOTS), cupy.uint64, mod.owner.get_global(name))
            for name in ("drafter_trace", "drafter_trace_combine")]


def sample(graph, bufs) -> tuple[np.ndarray, np.ndarray]:
    for b in bufs:
        b.fill(0)
    torch.cuda.synchronize()
    timing.flush_l2()
    graph.replay()
    torch.cuda.synchronize()
    attn, comb = (b.get() for b in bufs)
    return attn[attn[:, ENTRY] > 0], comb[comb[:, ENTRY] > 0]


def figures(attn: np.ndarray, comb: np.ndarray) -> dict:
    """One replay's step times (us from the first attention CTA's entry)."""
    t0 = int(attn[:, ENTRY].min())

    def us(col, rows=attn):
        vals = rows[:, col].astype(np.int64)
        vals = vals[vals > 0]
        return (vals - t0) / 1e3

    f = {"ctas": len(attn), "sms": len(np.unique(attn[:, SM])),
         "entry_max": us(ENTRY).max()}
    for name, col in (("len", LEN), ("q_issued", Q_ISSUED), ("synced", SYNCED), ("ids", IDS),
                      ("issued", ISSUED), ("q", Q), ("first_tile", FIRST), ("loop", LOOP),
                      ("loop1", LOOP1), ("last_loop", LAST_LOOP), ("merge_in", MERGE_IN),
                      ("merged", MERGED), ("stored", STORED)):
        v = us(col)
        if len(v):
            f[name + "_med"], f[name + "_max"] = float(np.median(v)), float(v.max())
    if len(comb):
        f["combine_ctas"] = len(comb)
        f["combine_start"] = float(us(ENTRY, comb).min())
        f["combine_entry_max"] = float(us(ENTRY, comb).max())
        f["combine_lse_med"] = float(np.median(us(LSE_MAX, comb)))
        f["combine_end"] = float(us(STORED, comb).max())
    f["span"] = f.get("combine_end", f.get("stored_max", 0.0))
    # the timer's step: the smallest non-zero gap between two recorded times
    times = np.unique(np.concatenate([attn[:, :SM].ravel(), comb[:, :SM].ravel()]))
    times = times[times > 0]
    f["timer_step_ns"] = int(np.diff(times).min()) if len(times) > 1 else 0
    # cycles a CTA spends from entry to its first tile and through consumer 0's loop (clock64)
    clk = attn[:, CLOCK:CLOCK + SM].astype(np.int64)
    ok = (clk[:, FIRST] > 0) & (clk[:, LOOP] > 0)
    if ok.any():
        f["cyc_first_tile"] = float(np.median(clk[ok, FIRST] - clk[ok, ENTRY]))
        f["cyc_loop"] = float(np.median(clk[ok, LOOP] - clk[ok, FIRST]))
    ok = (clk[:, STORED] > 0) & (clk[:, LOOP] > 0)
    if ok.any():  # consumer 0: its loop's end to its stores issued, and the parts between
        f["cyc_epilogue"] = float(np.median(clk[ok, STORED] - clk[ok, LOOP]))
        for name, a, b in (("cyc_to_merge", LOOP, MERGE_IN), ("cyc_merge", MERGE_IN, MERGED),
                           ("cyc_store", MERGED, STORED)):
            both = ok & (clk[:, a] > 0) & (clk[:, b] > 0)
            if both.any():
                f[name] = float(np.median(clk[both, b] - clk[both, a]))
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x2k,1x8k,1x32k,8x8k")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--impl", default=AUTO)
    ap.add_argument("--preset", default=MAIN_PRESET)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--probe", action="append", default=[], metavar="DEFINE",
                    help="also a traced build with this define set to 1 (A,B: each of them): a "
                         "probe added to the kernel behind `#if TRACE && DEFINE` "
                         "(docs/experiments/trace-probes.patch has two), or a knob's define; "
                         "repeatable")
    ap.add_argument("--out", type=Path, help="folder for timeline.json.gz (every replay's figures, "
                    "and the last replay's raw rows)")
    args = ap.parse_args(argv)
    index = torch.cuda.current_device()
    sm = cupy_backend.device_info(index)[1]
    dispatcher = decode.load_dispatcher(None, sm)[0] if args.impl == AUTO else None
    empty = floors.empty_graph_us()
    print(f"empty graph {empty:.2f} us ({torch.cuda.get_device_name()})")
    cols = ("whole", "span", "entry_max", "len_med", "q_issued_med", "synced_med", "ids_med", "q_med",
            "first_tile_med", "first_tile_max", "loop_med", "loop_max", "last_loop_max", "merge_in_med", "merged_med",
            "stored_med", "stored_max", "combine_start", "combine_lse_med", "combine_end")
    cycles = ("cyc_first_tile", "cyc_loop", "cyc_epilogue", "cyc_to_merge", "cyc_merge", "cyc_store")
    print("B | ctx | build | CTAs | " + " | ".join(cols) + " | timer step ns | " + " | ".join(cycles))
    dump = {}
    builds = {"traced": {}, **{f"traced+{p}": dict.fromkeys(p.split(","), 1) for p in args.probe}}
    for batch, ctx in parse_shapes(args.shapes):
        spec = args.impl if dispatcher is None else pick_spec(
            dispatcher, get_preset(args.preset), "paged", args.page, batch, ctx, sm)
        impl, whole, out = one_layer(spec, args.preset, batch, ctx, args.page)
        plain = timing.time_replays(whole, reps=args.reps).median_us
        reference = out.clone()
        print(f"  {batch}x{ctx} {spec}: {plain:.2f} us untraced")
        for build, extra in builds.items():
            traced = trace_call(impl, index, **extra)
            if traced is None:
                print(f"{batch} | {ctx} | {spec}: not a warp-specialised kernel, nothing traced")
                break
            out.fill_(float("nan"))
            whole()
            torch.cuda.synchronize()
            # the traced build computes what the plain one did (the trace only stores beside it)
            err = (out.float() - reference.float()).abs().max().item()
            graph = timing.capture(whole)
            traced_us = timing.time_graph(graph, reps=args.reps).median_us
            bufs = buffers(traced)
            raw = [sample(graph, bufs) for _ in range(args.samples)]
            rows = [figures(*r) for r in raw]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
                   if all(k in r for r in rows)}
            med.update(whole=traced_us, untraced=plain)
            dump[f"{batch}x{ctx} {build}"] = dict(
                spec=spec, max_abs_diff_traced=err, median=med, samples=rows,
                last_raw=dict(attention=raw[-1][0].tolist(), combine=raw[-1][1][:, :SM + 1].tolist()))
            print(f"{batch} | {ctx} | {build} (max abs diff {err:.3g}) | {med.get('ctas', 0):.0f} | "
                  + " | ".join(f"{med[c]:.2f}" if c in med else "-" for c in cols)
                  + f" | {med.get('timer_step_ns', 0):.0f} | "
                  + " | ".join(f"{med[c]:.0f}" if c in med else "-" for c in cycles), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with gzip.open(args.out / "timeline.json.gz", "wt") as f:
            json.dump(dict(empty_graph_us=empty, **dump), f, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
