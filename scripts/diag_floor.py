"""Why a read floor sometimes comes out 2-3x high (results/perf-notes.md, "The read floor,
measured more than once"): each way's median per timing, for the byte counts of the main preset's
B=1 rows, each size timed on several fresh buffers.

    python scripts/diag_floor.py [BUFFERS]     (on a GPU; default 3 fresh buffers a size)
"""
from __future__ import annotations

import sys

import torch

from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS
from drafter_attn.tuner import floors, roofline, timing

BUFFERS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def main() -> None:
    geom = PRESETS[MAIN_PRESET].with_(num_layers=1)
    sizes = {f"B=1 {ctx // 1024}k {'page ' + str(page) if page else 'arena'}":
             roofline.call_bytes(geom, 1, ctx, page)
             for ctx in (2048, 8192, 32768) for page in (64, 128, None)}
    print(f"{'size':<22} {'bytes':>10}  buffer  bulk us (3 timings)      ld us (3 timings)       buffer address")
    for name, nbytes in sizes.items():
        for k in range(BUFFERS):
            ways, keep = floors.streaming_reads(nbytes)
            graphs = {w: timing.capture(fn) for w, fn in ways}
            times = {w: [timing.time_graph(g, reps=50).median_us for _ in range(3)] for w, g in graphs.items()}
            addr = keep[0].data_ptr()
            print(f"{name:<22} {nbytes:>10}  {k:>6}  "
                  + "  ".join(" ".join(f"{t:6.2f}" for t in times[w]) for w in ("bulk", "ld") if w in times)
                  + f"   {addr:#x} (mod 2 MiB {addr % (2 << 20):#x})", flush=True)
            del graphs, keep
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
