// SM90 bulk tensor copies (TMA) and the shared-memory barriers they complete on. Only compiled
// for sm_90a with TMA_LOADS=1 (drafter_attention.cu). The host encodes the tensor maps
// (kernels/tma.py) and passes them as __grid_constant__ kernel parameters.
#pragma once
#include "common.cuh"

// A CUtensorMap as the kernel sees it: 128 opaque bytes, 64-byte aligned (<cuda.h> is a host
// header NVRTC does not have).
struct __align__(64) TmaMap {
  unsigned long long bits[16];
};

namespace drafter {

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// the barrier inits visible to the async proxy (the TMA unit) before any copy completes on them
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// one arrival that also expects `bytes` more transaction bytes before the phase completes
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// spin until the phase of parity `parity` has completed (the wait's semantics SEM: none, the
// CTA-scope acquire, or ".acquire.cluster", which also orders what other CTAs of the cluster
// stored before their arrivals or as transaction bytes on it)
#define MBAR_TRY_WAIT(SEM)                                          \
  "{\n.reg .pred p;\nTMA_WAIT:\n"                                   \
  "mbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%0], %1;\n" \
  "@!p bra TMA_WAIT;\n}\n"
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(MBAR_TRY_WAIT("") ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
// box at coordinates {c0, c1, c2, c3} of a 4-D map into shared memory; completes on `bar`.
// Coordinates out of the tensor's bounds (a negative page id) are filled with zeros.
__device__ __forceinline__ void tma_load_4d(void* dst, const TmaMap* map, unsigned long long* bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

}  // namespace drafter
