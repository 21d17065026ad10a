"""Does the order in which the attention's CTAs read their bytes cost bandwidth? The read floor
(kernels/cuda/read_floor.cu) deals 16 KB chunks round-robin over its CTAs, so at any moment the
whole GPU reads one narrow window of the buffer. A split attention kernel does not: CTA (item,
split) streams its own contiguous share of one (request, KV head)'s context, K and V from two
pools, and a paged pool scatters those slices. At 128k-512k the kernels' loads alone sit 4-9%
above the floor (results/perf-notes.md); this times the floor's own copy loop in the kernels'
read orders, same bytes, same bytes in flight, so that the order's share of that gap is measured
rather than guessed.

    python scripts/diag_floor_pattern.py [--rounds 3] [--reps 30]     (an sm_90 GPU)

Orders (each a CTA's j-th 16 KB copy; G CTAs, `items` x `splits` of them):
  interleaved   chunk b + j*G: the read floor's order
  partitioned   CTA b's own contiguous range: a split's share of one stream
  split K/V     partitioned, the range's chunks alternating between two halves (the K and V pools)
  scattered     split K/V with each chunk at a pseudo-random place (a shuffled page pool)
  strided       split K/V, split s of an item taking the item's chunks s, s+S, s+2S, ...
  strided+scat  strided with the chunks scattered
"""
from __future__ import annotations

import argparse
import ctypes
import math
import statistics

import torch

from drafter_attn.kernels.launch import Launch
from drafter_attn.tuner import floors, timing

CHUNK = 16384
SRC = r"""
typedef unsigned long long u64;
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\nW_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra W_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// The j-th chunk CTA b copies, or ~0 past its share. With kv the buffer is two pools (K and V)
// of n/2 tiles and copies alternate K, V of one tile; order picks the tiles: 0 interleaved over
// all CTAs, 1 a contiguous range a CTA, 2 split s of its item taking the item's tiles s, s+S, ...;
// mult > 1 scatters tile t to (t * mult) % tiles (odd, coprime: a permutation).
__device__ __forceinline__ u64 chunk_of(u64 j, u64 b, u64 G, u64 n, int order, int kv, u64 splits, u64 mult) {
    const u64 jj = kv ? j >> 1 : j, tiles = kv ? n / 2 : n;
    u64 t;
    if (order == 0) {
        t = b + jj * G;
        if (t >= tiles) return ~0ull;
    } else if (order == 1) {
        const u64 hi = (b + 1) * tiles / G;
        t = b * tiles / G + jj;
        if (t >= hi) return ~0ull;
    } else {
        const u64 items = G / splits, item = b / splits, s = b % splits;
        const u64 hi = (item + 1) * tiles / items;
        t = item * tiles / items + s + jj * splits;
        if (t >= hi) return ~0ull;
    }
    if (mult > 1) t = (t * mult) % tiles;
    return kv ? (j & 1) * tiles + t : t;
}
extern "C" __global__ void __launch_bounds__(32) stream_order(const char* __restrict__ src, u64 n,
        int order, int kv, u64 splits, u64 mult, unsigned* sink) {
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) u64 bars[STAGES];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    unsigned j = 0;
    for (;; ++j) {
        const u64 c = chunk_of(j, blockIdx.x, gridDim.x, n, order, kv, splits, mult);
        if (c == ~0ull) break;
        const unsigned s = j % STAGES, bar = smem_addr(&bars[s]);
        if (j >= STAGES) bar_wait(bar, ((j / STAGES) - 1) & 1);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(CHUNK) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(smem_addr(ring + s * CHUNK)), "l"(src + c * CHUNK), "r"(CHUNK), "r"(bar) : "memory");
    }
    for (unsigned s = 0; s < STAGES && s < j; ++s) {
        const unsigned uses = (j - s + STAGES - 1) / STAGES;
        bar_wait(smem_addr(&bars[s]), (uses - 1) & 1);
    }
    if (j && *reinterpret_cast<const unsigned*>(ring) == 0x9e3779b9u) *sink = 1;
}
"""

ORDERS = {  # name: (order, kv, scattered)
    "interleaved": (0, 0, False),
    "partitioned": (1, 0, False),
    "split K/V": (1, 1, False),
    "scattered": (1, 1, True),
    "strided": (2, 1, False),
    "strided+scat": (2, 1, True),
}
# (row, bytes of K and V, items = requests x KV heads, splits, CTAs an SM): the long rows of issue
# 12 as the shipped picks run them (the pipelined kernel: 2 CTAs an SM; the ws kernel at B=1 128k:
# 16 splits, one CTA an SM with twice the stages)
GIB = 1 << 30
ROWS = [
    ("B=1 128k (tma, 33 splits)", GIB // 2, 8, 33, 2),
    ("B=1 128k (ws, 16 splits)", GIB // 2, 8, 16, 1),
    ("B=4 128k (tma, 8 splits)", 2 * GIB, 32, 8, 2),
    ("B=1 512k (tma, 33 splits)", 2 * GIB, 8, 33, 2),
    ("B=4 512k (tma, 8 splits)", 8 * GIB, 32, 8, 2),
]


class Args(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("n", ctypes.c_uint64), ("order", ctypes.c_int),
                ("kv", ctypes.c_int), ("splits", ctypes.c_uint64), ("mult", ctypes.c_uint64),
                ("sink", ctypes.c_void_p)]


def kernel(stages: int):
    import cupy
    from cuda.bindings import driver

    mod = cupy.RawModule(code=SRC, options=("-std=c++17", f"-DSTAGES={stages}", f"-DCHUNK={CHUNK}"))
    f = mod.get_function("stream_order")
    f.max_dynamic_shared_size_bytes = stages * CHUNK
    return driver.CUfunction(f.kernel.ptr), mod


def coprime_mult(n: int) -> int:
    m = int(n * 0.6180339887) | 1
    while math.gcd(m, n) != 1:
        m += 2
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernels = {s: kernel(s) for s in (4, 8)}
    print(f"{'row':<28} {'order':<13} {'CTAs':>5} {'median us':>10} {'x floor order':>14} {'TB/s':>6}")
    for row, nbytes, items, splits, per_sm in ROWS:
        n = nbytes // CHUNK
        buf = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        ctas = items * splits
        stages = 4 * 2 // per_sm  # 128 KB in flight an SM either way
        func = kernels[stages][0]
        graphs = {}
        for name, (order, kv, scat) in ORDERS.items():
            mult = coprime_mult(n // 2 if kv else n) if scat else 1
            launch = Launch(func, (ctas, 1, 1), (32, 1, 1), stages * CHUNK,
                            Args(buf.data_ptr(), n, order, kv, splits, mult, sink.data_ptr()))
            graphs[name] = timing.capture(lambda launch=launch: launch(torch.cuda.current_stream().cuda_stream))
        times = {name: [] for name in graphs}
        for _ in range(args.rounds):
            for name, g in graphs.items():
                times[name].append(timing.time_graph(g, reps=args.reps).median_us)
        floor = floors.read_floor(nbytes).median_us
        print(f"{row:<28} {'read floor':<13} {sms * 2:>5} {floor:>10.1f} {'':>14} {nbytes / floor / 1e6:>6.2f}")
        base = statistics.median(times["interleaved"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{row:<28} {name:<13} {ctas:>5} {med:>10.1f} {med / base:>14.3f} {nbytes / med / 1e6:>6.2f}"
                  f"   rounds {' '.join(f'{t:.1f}' for t in ts)}", flush=True)
        del graphs, buf
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
