"""Do the tuned table's picks keep their lead in the clock state a target model leaves?

A drafter layer runs between the target model's forwards. Those hold an H200 at its 700 W power
limit, and the GPU then lowers its SM clock (results/perf-notes.md, "The SM clock under the power
limit"). The small-batch picks do not draw that power themselves, so `--sustain` (the step's own
load) never measured them there. This times each row's shipped pick beside the runners-up its
table entry lists first and the SM's default (pipelined) kernel, the same graphs, with a co-runner's work before every timed replay (outside
the events, then the L2 flush):

  none    nothing (the burst timings the table was built from)
  stream  a decode-time target: 8 matmuls of 64 tokens by 470 MB bf16 weights (about 0.9 ms,
          memory-bound, as verifying a drafted block at small batch is)
  gemm    a compute-bound target: one 8192^3 bf16 matmul (about 1.6 ms; tuner.timing.co_load, what
          `--sustain-load gemm` times under)

and each load also runs for LOAD_S seconds (0.5) before each timing, so that the GPU is in the
state the load holds it in. Rounds interleave loads and kernels; every kernel is checked against
the torch reference first.

    [ROUNDS=3] [REPS=30] [LOADS=none,stream,gemm] python scripts/diag_coload.py [PRESET B CTX PAGE] ...
    (on a GPU; default rows below; the shipped table of this GPU's SM, or $DRAFTER_TUNED_TABLE)
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.shipped import find_default
from drafter_attn.tuner import timing

ROWS = [(MAIN_PRESET, 1, 2048, 64), (MAIN_PRESET, 1, 8192, 64), (MAIN_PRESET, 1, 32768, 64),
        (MAIN_PRESET, 8, 8192, 64), (MAIN_PRESET, 1, 131072, 64), (MAIN_PRESET, 8, 32768, 128),
        ("laguna-dflash", 8, 8192, 64), ("laguna-dflash", 32, 8192, 64)]
ROUNDS, REPS = int(os.environ.get("ROUNDS", 3)), int(os.environ.get("REPS", 30))
LOADS = os.environ.get("LOADS", "none,stream,gemm").split(",")
LOAD_S = float(os.environ.get("LOAD_S", 0.5))
RUNNERS_UP = 1
DEFAULT = "cupy"  # the SM's default kernel, the pipelined one (the table's "default" column)


def co_loads() -> dict:
    """{name: one unit of that co-runner's work} (None: no load)."""
    dev, bf16 = "cuda", torch.bfloat16
    weights = [torch.randn(8192, 28672, device=dev, dtype=bf16) for _ in range(4)]
    x = torch.randn(64, 8192, device=dev, dtype=bf16)

    def stream():
        for _ in range(2):
            for w in weights:
                torch.matmul(x, w)

    return {"none": None, "stream": stream, "gemm": timing.co_load("gemm")}


def entry_for(table: dict, preset: str, batch: int, ctx: int, page: int) -> dict:
    for e in table["entries"]:
        if (e.get("provenance", {}).get("preset") == preset and e["layout"] == "paged"
                and e["page_size"] == page and e["batch"] == batch and e["ctx_len"] == ctx):
            return e
    raise SystemExit(f"no entry for {preset} B={batch} ctx={ctx} page {page} in the table")


def specs_of(entry: dict) -> list[str]:
    """The pick, its first runner-up of the entry (cupy's), and the SM's default kernel: the
    runners-up are mostly the pick's own family, and what the clock may change is which family
    leads."""
    out = [registry.format_spec(entry["impl"], entry["params"])]
    for alt in entry.get("alternatives", []):
        spec = registry.format_spec(alt["impl"], alt["params"])
        if alt["impl"] == "cupy" and spec not in out and len(out) <= RUNNERS_UP:
            out.append(spec)
    return out + [DEFAULT] * (DEFAULT not in out)


def short(spec: str) -> str:
    """A spec without the parameters every pick shares at their defaults (for the columns)."""
    return spec.replace("cupy:", "") or "default"


def precompile(rows, table) -> None:
    """Every kernel the rows load, compiled in parallel first (scripts/precompile_gpu_matrix.py's
    jobs), so that no timing waits on NVRTC."""
    from concurrent.futures import ProcessPoolExecutor

    from precompile_gpu_matrix import _compile, _job  # (scripts/ is the path's first entry when run)
    from drafter_attn.kernels.spec import Problem

    props = torch.cuda.get_device_properties(0)
    sm = props.major * 10 + props.minor
    jobs = {_job(registry.from_spec(spec), Problem(get_preset(preset), "paged", page, batch, ctx), sm)
            for preset, batch, ctx, page in rows for spec in specs_of(entry_for(table, preset, batch, ctx, page))}
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_compile, sorted(j for j in jobs if j is not None)))


