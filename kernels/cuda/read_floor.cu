// The read floor: the fastest this GPU reads a given number of bytes from HBM, so that a kernel's
// time can be set against what moving its bytes alone costs, measured the same way (graph replay,
// cold L2). Two ways to stream the same buffer; the floor is the faster of the two.
//
//  read_floor_bulk (sm_90 and up): one thread per CTA keeps STAGES bulk copies (cp.async.bulk,
//      the TMA engine) of CHUNK bytes in flight into shared memory; with two CTAs per SM that is
//      2 * STAGES * CHUNK bytes in flight per SM, deep enough to saturate HBM (about 64 KB per
//      SM is needed on an H200).
//  read_floor_ld (any SM): every thread issues UNROLL independent 16-byte loads per iteration.
//
// Neither writes anything but a sink word that real data never triggers, so the traffic is reads.

#ifndef STAGES
#define STAGES 4
#endif
#ifndef CHUNK
#define CHUNK 16384
#endif
#ifndef UNROLL
#define UNROLL 4
#endif

typedef unsigned long long u64;

extern "C" __global__ void read_floor_ld(const uint4* __restrict__ src, u64 n16, unsigned* sink) {
    unsigned acc = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (UNROLL - 1) * stride < n16; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) {
        uint4 v = __ldcs(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads; random data never matches
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n .reg .pred done;\n"
        "WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
#endif

extern "C" __global__ void __launch_bounds__(32) read_floor_bulk(const char* __restrict__ src, u64 nbytes,
                                                                 unsigned* sink) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) char ring[];  // STAGES x CHUNK
    __shared__ __align__(8) u64 bars[STAGES];
    if (threadIdx.x != 0) return;  // one thread drives the copy engine
    for (int s = 0; s < STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");

    const u64 chunks = (nbytes + CHUNK - 1) / CHUNK;
    unsigned j = 0;  // copies this CTA has issued
    for (u64 k = blockIdx.x; k < chunks; k += gridDim.x, ++j) {
        const unsigned s = j % STAGES;
        const unsigned bar = smem_addr(&bars[s]);
        if (j >= STAGES) bar_wait(bar, ((j / STAGES) - 1) & 1);  // stage s free again
        const u64 left = nbytes - k * CHUNK;
        const unsigned bytes = left < CHUNK ? (unsigned)left : CHUNK;  // multiple of 16 (host)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_addr(ring + s * CHUNK)),
            "l"(src + k * CHUNK), "r"(bytes), "r"(bar)
            : "memory");
    }
    // Drain: the last use of each stage must land before the CTA exits.
    for (unsigned s = 0; s < STAGES && s < j; ++s) {
        const unsigned uses = (j - s + STAGES - 1) / STAGES;  // copies stage s received
        bar_wait(smem_addr(&bars[s]), (uses - 1) & 1);
    }
    if (j && *reinterpret_cast<const unsigned*>(ring) == 0x9e3779b9u) *sink = 1;
#endif
}
