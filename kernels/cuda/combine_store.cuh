// Cache addressing, the split-KV combine and the context store: shared by drafter_attention.cu
// (cupy backend) and cute_drafter_attention.cu (cutlass backend), so both backends address the
// cache, merge splits and store context rows with the same code.
//
// Needs HEAD_DIM and PAGE_SIZE (defaults as in the attention sources); PAGE_SIZE > 0 selects the
// paged layout ([num_pages, Hkv, PAGE_SIZE, D] through a block table), 0 the dense arena
// ([num_slots, max_ctx, Hkv, D] through a slot id).
#pragma once
#include "common.cuh"
#include "trace.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef PAGE_SIZE
#define PAGE_SIZE 0
#endif

namespace drafter {

// Element offset of row `kp` of KV head `kvh` inside the cache. `loc` is the page id (paged) or
// the slot id (arena). `loc_stride` is the distance between pages in packed pages of
// hkv * PAGE_SIZE * HEAD_DIM elements (1 when packed, 2 for K and V views of one pool
// [pages, 2, hkv, PAGE_SIZE, D]), or between arena slots in token rows of hkv * HEAD_DIM elements
// (max_ctx when packed). In these units the arithmetic is the packed layout's plus one 32-bit
// multiply (a finer stride costs the 9-warp variants registers, and spills on sm_100a/103a).
__device__ __forceinline__ long long cache_offset(int loc, int kvh, int hkv, int kp, int loc_stride) {
#if PAGE_SIZE > 0
  return ((static_cast<long long>(loc * loc_stride) * hkv + kvh) * PAGE_SIZE + (kp & (PAGE_SIZE - 1))) * HEAD_DIM;
#else
  return ((static_cast<long long>(loc) * loc_stride + kp) * hkv + kvh) * HEAD_DIM;
#endif
}

template <int PER> struct VecOf;  // PER floats in one load
template <> struct VecOf<2> { using type = float2; };
template <> struct VecOf<4> { using type = float4; };

// The split combine's per-row steps, shared by its two kernels below (layouts there); `rows` =
// batch * hkv * Qb * G packed rows.

// The largest lse of packed row `row` over its splits, in every lane of the calling warp: the
// lanes read the splits side by side (one round trip, not one per split).
__device__ __forceinline__ float row_lse_max(const float* __restrict__ lse_part, long long rows, long long row,
                                             int num_splits, int lane) {
  float lmax = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) lmax = fmaxf(lmax, lse_part[s * rows + row]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffff, lmax, o));
  return lmax;
}

// acc / wsum (zero for a row no split saw) into this lane's PER columns of packed row
// `row` = (b, kvh, r) of out [B, Qb, Hq, D].
template <int PER>
__device__ __forceinline__ void store_row(elem_t* __restrict__ out, const float (&acc)[PER], float wsum,
                                          long long row, int M, int qb, int hq, int hkv,
                                          int group, int lane) {
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const int r = static_cast<int>(row % M);
  const long long bk = row / M;
  const int kvh = static_cast<int>(bk % hkv), b = static_cast<int>(bk / hkv);
  elem_t* dst = out + ((static_cast<long long>(b) * qb + r / group) * hq + kvh * group + r % group) * HEAD_DIM +
                lane * PER;
#pragma unroll
  for (int e = 0; e < PER; e += 2)
    *reinterpret_cast<unsigned*>(dst + e) = pack2(acc[e] * inv, acc[e + 1] * inv);
}

// acc and wsum of a CTA's OTHERS + 1 warps (one row's splits dealt over them), added in shared
// memory: true in warp 0, which then holds the row's sums; the other warps are done.
template <int OTHERS, int D, int PER>
__device__ __forceinline__ bool sum_over_warps(float (&s_acc)[OTHERS][D], float (&s_wsum)[OTHERS],
                                               float (&acc)[PER], float& wsum, int warp, int lane) {
  if (warp > 0) {
#pragma unroll
    for (int e = 0; e < PER; ++e) s_acc[warp - 1][lane * PER + e] = acc[e];
    if (lane == 0) s_wsum[warp - 1] = wsum;
  }
  __syncthreads();
  if (warp > 0) return false;
#pragma unroll
  for (int w = 0; w < OTHERS; ++w) {
    wsum += s_wsum[w];
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] += s_acc[w][lane * PER + e];
  }
  return true;
}

}  // namespace drafter

