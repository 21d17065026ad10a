// The split combine inside the attention launch (drafter_attention.cu, CLUSTER_COMBINE): the
// splits of one (request, KV head) run as one thread-block cluster, x = split. Each CTA leaves
// its normalised rows and their log-sum-exp in its own shared memory; after a cluster barrier
// each CTA merges a share of the rows, reading every split's copy through distributed shared
// memory, and stores them. No partial goes to global memory and no second kernel is launched
// (one launch a call: issue 13's host time; the combine kernel's 3-5 us at batch 1: issue 11).
// sm_90 and newer (clusters).
#pragma once
#include "combine_store.cuh"

namespace drafter {

// Row stride of the merge buffer in floats: +8 floats (32 bytes) puts the 8 rows of one
// accumulator store in 4 distinct bank groups, two wavefronts a warp, as the store's 256 bytes
// need anyway.
constexpr int MERGE_ROW = HEAD_DIM + 8;

__device__ __forceinline__ void cluster_barrier() {
  // release: this CTA's buffer writes are visible to the cluster; acquire: theirs to us
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address of the same shared-memory location in CTA `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_addr(unsigned local, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

__device__ __forceinline__ float ld_cluster(unsigned addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

template <int PER>
__device__ __forceinline__ void ld_cluster_vec(float (&v)[PER], unsigned addr);
template <>
__device__ __forceinline__ void ld_cluster_vec<2>(float (&v)[2], unsigned addr) {
  asm volatile("ld.shared::cluster.v2.f32 {%0,%1}, [%2];\n" : "=f"(v[0]), "=f"(v[1]) : "r"(addr)
               : "memory");
}
template <>
__device__ __forceinline__ void ld_cluster_vec<4>(float (&v)[4], unsigned addr) {
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v[0]), "=f"(v[1]), "=f"(v[2]), "=f"(v[3])
               : "r"(addr)
               : "memory");
}

// Rows [M * split / splits, M * (split + 1) / splits) of (request b, KV head kvh): a warp a row,
// lane s < splits reading split s's lse, each lane PER = HEAD_DIM / 32 columns of every split's
// row. `o_buf` / `lse_buf`: this CTA's [rows][MERGE_ROW] and [rows] (the same offsets in every
// CTA of the cluster). Every CTA of the cluster must have passed cluster_barrier() after
// writing its buffer, and must not leave before the others pass the next one.
template <int WARPS>
__device__ __forceinline__ void cluster_merge(const float* o_buf, const float* lse_buf,
                                              elem_t* __restrict__ out, int split, int splits,
                                              int M, int b, int kvh, int qb, int hq, int hkv,
                                              int group, int warp, int lane) {
  constexpr int PER = HEAD_DIM / 32;
  const unsigned o_local = smem_addr(o_buf), l_local = smem_addr(lse_buf);
  const long long row_base = (static_cast<long long>(b) * hkv + kvh) * M;
  const int lo = M * split / splits, hi = M * (split + 1) / splits;
  for (int r = lo + warp; r < hi; r += WARPS) {
    const float lse = lane < splits ? ld_cluster(cluster_addr(l_local + 4 * r, lane)) : -INFINITY;
    float lmax = lse;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffff, lmax, o));
    const float w = lse > -INFINITY ? exp2f(lse - lmax) : 0.f;  // 0 for a split that saw no key
    float wsum = w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wsum += __shfl_xor_sync(0xffffffff, wsum, o);
    float acc[PER] = {};
    const unsigned col = o_local + 4 * (r * MERGE_ROW + lane * PER);
    for (int s = 0; s < splits; ++s) {
      const float ws = __shfl_sync(0xffffffff, w, s);
      if (ws == 0.f) continue;  // the same in every lane
      float v[PER];
      ld_cluster_vec<PER>(v, cluster_addr(col, s));
#pragma unroll
      for (int e = 0; e < PER; ++e) acc[e] += ws * v[e];
    }
    store_row<PER>(out, acc, wsum, row_base + r, M, qb, hq, hkv, group, lane);
  }
}

}  // namespace drafter