def main() -> None:
    args = sys.argv[1:]
    rows = [(args[i], int(args[i + 1]), int(args[i + 2]), int(args[i + 3])) for i in range(0, len(args), 4)] or ROWS
    path = find_default(kinds=("table",))
    table = json.loads(path.read_text())
    precompile(rows, table)
    loads = co_loads()
    print(f"table {path.name}; loads {LOADS}; {ROUNDS} rounds of {REPS} replays; load {LOAD_S:g} s before each timing")
    summary = []
    for preset, batch, ctx, page in rows:
        geom = get_preset(preset).with_(num_layers=1)
        specs = specs_of(entry_for(table, preset, batch, ctx, page))
        gen = torch.Generator().manual_seed(batch * 7 + ctx)
        shape = (batch, geom.block_size, geom.num_q_heads, geom.head_dim)
        kv_shape = (batch, geom.block_size, geom.num_kv_heads, geom.head_dim)
        q, kb, vb = (torch.randn(s, generator=gen).to(geom.torch_dtype).cuda() for s in (shape, kv_shape, kv_shape))
        cache = random_paged_context(geom, [ctx] * batch, page, "cuda", gen)
        kw = dict(mask=geom.mask, window=geom.window)
        ref = reference.paged_attention(q, kb, vb, *cache, **kw).double()
        graphs = {}
        for spec in specs:
            backend = registry.from_spec(spec)
            call = lambda backend=backend: backend.paged_attention(q, kb, vb, *cache, **kw)  # noqa: E731
            err = ((call().double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise SystemExit(f"{spec}: relative error {err:.2e} against the reference")
            graphs[spec] = timing.capture(call)
        del ref
        label = f"{preset.split('-')[0]} B={batch} {ctx // 1024}k p{page}"
        print(f"\n{label}: " + " | ".join(short(s) for s in specs), flush=True)
        got = {(ld, s): [] for ld in LOADS for s in specs}
        clocks = {ld: [] for ld in LOADS}
        for rnd in range(ROUNDS):
            for ld in LOADS:
                for spec, g in graphs.items():
                    if loads[ld] is not None:
                        timing.sustain(loads[ld], LOAD_S)
                    t = timing._each_timed(g.replay, REPS, cold_l2=True, between=loads[ld])
                    got[ld, spec].append(t.median_us)
                    if t.sm_mhz:
                        clocks[ld].append(t.sm_mhz)
                print(f"  round {rnd} {ld:6} " + "  ".join(f"{got[ld, s][-1]:8.2f}" for s in specs)
                      + (f"   {clocks[ld][-1]:.0f} MHz" if clocks[ld] else ""), flush=True)
        for ld in LOADS:
            meds = {s: statistics.median(got[ld, s]) for s in specs}
            best = min(meds, key=meds.get)
            summary.append((label, ld, meds[specs[0]], {s: meds[s] / meds[specs[0]] for s in specs[1:]},
                            statistics.fmean(clocks[ld]) if clocks[ld] else None, best == specs[0], short(best)))
        del graphs
        torch.cuda.empty_cache()
    print("\nrow | load | pick us | runners-up / pick | SM MHz | pick fastest | fastest")
    for label, ld, pick_us, ratios, mhz, kept, best in summary:
        print(f"{label} | {ld} | {pick_us:.2f} | " + ", ".join(f"{r:.3f}" for r in ratios.values())
              + f" | {mhz:.0f}" if mhz else " | -", f"| {'yes' if kept else 'NO'} | {best}")

if __name__ == "__main__":
    main()