#ifndef COMBINE_CTA
#define COMBINE_CTA 0  // 1: the combine below takes a CTA of 4 warps a row (cupy_backend `combine=2`)
#endif
#ifndef COMBINE_ONE_TRIP
#define COMBINE_ONE_TRIP 0  // 1: either combine in one round trip (cupy_backend `one_trip=1`)
#endif

// Merge the splits of drafter_attention: out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max).
// Partial layout [split][b][kvh][r][D], lse [split][b][kvh][r].
#if COMBINE_ONE_TRIP
namespace drafter {

// The first element of this lane's PER columns of packed row `row` = (b, kvh, r) of out
// [B, Qb, Hq, D], in 32-bit divisions (the 64-bit ones are calls), made before the loads land.
template <int PER>
__device__ __forceinline__ elem_t* out_row(elem_t* out, unsigned row, unsigned M, int qb, int hq,
                                           unsigned hkv, unsigned group, int lane) {
  const unsigned r = row % M, bk = row / M;
  const unsigned kvh = bk % hkv, b = bk / hkv;
  return out + ((static_cast<long long>(b) * qb + r / group) * hq + kvh * group + r % group) * HEAD_DIM +
         lane * PER;
}

// acc and wsum over splits first, first + step, ... of packed row `row`, unnormalised, in
// this lane's PER columns. The lanes read the lse values side by side (lane s split s) and, in
// the same round trip, the first CHUNK of this warp's partial rows (splits below 32), whose
// weights need the max only once they have landed: one trip where the plain combines take two
// or three (the max, then the partials). Split s's lse for its weight comes from lane s by a
// shuffle; later chunks read theirs beside their partials. Splits past num_splits weigh 0
// against zero rows (no branch: a shuffle under a branch costs a divergence check). A row no
// split saw (every lse -inf) stays zero.
template <int PER, int CHUNK>
__device__ __forceinline__ void merge_splits(const float* __restrict__ o_part,
                                             const float* __restrict__ lse_part, int rows, int row,
                                             int first, int step, int num_splits, int lane,
                                             float (&acc)[PER], float& wsum) {
  using vec_t = typename VecOf<PER>::type;
  union Part { vec_t v; float f[PER]; };
  auto part = [&](int s) {
    Part x;
    if (s < num_splits) {
      x.v = *reinterpret_cast<const vec_t*>(o_part + (static_cast<long long>(s) * rows + row) * HEAD_DIM + lane * PER);
    } else {
#pragma unroll
      for (int e = 0; e < PER; ++e) x.f[e] = 0.f;
    }
    return x;
  };
  auto lse = [&](int s) { return s < num_splits ? lse_part[static_cast<long long>(s) * rows + row] : -INFINITY; };
  const float lse_l = lse(lane);
  Part x[CHUNK];
#pragma unroll
  for (int c = 0; c < CHUNK; ++c) x[c] = part(first + c * step);
  float lmax = lse_l;
#pragma unroll 1
  for (int s = lane + 32; s < num_splits; s += 32) lmax = fmaxf(lmax, lse(s));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lmax = fmaxf(lmax, __shfl_xor_sync(0xffffffff, lmax, o));
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(8);
#endif
  if (lmax == -INFINITY) return;  // warp-uniform
#pragma unroll
  for (int c = 0; c < CHUNK; ++c) {  // first + c * step < 32 (the callers' CHUNK and step)
    const float w = fast_exp2(__shfl_sync(0xffffffff, lse_l, first + c * step) - lmax);
    wsum += w;
#pragma unroll
    for (int e = 0; e < PER; ++e) acc[e] += w * x[c].f[e];
  }
#pragma unroll 1
  for (int s0 = first + CHUNK * step; s0 < num_splits; s0 += CHUNK * step) {  // past 16 a CTA a row, 4 a warp
    float ls[CHUNK];
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      x[c] = part(s0 + c * step);
      ls[c] = lse(s0 + c * step);
    }
#pragma unroll
    for (int c = 0; c < CHUNK; ++c) {
      const float w = fast_exp2(ls[c] - lmax);
      wsum += w;
#pragma unroll
      for (int e = 0; e < PER; ++e) acc[e] += w * x[c].f[e];
    }
  }
}

}  // namespace drafter

