"""Does the SM's shared-memory carveout cost a split call time (issue 11, batch 1)? One layer of a
preset, the whole call (attention kernel, then the split combine) timed as CUDA-graph replays
with the L2 cold, as the attention table times it, with the loaded kernels' preferred carveout:

- default: as the loader leaves it (only the attention kernel's dynamic shared memory is raised);
- max: every loaded kernel prefers the largest carveout (CU_SHAREDMEM_CARVEOUT_MAX_SHARED), so
  an SM that ran the attention kernel runs the combine without reconfiguring its L1 / shared
  split, and the combine leaves it as the next attention kernel needs it.

The two alternate for `--rounds` rounds in one process (each capture made after the attribute
is set). Needs a CUDA GPU.

    python scripts/diag_carveout.py [--shapes 1x2k,1x8k,1x32k,8x8k] [--impl auto] [--page 64]
"""

from __future__ import annotations

import argparse

import torch

from drafter_attn.bench import decode
from drafter_attn.bench.attention_table import AUTO, pick_spec
from drafter_attn.bench.attention_table import shapes as parse_shapes
from diag_timeline import one_layer  # (scripts/ is the path's first entry when run)
from drafter_attn.kernels import cupy_backend
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.tuner import floors, timing

DEFAULT, MAX_SHARED = -1, 100  # CU_SHAREDMEM_CARVEOUT_DEFAULT, CU_SHAREDMEM_CARVEOUT_MAX_SHARED


def set_carveout(value: int) -> int:
    """The preferred carveout of every kernel the cupy backend has loaded; how many were set."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    n = 0
    for mod in list(cupy_backend._loaded.values()):
        for fn in (mod.attention, mod.combine, mod.store):
            (err,) = driver.cuFuncSetAttribute(fn, attr, value)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuFuncSetAttribute: {err!r}")
            n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x2k,1x8k,1x32k,8x8k")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--preset", default=MAIN_PRESET)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print(f"empty graph {floors.empty_graph_us():.2f} us ({torch.cuda.get_device_name()})")
    print("impl | B | ctx | default, us (median of rounds) | max shared | max / default | rounds")
    sm = cupy_backend.device_info(torch.cuda.current_device())[1]
    dispatcher = decode.load_dispatcher(None, sm)[0] if args.impl == AUTO else None
    for batch, ctx in parse_shapes(args.shapes):
        spec = args.impl if dispatcher is None else pick_spec(
            dispatcher, get_preset(args.preset), "paged", args.page, batch, ctx, sm)
        print(f"  {batch}x{ctx}: {spec}")
        _, whole, _ = one_layer(spec, args.preset, batch, ctx, args.page)
        got = {DEFAULT: [], MAX_SHARED: []}
        for _ in range(args.rounds):
            for value in (DEFAULT, MAX_SHARED):
                set_carveout(value)
                got[value].append(timing.time_replays(whole, reps=args.reps).median_us)
        set_carveout(DEFAULT)
        d, m = (sorted(got[v])[len(got[v]) // 2] for v in (DEFAULT, MAX_SHARED))
        rounds = "; ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(got[DEFAULT], got[MAX_SHARED]))
        print(f"{args.impl} | {batch} | {ctx} | {d:.2f} | {m:.2f} | {m / d:.3f} | {rounds}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
