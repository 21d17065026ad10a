"""Where the host time of one eager attention call goes (B=1, ctx 2k, main preset), on a GPU.

    python scripts/host_profile.py [CALLS [SPEC]]  (default 200 calls a round, 30 rounds; SPEC a
                                                    registry spec, default cupy)

Each round first queues a spin kernel (`torch.cuda._sleep`) long enough to outlast the round, then
times CALLS calls: the launches only queue behind it, so the figure is the host's own cost and
cannot be the GPU's (a round whose stream went idle before its last call is reported, not used).
Rows: the whole call (backend with checks on and off, without the fast path of kernels.guards,
under torch.inference_mode, FlashInfer's planned `wrapper.run()` (the baseline's host cost on the
same host), `Runtime`, the custom op), then its parts on a planned shape: the plan key, the fast path's
tensor check, the output allocation, the stream lookup, the call's kernels as one graph launch
(kernels.launch, what a call does) and one kernel launched alone.
Medians over rounds, us per call; the spread is the rounds' p10-p90. Every row is timed in every
round (interleaved), so the rows compare within one run even when the host's speed drifts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time

import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import baselines, launch, native, ops, registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.dispatch import Runtime
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
SPEC = sys.argv[2] if len(sys.argv) > 2 else "cupy"
ROUNDS = 30
SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's clock: far longer than any round


def host_us(rows) -> list[tuple[str, float, float, float, int]]:
    """(name, median, p10, p90 us per call, rounds that went idle) of each row (name, fn,
    checks[, mode]: a context manager factory entered around each round), timed with the GPU
    busy. The rows' rounds are interleaved (round r times every
    row, in an order rotated by r), so a drift of the host's speed during the run moves every
    row alike."""
    stream = torch.cuda.current_stream()
    rows = [(*row, contextlib.nullcontext)[:4] for row in rows]
    times = {name: [] for name, *_ in rows}
    idle = dict.fromkeys(times, 0)
    for name, fn, checks, mode in rows:  # plans, modules and graphs made before any timing
        cb.CHECKS = checks
        with mode():
            fn()
    torch.cuda.synchronize()
    for r in range(ROUNDS + 2):
        for name, fn, checks, mode in rows[r % len(rows):] + rows[:r % len(rows)]:
            cb.CHECKS = checks
            torch.cuda._sleep(SLEEP_CYCLES)
            with mode():
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                dt = time.perf_counter() - t0
            if stream.query():  # the spin kernel and every launch finished: not host-bound
                idle[name] += 1
            elif r >= 2:
                times[name].append(dt / CALLS * 1e6)
            torch.cuda.synchronize()
    cb.CHECKS = True
    result = []
    for name, *_ in rows:
        t = sorted(times[name])
        if not t:
            result.append((name, float("nan"), float("nan"), float("nan"), idle[name]))
            continue
        q = statistics.quantiles(t, n=10) if len(t) > 1 else [t[0]] * 9
        result.append((name, statistics.median(t), q[0], q[-1], idle[name]))
    return result


def main() -> None:
    g = PRESETS[MAIN_PRESET]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, g.block_size, g.num_q_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    kb = torch.randn(1, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    args = (q, kb, torch.randn_like(kb), *random_paged_context(g, [2048], 64, "cuda", gen))
    out = torch.empty_like(q)
    rows = []  # (name, fn, checks)

    def fresh():
        return dataclasses.replace(registry.from_spec(SPEC))  # plans of its own

    on, off = fresh(), fresh()  # keyed with checks on / off
    rows += [("backend call, checks on", lambda: on.paged_attention(*args), True),
             ("backend call, checks on, out=", lambda: on.paged_attention(*args, out=out), True),
             ("backend call, checks off", lambda: off.paged_attention(*args), False),
             ("backend call, checks off, out=", lambda: off.paged_attention(*args, out=out), False)]
    # q and out from 4 buffers in turn: every call's pointers differ from the last (an engine
    # that allocates them per step), so the graph's nodes are set again each call
    qs, outs, turn = [q.clone() for _ in range(4)], [torch.empty_like(q) for _ in range(4)], [0]

    def rotating():
        turn[0] = i = (turn[0] + 1) % 4
        on.paged_attention(qs[i], *args[1:], out=outs[i])

    rows.append(("backend call, checks on, out=, 4 q/out", rotating, True))
    # the same call with its kernels launched one by one (the path before kernels.launch's
    # graphs, and the one inside a capture): the same-run comparison
    real_api, launch.graph_api = launch.graph_api, lambda: None
    one_by_one = fresh()
    one_by_one.paged_attention(*args)  # its plan's LaunchGraph keeps no_graph from here on
    launch.graph_api = real_api
    assert next(iter(one_by_one._plans.values())).launches.no_graph
    rows.append(("backend call, checks on, one by one", lambda: one_by_one.paged_attention(*args),
                 True))
    # the same call with the Python tail of kernels.launch instead of the C runner
    python_tail = fresh()
    python_tail.paged_attention(*args)
    for p in python_tail._plans.values():
        p.launches.runners.clear()
        p.launches.layout = None
    rows.append(("backend call, checks on, Python tail", lambda: python_tail.paged_attention(*args),
                 True))
    # the same call without the fast path (kernels.guards): every call builds the plan key
    keyed = fresh()
    keyed._recent.enabled = False
    rows.append(("backend call, checks on, key path", lambda: keyed.paged_attention(*args), True))
    # Engines serve under torch.inference_mode (tensors without autograd bookkeeping): the same
    # call there, on tensors made there
    with torch.inference_mode():
        inf_args = tuple(t.clone() for t in args)
    inference = fresh()
    rows.append(("backend call, checks on, inference_mode",
                 lambda: inference.paged_attention(*inf_args), True, torch.inference_mode))
    # the baseline's per-call host cost on this host: FlashInfer's planned wrapper.run()
    if baselines.reason(baselines.FA2, g, 64) is None:
        fi = baselines.build(baselines.FA2, g, 64, [2048], "cuda")
        rows.append(("FlashInfer fa2 wrapper.run()", fi.run, True))
    rt = Runtime()
    rows += [("Runtime call", lambda: rt.paged_attention(*args), True),
             ("ops.paged_attention (eager: no op)",
              lambda: ops.paged_attention(*args, backend=SPEC), True),
             ("custom op (torch.ops.drafter_attn)",
              lambda: torch.ops.drafter_attn.paged_attention(*args, backend=SPEC), True)]

    on.paged_attention(*args)
    plan = next(iter(on._plans.values()))  # the plan of the call without out=
    key_args, extra = (*args, None), ("full", None, None)
    stream = cb._stream(0)
    part = plan.workspaces[stream].data_ptr() if plan.combine is not None else 0
    rows += [("  part: plan key (checks on)", lambda: cb.call_key("paged", key_args, extra), True),
             ("  part: fast path (tensor check)",
              lambda: on._recent.get(("paged", "full", None, None, None, True), args), True),
             ("  part: torch.empty_like(q)", lambda: torch.empty_like(q), True),
             ("  part: current stream handle", lambda: cb._stream(0), True),
             ("  part: plan.run, out given", lambda: plan.run(*args, out), True),
             ("  part: the call's kernels as one graph", lambda: plan.launches(stream, False), True),
             ("  part: the same through the C runner",
              lambda: plan.launches.runners[stream](stream, *args, out, part, part + 4 * plan.part_elems),
              True),
             ("  part: one attention launch", lambda: plan.attention(stream), True)]
    if plan.combine is not None:
        rows.append(("  part: one combine launch", lambda: plan.combine(stream), True))
    rows = host_us(rows)

    print(f"host time per call, us ({SPEC}; B=1 ctx 2k, main preset, page 64, splits {plan.splits}; "
          f"{CALLS} calls x {ROUNDS} rounds behind a spin kernel; C runner: "
          f"{native.unavailable() or 'on'})")
    print(f"{'what':40s} {'median':>8s} {'p10':>7s} {'p90':>7s}  idle rounds")
    for name, med, p10, p90, idle in rows:
        print(f"{name:40s} {med:8.2f} {p10:7.2f} {p90:7.2f}  {idle}")


if __name__ == "__main__":
    main()