// Either combine below (COMBINE_CTA: a CTA of 4 warps a row, the splits dealt over the warps;
// else a warp a row) with its reads in one round trip (`merge_splits`): the plain combines wait
// for every lse before they ask for a partial. A warp holds 4 partial rows in flight (16 splits
// in one trip a CTA, 4 a warp a row): 44-48 registers, so that 10 CTAs fit an SM. With 16 a
// warp a row took 128 and B=8's 1024 CTAs ran in two waves (H200, 1.4 us slower).
extern "C" __global__ void __launch_bounds__(128)
    drafter_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                    elem_t* __restrict__ out, int batch, int qb, int hq, int hkv,
                    int group, int num_splits) {
  using namespace drafter;
  constexpr int D = HEAD_DIM;
  constexpr int PER = D / 32;  // floats per lane: 4 (D 128) or 2 (D 64)
  static_assert(PER == 2 || PER == 4, "combine: head_dim 64 or 128");
  const int M = qb * group;
  const int rows = batch * hkv * M;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(0);
#endif
#if COMBINE_CTA
  constexpr int WARPS = 4;
  __shared__ float s_acc[WARPS - 1][D];
  __shared__ float s_wsum[WARPS - 1];
  const int row = blockIdx.x;
#else
  const int row = blockIdx.x * 4 + warp;
  if (row >= rows) return;
#endif
  elem_t* dst = out_row<PER>(out, row, M, qb, hq, hkv, group, lane);
  float acc[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) acc[e] = 0.f;
  float wsum = 0.f;
#if COMBINE_CTA
  merge_splits<PER, 4>(o_part, lse_part, rows, row, warp, WARPS, num_splits, lane, acc, wsum);
  if (!sum_over_warps(s_acc, s_wsum, acc, wsum, warp, lane)) return;
#else
  merge_splits<PER, 4>(o_part, lse_part, rows, row, 0, 1, num_splits, lane, acc, wsum);
#endif
  const float inv = wsum > 0.f ? __fdividef(1.f, wsum) : 0.f;
#pragma unroll
  for (int e = 0; e < PER; e += 2)
    *reinterpret_cast<unsigned*>(dst + e) = pack2(acc[e] * inv, acc[e + 1] * inv);
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(6);
#endif
}
#elif COMBINE_CTA
// One CTA of 4 warps per packed row (b, kvh, r), the row's splits dealt over the warps (warp w
// takes splits w, w + 4, ...), the 4 partial sums added in shared memory. The one-warp-a-row
// version below runs a B=1 call's 512 rows as 4 warps an SM, each walking all 33 splits: 6.8 us
// of a 26.5 us layer (H200, ncu, L2 warm; results/perf-notes.md).
extern "C" __global__ void __launch_bounds__(128)
    drafter_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                    elem_t* __restrict__ out, int batch, int qb, int hq, int hkv,
                    int group, int num_splits) {
  using namespace drafter;
  constexpr int D = HEAD_DIM;
  constexpr int PER = D / 32;  // floats per lane: 4 (D 128) or 2 (D 64)
  constexpr int WARPS = 4;
  static_assert(PER == 2 || PER == 4, "combine: head_dim 64 or 128");
  using vec_t = typename VecOf<PER>::type;
  __shared__ float s_acc[WARPS - 1][D];
  __shared__ float s_wsum[WARPS - 1];
  const int M = qb * group;
  const long long rows = static_cast<long long>(batch) * hkv * M;
  const long long row = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(0);
#endif
  const float lmax = row_lse_max(lse_part, rows, row, num_splits, lane);  // in every warp
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(8);
#endif
  float acc[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) acc[e] = 0.f;
  float wsum = 0.f;
  if (lmax != -INFINITY) {  // block-uniform; a row no split saw stays zero
#pragma unroll 4
    for (int s = warp; s < num_splits; s += WARPS) {
      const float w = fast_exp2(lse_part[s * rows + row] - lmax);
      union { vec_t v; float f[PER]; } x;
      x.v = *reinterpret_cast<const vec_t*>(o_part + (s * rows + row) * D + lane * PER);
      wsum += w;
#pragma unroll
      for (int e = 0; e < PER; ++e) acc[e] += w * x.f[e];
    }
  }
  if (!sum_over_warps(s_acc, s_wsum, acc, wsum, warp, lane)) return;
  store_row(out, acc, wsum, row, M, qb, hq, hkv, group, lane);
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(6);
#endif
}
#else
// One warp per packed row (b, kvh, r). The accumulation loop is unrolled so that several splits'
// partial rows are in flight at once (with the lse values read side by side, H200, ncu, B=1 ctx
// 8k, 33 splits: 12.8 -> 11.3 us with cold partials; about 1 us of a graph-replayed step, where
// the partials are still in L2). It stays written out here, as in the kernel above: through a
// shared helper ptxas schedules it differently at head_dim 64 (sm_80, sm_90a), which would send
// the profile rows that ran it back to the GPU for nothing.
extern "C" __global__ void __launch_bounds__(128)
    drafter_combine(const float* __restrict__ o_part, const float* __restrict__ lse_part,
                    elem_t* __restrict__ out, int batch, int qb, int hq, int hkv,
                    int group, int num_splits) {
  using namespace drafter;
  constexpr int D = HEAD_DIM;
  constexpr int PER = D / 32;  // floats per lane: 4 (D 128) or 2 (D 64)
  static_assert(PER == 2 || PER == 4, "combine: head_dim 64 or 128");
  using vec_t = typename VecOf<PER>::type;
  const int M = qb * group;
  const long long rows = static_cast<long long>(batch) * hkv * M;
  const long long row = static_cast<long long>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(0);
#endif
  if (row >= rows) return;
  const float lmax = row_lse_max(lse_part, rows, row, num_splits, lane);
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(8);
#endif
  float acc[PER];
#pragma unroll
  for (int e = 0; e < PER; ++e) acc[e] = 0.f;
  float wsum = 0.f;
  if (lmax != -INFINITY) {  // warp-uniform; a row no split saw stays zero
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      // same address in every lane: one broadcast load, independent of the running sums
      const float w = fast_exp2(lse_part[s * rows + row] - lmax);
      union { vec_t v; float f[PER]; } x;
      x.v = *reinterpret_cast<const vec_t*>(o_part + (s * rows + row) * D + lane * PER);
      wsum += w;
#pragma unroll
      for (int e = 0; e < PER; ++e) acc[e] += w * x.f[e];
    }
  }
  store_row(out, acc, wsum, row, M, qb, hq, hkv, group, lane);
