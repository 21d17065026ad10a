"""Where the host time of one eager attention call goes (B=1, ctx 2k, main preset), on a GPU.

    python scripts/host_profile.py [CALLS [SPEC]]  (default 200 calls a round, 30 rounds; SPEC a
                                                    registry spec, default cupy)

Each round first queues a spin kernel (`torch.cuda._sleep`) long enough to outlast the round, then
times CALLS calls: the launches only queue behind it, so the figure is the host's own cost and
cannot be the GPU's (a round whose stream went idle before its last call is reported, not used).
Rows: the whole call (backend with checks on and off, `Runtime`, the custom op), then its parts
on a planned shape: the plan key, the output allocation, the stream lookup, the call's kernels as
one graph launch (kernels.launch, what a call does) and one kernel launched alone.
Medians over rounds, us per call; the spread is the rounds' p10-p90.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import ops, registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.dispatch import Runtime
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
SPEC = sys.argv[2] if len(sys.argv) > 2 else "cupy"
ROUNDS = 30
SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's clock: far longer than any round


def host_us(fn, *args) -> tuple[float, float, float, int]:
    """(median, p10, p90) us per call of fn(*args) with the GPU busy, and rounds that went idle."""
    fn(*args)
    torch.cuda.synchronize()
    times, idle = [], 0
    stream = torch.cuda.current_stream()
    for _ in range(ROUNDS + 2):
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn(*args)
        dt = time.perf_counter() - t0
        if stream.query():  # the spin kernel and every launch finished: not host-bound
            idle += 1
        else:
            times.append(dt / CALLS * 1e6)
        torch.cuda.synchronize()
    times = sorted(times[2:])
    if not times:
        return float("nan"), float("nan"), float("nan"), idle
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return statistics.median(times), q[0], q[-1], idle


def main() -> None:
    g = PRESETS[MAIN_PRESET]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, g.block_size, g.num_q_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    kb = torch.randn(1, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    args = (q, kb, torch.randn_like(kb), *random_paged_context(g, [2048], 64, "cuda", gen))
    out = torch.empty_like(q)
    rows = []

    def row(name, fn, *a):
        rows.append((name, *host_us(fn, *a)))

    for checks in (True, False):
        cb.CHECKS = checks
        backend = dataclasses.replace(registry.from_spec(SPEC))  # own plans, keyed for `checks`
        on = "on" if checks else "off"
        row(f"backend call, checks {on}", backend.paged_attention, *args)
        row(f"backend call, checks {on}, out=", lambda *a: backend.paged_attention(*a, out=out), *args)
    cb.CHECKS = True
    rt = Runtime()
    row("Runtime call", rt.paged_attention, *args)
    row("custom op (torch.ops.drafter_attn)", lambda *a: ops.paged_attention(*a, backend=SPEC), *args)

    backend = dataclasses.replace(registry.from_spec(SPEC))
    backend.paged_attention(*args)
    key_args = (*args, None)
    extra = ("full", None, None)
    (plan,) = backend._plans.values()
    row("  part: plan key (checks on)", lambda: cb.call_key("paged", key_args, extra))
    row("  part: torch.empty_like(q)", lambda: torch.empty_like(q))
    row("  part: current stream handle", lambda: cb._stream(0))
    row("  part: plan.run, out given", lambda: plan.run(*args, out))
    stream = cb._stream(0)
    row("  part: the call's kernels as one graph", lambda: plan.launches(stream, False))
    row("  part: one attention launch", lambda: plan.attention(stream))
    if plan.combine is not None:
        row("  part: one combine launch", lambda: plan.combine(stream))

    print(f"host time per call, us ({SPEC}; B=1 ctx 2k, main preset, page 64, splits {plan.splits}; "
          f"{CALLS} calls x {ROUNDS} rounds behind a spin kernel)")
    print(f"{'what':40s} {'median':>8s} {'p10':>7s} {'p90':>7s}  idle rounds")
    for name, med, p10, p90, idle in rows:
        print(f"{name:40s} {med:8.2f} {p10:7.2f} {p90:7.2f}  {idle}")


if __name__ == "__main__":
    main()
