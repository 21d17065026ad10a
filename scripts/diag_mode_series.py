"""Where a bimodal timing's slow replays lie in time, against the GPU's clocks and power.

Some timings of the long and page-128 rows spread in two modes (p10 at the fast one, the median
4-7% above it) on some leases, for the warp-specialised kernels more often than the pipelined
ones (results/perf-notes.md, "The pair pick's slow mode" and after). This replays one call's
graph SERIES times back to back, each replay between two CUDA events, while nvidia-smi samples
the SM clock, memory clock, power draw and throttle reasons every 20 ms, and writes each replay's
start (ms from the series' start) and time. Cases alternate, so that a slow stretch of one kernel
can be set beside the other's.

Questions it answers: are the slow replays runs (a state that lasts) or scattered; does a run
begin after some time under load (power) or anywhere; and do the samples in it show a lower SM
clock or a throttle reason. Last, for each case, its replays' median time by the SM clock
sampled nearest them: how much the kernel slows as the clock falls. (On the H200 the answer was
the SM clock under the 700 W power limit: perf-notes, "The SM clock under the power limit".)

    [SERIES=400] [PASSES=2] [FLUSH=0] python scripts/diag_mode_series.py [SPEC B CTX PAGE] ...
    (on a GPU; writes series.csv and smi.csv into $OUT or .)
"""
from __future__ import annotations

import bisect
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from diag_slow_rounds import graphs_for, parse_cases, warm_up  # (scripts/ is the path's first entry)
from drafter_attn.tuner import timing

CASES = [("cupy:ws=3,tile_n=32,stages=6,early_ids=1,lean=1", 4, 131072, 64),
         ("cupy", 4, 131072, 64)]
SERIES, PASSES = int(os.environ.get("SERIES", 400)), int(os.environ.get("PASSES", 2))
FLUSH = os.environ.get("FLUSH", "0") == "1"
SMI = "timestamp,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"
SLOW = 1.03  # a replay this far over its series' p10 is a slow one
BIN = 60  # MHz


def series(graph, n: int, flush: bool) -> tuple[float, list[float], list[float]]:
    """(host time at the series' first event, each replay's start in ms from it, its time in
    us): `n` replays back to back (the L2 flushed before each when `flush`), one sync at the end."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    t0 = time.time()
    for s, e in zip(starts, ends):
        if flush:
            timing.flush_l2()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return t0, [starts[0].elapsed_time(s) for s in starts], [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def nearest(samples: list[tuple], t: float) -> tuple:
    """The sample (sorted by its time, first field) taken nearest `t`."""
    i = bisect.bisect_left(samples, (t,))
    return min(samples[max(i - 1, 0):i + 1], key=lambda s: abs(s[0] - t))


def runs(flags: list[bool]) -> list[int]:
    """Lengths of the runs of True in `flags`."""
    out, n = [], 0
    for f in flags:
        if f:
            n += 1
        elif n:
            out.append(n)
            n = 0
    return out + ([n] if n else [])


def report(rows: list[dict], cases: list[tuple], smi_csv: Path) -> None:
    """For each case: nvidia-smi's samples nearest its slow replays against those nearest its
    fast ones, and its median replay time by SM clock."""
    samples = []
    for line in smi_csv.read_text().splitlines():
        parts = [x.strip() for x in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) \
                + float("0." + parts[0].split(".")[1])
            samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except (IndexError, ValueError):
            continue
    samples.sort()
    if not samples:
        print("no nvidia-smi samples")
        return
    for spec, b, ctx, page in cases:
        mine = [r for r in rows if r["spec"] == spec and r["batch"] == b and r["ctx"] == ctx]
        p10 = sorted(r["us"] for r in mine)[len(mine) // 10]
        near = {id(r): nearest(samples, r["wall"]) for r in mine}
        for label, want in (("fast", False), ("slow", True)):
            sel = [near[id(r)] for r in mine if (r["us"] > p10 * SLOW) == want]
            if sel:
                print(f"{spec} B={b} ctx={ctx}: {label} replays {len(sel)}: SM clock median "
                      f"{statistics.median(s[1] for s in sel):.0f} MHz (min {min(s[1] for s in sel):.0f}), "
                      f"memory {statistics.median(s[2] for s in sel):.0f} MHz, power median "
                      f"{statistics.median(s[3] for s in sel):.0f} W (max {max(s[3] for s in sel):.0f}), "
                      f"throttle reasons {sorted({s[4] for s in sel})}", flush=True)
        # the replays' median time by the SM clock sampled nearest them, 60 MHz bins of >= 50
        bins: dict[int, list[float]] = {}
        for r in mine:
            bins.setdefault(int(near[id(r)][1] // BIN) * BIN, []).append(r["us"])
        cells = [f"{mhz}: {statistics.median(us):.1f}" for mhz, us in sorted(bins.items()) if len(us) >= 50]
        print(f"{spec} B={b} ctx={ctx} page={page}, median us by SM clock (MHz): " + ", ".join(cells), flush=True)


def main() -> int:
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    smi_file = open(out / "smi.csv", "w")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=smi_file, stderr=subprocess.DEVNULL)
    cases = parse_cases(sys.argv[1:], CASES)
    built = []
    for spec, b, ctx, page in cases:
        graphs, data = graphs_for(spec, b, ctx, page)
        graph = graphs["shuffled"]
        warm_up({"g": graph})
        built.append((spec, b, ctx, page, graph, data))
    rows = []
    try:
        for p in range(PASSES):
            for spec, b, ctx, page, graph, _ in built:
                t0, at, us = series(graph, SERIES, FLUSH)
                p10 = sorted(us)[len(us) // 10]
                slow = [u > p10 * SLOW for u in us]
                r = runs(slow)
                half = len(us) // 2
                print(f"pass {p} {spec} B={b} ctx={ctx} page={page}: p10 {p10:.1f} median "
                      f"{statistics.median(us):.1f} p90 {sorted(us)[9 * len(us) // 10]:.1f} us; slow "
                      f"{sum(slow)}/{len(us)} (first half {sum(slow[:half])}, second {sum(slow[half:])}); "
                      f"runs of slow replays: {len(r)}, longest {max(r, default=0)}, mean "
                      f"{statistics.mean(r) if r else 0:.1f}", flush=True)
                rows += [dict(passno=p, spec=spec, batch=b, ctx=ctx, page=page, i=i,
                              wall=t0 + a / 1e3, start_ms=a, us=u) for i, (a, u) in enumerate(zip(at, us))]
    finally:
        smi.terminate()
        smi_file.close()
    with open(out / "series.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    report(rows, [c[:4] for c in built], out / "smi.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