#if TRACE
  if (threadIdx.x == 0) TRACE_COMBINE_AT(6);
#endif
}
#endif

// Context store: rows j < num_new[b] of k_new/v_new [B, T, Hkv, D] go to positions P_b + j, then
// ctx_lens[b] += num_new[b]. Grid (T, B). Every CTA of request b reads P_b before it arrives on
// counters[b]; the last to arrive publishes the new length and resets the counter, so the launch
// needs no second kernel and no host involvement. counters must start at zero.
extern "C" __global__ void __launch_bounds__(128)
    drafter_store(const elem_t* __restrict__ k_new,
                  const elem_t* __restrict__ v_new, const int* __restrict__ num_new,
                  elem_t* __restrict__ k_cache, elem_t* __restrict__ v_cache,
                  const int* __restrict__ table, int* __restrict__ ctx_lens,
                  int* __restrict__ counters, int T, int hkv, int table_stride, int capacity,
                  int loc_stride) {
  using namespace drafter;
  constexpr int D = HEAD_DIM;
  constexpr int CPR = D / 8;  // 16-byte chunks per row
  __shared__ int sP, sN;
  const int j = blockIdx.x, b = blockIdx.y;
  if (threadIdx.x == 0) {
    const int P = ctx_lens[b];
    const int n = max(0, min(min(num_new[b], T), capacity - P));  // never write past the cache
    sP = P;
    sN = n;
  }
  __syncthreads();
  if (j < sN) {
    const int pos = sP + j;
#if PAGE_SIZE > 0
    const int loc = table[static_cast<long long>(b) * table_stride + pos / PAGE_SIZE];
#else
    const int loc = table[b];
#endif
    const uint4* srcK = reinterpret_cast<const uint4*>(k_new + (static_cast<long long>(b) * T + j) * hkv * D);
    const uint4* srcV = reinterpret_cast<const uint4*>(v_new + (static_cast<long long>(b) * T + j) * hkv * D);
    for (int c = threadIdx.x; c < hkv * CPR; c += blockDim.x) {
      const int h = c / CPR, col = (c % CPR) * 8;
      const long long off = cache_offset(loc, h, hkv, pos, loc_stride) + col;
      *reinterpret_cast<uint4*>(k_cache + off) = srcK[c];
      *reinterpret_cast<uint4*>(v_cache + off) = srcV[c];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&counters[b], 1) == T - 1) {
      ctx_lens[b] = sP + sN;
      counters[b] = 0;
    }
  }
}
