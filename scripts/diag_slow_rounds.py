"""Paged calls over a gigabyte or more run 4-12% slower in some timing rounds than in others,
each round steady within itself (results/perf-notes.md, "Paged calls at page 128 and 128k").
This times one call's graph in many short rounds, interleaving the paged pool (shuffled pages),
the same pages in order and the arena, and reads the GPU's clocks, power, temperature and
throttle reasons after each round (nvidia-smi), so that a slow round can be matched against what
the GPU was doing and against the other layouts' rounds around it.

    [ROUNDS=40] [REPS=20] python scripts/diag_slow_rounds.py [SPEC B CTX PAGE] ...   (on a GPU)

Default cases: the table's B=8 32k page-128 pick (pair) and the B=4 128k page-64 ws pick.
Prints one line a round and case, then a summary: the rounds each layout ran more than 3% over
its fastest round's median. Exits 3 when any layout had a slow round, so that a device run can
check its lease before it measures rows for the profile (scripts/gpu_profile_specs.sh does).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import torch

from diag_page_order import inputs, layout_calls  # (scripts/ is the path's first entry when run)
from drafter_attn.kernels import registry
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.tuner import timing

CASES = [("cupy:ws=3,tile_n=32,stages=6,early_ids=1,one_trip=1,pair=1", 8, 32768, 128),
         ("cupy:ws=3,tile_n=32,stages=6,early_ids=1,lean=1", 4, 131072, 64)]
ROUNDS, REPS = int(os.environ.get("ROUNDS", 40)), int(os.environ.get("REPS", 20))
SMI = "clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"
SLOW = 1.03  # a round this far over the layout's fastest round is a slow one


def slow_rounds(medians: list[float], slack: float = SLOW) -> list[int]:
    """The rounds whose median lies more than `slack` over the fastest round's."""
    fast = min(medians)
    return [i for i, m in enumerate(medians) if m > fast * slack]


def gpu_state() -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={SMI}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"n/a ({e})"


def parse_cases(args: list[str], default: list[tuple]) -> list[tuple[str, int, int, int]]:
    """SPEC B CTX PAGE ... from the command line, or `default` without arguments."""
    return [(args[i], int(args[i + 1]), int(args[i + 2]), int(args[i + 3]))
            for i in range(0, len(args), 4)] if args else default


def warm_up(graphs: dict) -> None:
    """Replay each graph ten times: compiled, loaded, clocks up."""
    for g in graphs.values():
        for _ in range(10):
            g.replay()


def timed_round(graphs: dict, reps: int, label: str, cold_l2: bool = True) -> dict:
    """One round: each graph's `reps` replays timed alone (the L2 flushed before each when
    `cold_l2`), printed on one line after `label` with the GPU's state after the round;
    {name: Timing}."""
    got = {name: timing._each_timed(g.replay, reps, cold_l2=cold_l2) for name, g in graphs.items()}
    print(f"{label} " + "  ".join(f"{n} {t.median_us:7.1f} ({t.p10_us:.1f}/{t.p90_us:.1f})"
                                  for n, t in got.items()) + f"  | {gpu_state()}", flush=True)
    return got


def graphs_for(spec: str, batch: int, ctx: int, page: int):
    """The call of `spec` on diag_page_order's three contexts, captured (and those inputs)."""
    data = inputs(get_preset(MAIN_PRESET).with_(num_layers=1), batch, ctx, page)
    calls = layout_calls(registry.from_spec(spec), data)
    return {name: timing.capture(fn) for name, fn in calls.items()}, data


def main() -> int:
    any_slow = False
    for spec, batch, ctx, page in parse_cases(sys.argv[1:], CASES):
        graphs, data = graphs_for(spec, batch, ctx, page)
        warm_up(graphs)
        print(f"\n{spec} B={batch} ctx={ctx} page={page}: {ROUNDS} rounds of {REPS} replays, "
              f"medians us (p10/p90); then {SMI}", flush=True)
        rounds = [timed_round(graphs, REPS, f"{r:3d}") for r in range(ROUNDS)]
        for name in graphs:
            meds = [got[name].median_us for got in rounds]
            slow = slow_rounds(meds)
            any_slow = any_slow or bool(slow)
            print(f"{name:9} fastest {min(meds):.1f}, median of rounds {statistics.median(meds):.1f}, "
                  f"slow rounds ({len(slow)}/{ROUNDS}): {slow}", flush=True)
        del graphs, data
        torch.cuda.empty_cache()
    return 3 if any_slow else 0  # (1 is an uncaught exception's)


if __name__ == "__main__":
    raise SystemExit(main())
