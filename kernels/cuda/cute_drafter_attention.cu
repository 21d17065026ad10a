// Drafter-block attention written with CuTe (the CUTLASS 4.x headers of the nvidia-cutlass
// wheel), compiled with NVRTC. The algorithm, kernel arguments and defines are those of
// drafter_attention.cu (the cupy backend), so both backends share the variant machinery and a
// timing difference measures the implementation, not the problem:
//
//   one CTA = one (KV split, KV head, request); its Qb*G query rows (every query head of the KV
//   head, for every block position) are packed into an M tile of NUM_WARPS x 16 rows; K/V tiles
//   of TILE_N rows are gathered from the cache (page table or arena slot, addresses computed per
//   row) with 16-byte cp.async into a STAGES-deep shared-memory pipeline; S = Q K^T and O = P V
//   run on a TiledMMA of SM80 m16n8k16 atoms (bf16 or fp16, fp32 accumulate) fed by ldmatrix;
//   softmax is online in the log2 domain; the block's own K/V is the last tile of the last split;
//   sliding windows skip the tiles left of the window and mask per row; splits write a partial
//   output and a log-sum-exp that drafter_combine merges.
//
// CuTe pieces: shared-memory layouts with rows padded by 16 bytes (bank-conflict-free ldmatrix,
// and every ldmatrix address a per-thread base plus a constant), TiledCopy partitions for
// the gathers (Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>>: rows past the context are
// zero-filled, never read), make_tiled_copy_A/B with SM75_U32x4_LDSM_N (Q, K) and
// SM75_U16x8_LDSM_T (V, read transposed as the B operand of P V), and cute::gemm on the
// TiledMMA. TMA is not used: its descriptors are host-side objects NVRTC cannot build, and a
// page-table gather needs a per-row address anyway.
//
// Defines (NVRTC -D): DTYPE_BF16, HEAD_DIM (multiple of 16), PAGE_SIZE (0 = arena), TILE_N,
// NUM_WARPS, STAGES, Q_SMEM (Q re-read from shared memory per tile instead of held in registers;
// the WGMMA path always re-reads it, see kQRegs), MIN_CTAS (occupancy the register allocation
// must fit).
// Shared memory (dynamic): STAGES x (K tile + V tile) of TILE_N rows, plus the NUM_WARPS*16-row
// Q tile, rows of HEAD_DIM + 8 elements (HEAD_DIM with WGMMA); when Q is held in registers the Q
// tile borrows the last pipeline stage if it fits there (it is moved to registers before that
// stage is first written). The host mirrors this in kernels/cutlass_backend.py:smem_bytes.
#include "variant.cuh"

#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#if WGMMA
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#endif

// cache_offset, drafter_combine and drafter_store (the same code as the cupy backend's)
#include "combine_store.cuh"
#include "params.cuh"

namespace cute_drafter {
using namespace cute;

#if DTYPE_BF16
using Elem = cutlass::bfloat16_t;
using MmaOp = SM80_16x8x16_F32BF16BF16F32_TN;
#else
using Elem = cutlass::half_t;
using MmaOp = SM80_16x8x16_F32F16F16F32_TN;
#endif
static_assert(sizeof(Elem) == sizeof(elem_t), "CuTe and CUDA element types must match");

constexpr int kD = HEAD_DIM;
constexpr int kN = TILE_N;
constexpr int kWarps = NUM_WARPS;
constexpr int kThreads = kWarps * 32;
constexpr int kM = kWarps * 16;  // packed query rows per CTA (M tile)
constexpr int kStages = STAGES;
constexpr int kCPR = kD / 8;  // 16-byte chunks per row
constexpr int kKSteps = kD / 16;
constexpr int floor_pow2(int x) { return x >= 2 ? 2 * floor_pow2(x / 2) : 1; }
// K/V gather: kLoadRows rows of kCPR threads (coalesced 16-byte chunks of one row), each thread
// copying kIters consecutive rows, so a thread's rows share one page whenever the page holds
// kIters rows: one page-id lookup per thread per tile. kLoadRows is a power of two dividing
// kN; with a warp count that is not a power of two the last threads do not load.
constexpr int kLoadRows = floor_pow2(kThreads / kCPR) < kN ? floor_pow2(kThreads / kCPR) : kN;
constexpr int kLoaders = kLoadRows * kCPR;
constexpr int kIters = kN / kLoadRows;
constexpr int kPG = (PAGE_SIZE == 0 || PAGE_SIZE >= kIters) ? 1 : kIters;  // page ids per thread
// Q gather: every thread, kQIters consecutive rows each.
constexpr int kQRows = kThreads / kCPR;
constexpr int kQIters = kM / kQRows;
// Shared memory, in elements: stage s holds K at s * kStageElems and V right after it.
constexpr int kRowStride = WGMMA ? kD : kD + 8;
constexpr int kTileElems = kN * kRowStride;
constexpr int kStageElems = 2 * kTileElems;
// Q held in registers across the KV loop: the mma.sync path without Q_SMEM only. The wgmma path
// re-reads Q from shared memory for every tile (ldmatrix, then S's A operand), so no A operand of
// a warpgroup MMA lives across the loop's back edge. With the CUDA 13.0 ptxas (NVRTC 13.0, as on
// the H200) such a loop-carried Q fragment was given the registers of P (the A operand of O = P V)
// whenever the two fragments have the same size, TILE_N == HEAD_DIM (the default 64-key tiles at
// head_dim 64; 128-key tiles at 128): from the second tile on S was computed from P instead of Q
// (issue #19). A fragment defined in the iteration, like P, is allocated correctly.
// tests/test_cutlass_compile.py checks the SASS: Q's registers are reloaded in the loop, or never
// written there.
constexpr bool kQRegs = !Q_SMEM && !WGMMA;
constexpr bool kQAlias = kQRegs && kM * kRowStride <= kStageElems;
constexpr int kQOffset = kQAlias ? (kStages - 1) * kStageElems : kStages * kStageElems;

static_assert(kD % 16 == 0, "HEAD_DIM must be a multiple of 16");
static_assert(kN % 16 == 0 && (kN & (kN - 1)) == 0, "TILE_N: a power of two, at least 16");
static_assert(kThreads % kCPR == 0 && kM % kQRows == 0, "Q rows must split evenly over threads");
static_assert(kStages >= 2, "STAGES >= 2");
static_assert(PAGE_SIZE == 0 || (PAGE_SIZE & (PAGE_SIZE - 1)) == 0, "page size: power of two");

#if WGMMA
// sm_90a: one warpgroup MMA per 64 rows, A (Q, then P) from registers, B (K, then V) straight
// from shared memory through GMMA descriptors: S = Q K^T with K K-major, O = P V with V
// MN-major (d contiguous). The K/V tiles use the 128-byte-swizzled GMMA layouts; V's (d, key)
// view is the same bytes as its (key, d) tile.
static_assert(kWarps % 4 == 0, "WGMMA needs whole warpgroups (NUM_WARPS % 4 == 0)");
static_assert(kD % 64 == 0, "WGMMA: HEAD_DIM must be a multiple of the 64-element swizzle atom");
using MmaS = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kN>, _16>, GMMA::Major::K, GMMA::Major::K>(),
    Layout<Shape<Int<kWarps / 4>, _1, _1>>{}));
using MmaO = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Elem, Elem, float, Shape<_64, Int<kD>, _16>, GMMA::Major::K, GMMA::Major::MN>(),
    Layout<Shape<Int<kWarps / 4>, _1, _1>>{}));
using SmemKV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<kN>, Int<kD>>{}));
using SmemVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{}, Shape<Int<kD>, Int<kN>>{},
                                      Step<_2, _1>{}));
using SmemQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{}, Shape<Int<kM>, Int<kD>>{}));
#else
// Warps stacked along M, 16 rows each; the N (and K) extent 16 lets one ldmatrix.x4 feed two
// n8 atoms.
using MmaS = decltype(make_tiled_mma(MMA_Atom<MmaOp>{}, Layout<Shape<Int<kWarps>, _1, _1>>{},
                                     Tile<Int<kM>, _16, _16>{}));
using MmaO = MmaS;
// Rows padded by 16 bytes: the 8 row addresses of an ldmatrix hit 8 distinct 16-byte bank
// groups, and every ldmatrix of a thread is its base address plus a compile-time offset.
using SmemKV = Layout<Shape<Int<kN>, Int<kD>>, Stride<Int<kRowStride>, _1>>;  // (key, d)
// V seen as (d, key): the B operand of O = P V, read with transposing ldmatrix.
using SmemVt = Layout<Shape<Int<kD>, Int<kN>>, Stride<_1, Int<kRowStride>>>;
using SmemQ = Layout<Shape<Int<kM>, Int<kD>>, Stride<Int<kRowStride>, _1>>;  // (row, d)
#endif

using G2S = Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>, Elem>;
using G2SKV = decltype(make_tiled_copy(G2S{},
                                       Layout<Shape<Int<kLoadRows>, Int<kCPR>>, Stride<Int<kCPR>, _1>>{},
                                       Layout<Shape<Int<kIters>, _8>, Stride<_8, _1>>{}));
using G2SQ = decltype(make_tiled_copy(G2S{},
                                      Layout<Shape<Int<kQRows>, Int<kCPR>>, Stride<Int<kCPR>, _1>>{},
                                      Layout<Shape<Int<kQIters>, _8>, Stride<_8, _1>>{}));
using LdsmN = Copy_Atom<SM75_U32x4_LDSM_N, Elem>;
using LdsmT = Copy_Atom<SM75_U16x8_LDSM_T, Elem>;

// S's accumulator fragment read as the A fragment ((2,2,2), 1, kN/16) of P V: two neighbouring
// n8 accumulator tiles are the two k8 halves of one k16 A operand. Accumulator value i of a
// thread is (column pair element c, row half h, n8 tile n) with i = c + 2h + 4n, for the SM80
// ((2,2), 1, kN/8) and the SM90 ((2,2,kN/8), 1, 1) fragments alike.
using PLayout = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kN / 16>>, Stride<Stride<_1, _2, _4>, _0, _8>>;

enum { MASK_FULL = 0, MASK_SLIDING = 1, MASK_SLIDING_CAUSAL = 2 };

// The same partitioned smem tensor in pipeline stage `s`.
template <class T>
__device__ __forceinline__ auto at_stage(T const& t, int s) {
  return make_tensor(t.data() + s * kStageElems, t.layout());
}

// Accumulator element (c, h, n) of a thread (see PLayout).
template <class T>
__device__ __forceinline__ float& acc(T& t, int c, int h, int n) {
  return t(c + 2 * h + 4 * n);
}

}  // namespace cute_drafter

// CUTE_DRAFTER_LAYOUTS_ONLY: the types above without the kernel (tests/cute_layout_check.cu
// checks the gather partitions on the host).
#ifndef CUTE_DRAFTER_LAYOUTS_ONLY
// The kernel's body takes the fields as parameters: __restrict__ holds for parameters only.
__device__ __forceinline__ void cute_attention_body(
    const elem_t* __restrict__ q_, const elem_t* __restrict__ k_blk_, const elem_t* __restrict__ v_blk_,
    const elem_t* __restrict__ k_cache_, const elem_t* __restrict__ v_cache_,
    const int* __restrict__ table, const int* __restrict__ ctx_lens, elem_t* __restrict__ out,
    float* __restrict__ o_part, float* __restrict__ lse_part, int qb, int hq, int hkv, int group,
    int table_stride, int capacity, int loc_stride, int mask_mode, int window, float scale_log2) {
  using namespace cute_drafter;
  using drafter::cache_offset;
  using drafter::fast_exp2;
  using drafter::pack2;
  const Elem* q = reinterpret_cast<const Elem*>(q_);
  const Elem* k_blk = reinterpret_cast<const Elem*>(k_blk_);
  const Elem* v_blk = reinterpret_cast<const Elem*>(v_blk_);
  const Elem* k_cache = reinterpret_cast<const Elem*>(k_cache_);
  const Elem* v_cache = reinterpret_cast<const Elem*>(v_cache_);

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // GMMA swizzle atoms: 1 KB
  Elem* smem = reinterpret_cast<Elem*>(smem_raw);

  const int split = blockIdx.x, num_splits = gridDim.x;
  const int kvh = blockIdx.y, b = blockIdx.z, batch = gridDim.z;
  const int tid = threadIdx.x, warp = tid >> 5;
  const int M = qb * group;

  // ---- this CTA's share of the context: tiles [t0, t1), plus the block's own K/V if last split
  const int P = max(0, min(ctx_lens[b], capacity));
  const bool windowed = mask_mode != MASK_FULL;
  // Row i sees context keys kp > P + i - window; row 0 has the leftmost edge. Tiles left of it
  // are skipped, so a windowed layer costs O(window), not O(context).
  const int lo = windowed ? max(0, P - window + 1) : 0;
  const int t_lo = lo / kN, t_hi = (P + kN - 1) / kN;
  const int n_ctx = t_hi - t_lo;
  const int t0 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * split / num_splits);
  const int t1 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * (split + 1) / num_splits);
  const int n_ctx_here = t1 - t0;
  const bool has_block = split == num_splits - 1;
  const int n_iter = n_ctx_here + (has_block ? 1 : 0);
  const int* trow = table + static_cast<long long>(b) * table_stride;

  // ---- shared-memory tensors (stage 0; other stages are offsets of kStageElems)
  Tensor sQ = make_tensor(make_smem_ptr(smem + kQOffset), SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem), SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem + kTileElems), SmemKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem + kTileElems), SmemVt{});

  // ---- Q gather: row r = i * group + h is query head kvh * group + h of block position i
  {
    G2SQ g2s_q;
    auto thr = g2s_q.get_thread_slice(tid);
    Tensor tQc = thr.partition_S(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
    Tensor tQs = thr.partition_D(sQ);
    CUTE_UNROLL
    for (int it = 0; it < kQIters; ++it) {
      const auto rc = tQc(make_coord(0, it), 0, 0);
      const int r = get<0>(rc), col = get<1>(rc);
      const bool valid = r < M;
      const int i = valid ? r / group : 0, h = valid ? r % group : 0;
      const Elem* src = q + ((static_cast<long long>(b) * qb + i) * hq + kvh * group + h) * kD + col;
      copy(G2S{}.with(valid), make_tensor(make_gmem_ptr(src), Layout<_8>{}),
           tQs(make_coord(_, it), 0, 0));
    }
    cp_async_fence();  // group 0: Q, older than every K/V group
  }

  // ---- K/V gather. Tile v < n_ctx_here is context tile t0 + v; tile n_ctx_here is the block.
  G2SKV g2s_kv;
  auto thr_kv = g2s_kv.get_thread_slice(tid % kLoaders);
  Tensor tKVc = thr_kv.partition_S(make_identity_tensor(Shape<Int<kN>, Int<kD>>{}));
  Tensor tKs = thr_kv.partition_D(sK);
  Tensor tVs = thr_kv.partition_D(sV);
  const bool loader = tid < kLoaders;

  auto lookup = [&](int v, int (&pg)[kPG]) {
    if (v >= n_ctx_here) return;
#if PAGE_SIZE > 0
    const int kstart = (t0 + v) * kN;
    CUTE_UNROLL
    for (int j = 0; j < kPG; ++j) {
      // first row of slot j; with kPG == 1 its page holds all of this thread's rows
      const int kp = kstart + (PAGE_SIZE >= kN ? 0 : get<0>(tKVc(make_coord(0, j), 0, 0)));
      pg[j] = kp < P ? trow[kp / PAGE_SIZE] : 0;  // never read table entries past P
    }
#else
    pg[0] = trow[0];  // the slot
#endif
  };
  auto issue = [&](int v, int stage, const int (&pg)[kPG]) {
    if (!loader) return;
    Tensor dK = at_stage(tKs, stage);
    Tensor dV = at_stage(tVs, stage);
    const bool is_block = v >= n_ctx_here;
    const int kstart = (t0 + v) * kN;
    CUTE_UNROLL
    for (int it = 0; it < kIters; ++it) {
      const auto rc = tKVc(make_coord(0, it), 0, 0);
      const int row = get<0>(rc), col = get<1>(rc);
      long long off;
      bool valid;
      const Elem *baseK, *baseV;
      if (is_block) {  // the block's own K/V [B, Qb, Hkv, D]
        valid = row < qb;
        off = ((static_cast<long long>(b) * qb + (valid ? row : 0)) * hkv + kvh) * kD + col;
        baseK = k_blk;
        baseV = v_blk;
      } else {  // context tile t0 + v
        const int kp = kstart + row;
        valid = kp < P;
        off = valid ? cache_offset(pg[kPG == 1 ? 0 : it], kvh, hkv, kp, loc_stride) + col : 0;
        baseK = k_cache;
        baseV = v_cache;
      }
      // 8 elements of row `it`; zero-filled (nothing read) when !valid
      copy(G2S{}.with(valid), make_tensor(make_gmem_ptr(baseK + off), Layout<_8>{}),
           dK(make_coord(_, it), 0, 0));
      copy(G2S{}.with(valid), make_tensor(make_gmem_ptr(baseV + off), Layout<_8>{}),
           dV(make_coord(_, it), 0, 0));
    }
  };

  int pg[kPG];
  CUTE_UNROLL
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_iter) {
      lookup(s, pg);
      issue(s, s, pg);
    }
    cp_async_fence();
  }
  if (kStages - 1 < n_iter) lookup(kStages - 1, pg);

  // ---- MMA partitions
  MmaS mma_s;
  MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);  // (MMA, 1, kD/16) registers
  auto s2r_q = make_tiled_copy_A(LdsmN{}, mma_s);
  Tensor tSsQ = s2r_q.get_thread_slice(tid).partition_S(sQ);
  Tensor tSrQ_v = s2r_q.get_thread_slice(tid).retile_D(tSrQ);
#if !WGMMA
  Tensor tSrK = thr_s.partition_fragment_B(sK);  // (MMA, kN/8, kD/16)
  Tensor tOrVt = thr_o.partition_fragment_B(sVt);  // (MMA, kD/8, kN/16)
  auto s2r_k = make_tiled_copy_B(LdsmN{}, mma_s);
  auto s2r_v = make_tiled_copy_B(LdsmT{}, mma_o);
  Tensor tSsK = s2r_k.get_thread_slice(tid).partition_S(sK);
  Tensor tSrK_v = s2r_k.get_thread_slice(tid).retile_D(tSrK);
  Tensor tOsVt = s2r_v.get_thread_slice(tid).partition_S(sVt);
  Tensor tOrVt_v = s2r_v.get_thread_slice(tid).retile_D(tOrVt);
#endif

  // (row, col) of every accumulator element this thread holds: rows r0 (h = 0) and r0 + 8 (h = 1)
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kN>>{}));
  Tensor cO = thr_o.partition_C(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
  const int r0 = get<0>(cS(0)), r1 = r0 + 8;
  const int i0 = min(r0 / group, qb - 1), i1 = min(r1 / group, qb - 1);

#if !Q_SMEM && !WGMMA
  // Q to registers once: wait for the Q group only (the K/V groups stay in flight).
  cp_async_wait<kStages - 1>();
  __syncthreads();
  copy(s2r_q, tSsQ, tSrQ_v);
  // The Q tile may share the last stage: it is first overwritten after the loop's first barrier.
#endif

  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kM>, Int<kD>>{});
  clear(tOrO);
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  for (int v = 0; v < n_iter; ++v) {
    cp_async_wait<kStages - 2>();
#if WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async -> wgmma reads
#endif
    __syncthreads();  // tile v visible to all; stage (v-1)%STAGES free for reuse
    {
      const int vn = v + kStages - 1;
      if (vn < n_iter) issue(vn, vn % kStages, pg);
      cp_async_fence();
      // Page ids for the tile after: loads stay in flight while this tile computes.
      if (vn + 1 < n_iter) lookup(vn + 1, pg);
    }
    const int stage = v % kStages;
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kM>, Int<kN>>{});
#if WGMMA
    if ((warp >> 2) * 64 >= M) continue;  // a warpgroup with no query rows only helps load

    // S = Q K^T (64 rows x kN keys per warpgroup), K read by the MMA from shared memory; Q
    // re-read for every tile (kQRegs is false here)
    copy(s2r_q, tSsQ, tSrQ_v);
    Tensor tSrK = thr_s.partition_fragment_B(
        make_tensor(make_smem_ptr(smem + stage * kStageElems), SmemKV{}));  // descriptors
    warpgroup_fence_operand(tSrQ);
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    mma_s.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int k = 0; k < kKSteps; ++k) {
      gemm(mma_s, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
      mma_s.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
#else
    if (warp * 16 >= M) continue;  // a warp with no query rows only helps load

    // S = Q K^T (16 rows x kN keys per warp)
    clear(tSrS);
    Tensor tSsK_s = at_stage(tSsK, stage);
    CUTE_UNROLL
    for (int k = 0; k < kKSteps; ++k) {
#if Q_SMEM
      copy(s2r_q, tSsQ(_, _, k), tSrQ_v(_, _, k));
#endif
      copy(s2r_k, tSsK_s(_, _, k), tSrK_v(_, _, k));
      gemm(mma_s, tSrQ(_, _, k), tSrK(_, _, k), tSrS);
    }
#endif

    // scale into the log2 domain; mask only tiles that some row cannot fully see
    const bool is_block = v >= n_ctx_here;
    const int kstart = (t0 + v) * kN;
    const bool need_mask =
        is_block || kstart + kN > P || (windowed && kstart <= P + qb - 1 - window);
    CUTE_UNROLL
    for (int n = 0; n < kN / 8; ++n) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        CUTE_UNROLL
        for (int c = 0; c < 2; ++c) {
          float x = acc(tSrS, c, h, n) * scale_log2;
          if (need_mask) {
            const int col = get<1>(cS(c + 2 * h + 4 * n));
            const int i = h ? i1 : i0;
            bool vis;
            if (is_block) {
              const int dj = i - col;
              vis = col < qb && (mask_mode == MASK_FULL ||
                                 (mask_mode == MASK_SLIDING ? (dj < window && -dj < window)
                                                            : (dj >= 0 && dj < window)));
            } else {
              const int kp = kstart + col;
              vis = kp < P && (!windowed || kp > P + i - window);
            }
            if (!vis) x = -INFINITY;
          }
          acc(tSrS, c, h, n) = x;
        }
      }
    }

    // online softmax; a row is spread over the 4 lanes of a quad
    float mx0 = -INFINITY, mx1 = -INFINITY;
    CUTE_UNROLL
    for (int n = 0; n < kN / 8; ++n) {
      mx0 = fmaxf(mx0, fmaxf(acc(tSrS, 0, 0, n), acc(tSrS, 1, 0, n)));
      mx1 = fmaxf(mx1, fmaxf(acc(tSrS, 0, 1, n), acc(tSrS, 1, 1, n)));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float base0 = mn0 == -INFINITY ? 0.f : mn0;  // a fully masked row stays at zero
    const float base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float a0 = fast_exp2(m0 - base0), a1 = fast_exp2(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
    CUTE_UNROLL
    for (int n = 0; n < kN / 8; ++n) {
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        float& x0 = acc(tSrS, c, 0, n);
        float& x1 = acc(tSrS, c, 1, n);
        x0 = fast_exp2(x0 - base0);
        x1 = fast_exp2(x1 - base1);
        ps0 += x0;
        ps1 += x1;
      }
    }
    l0 = l0 * a0 + ps0;
    l1 = l1 * a1 + ps1;
    CUTE_UNROLL
    for (int n = 0; n < kD / 8; ++n) {
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        acc(tOrO, c, 0, n) *= a0;
        acc(tOrO, c, 1, n) *= a1;
      }
    }

    // O += P V: P rounded to the input type, in the A-fragment layout of the same TiledMMA
    uint32_t p_regs[kN / 4];
    CUTE_UNROLL
    for (int e = 0; e < kN / 4; ++e) p_regs[e] = pack2(tSrS(2 * e), tSrS(2 * e + 1));
    Tensor tOrP = make_tensor(make_rmem_ptr(reinterpret_cast<Elem*>(p_regs)), PLayout{});
#if WGMMA
    Tensor tOrVt = thr_o.partition_fragment_B(
        make_tensor(make_smem_ptr(smem + stage * kStageElems + kTileElems), SmemVt{}));
    CUTE_UNROLL
    for (int e = 0; e < kN / 4; ++e) warpgroup_fence_operand(p_regs[e]);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kk = 0; kk < kN / 16; ++kk) gemm(mma_o, tOrP(_, _, kk), tOrVt(_, _, kk), tOrO);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
#else
    Tensor tOsVt_s = at_stage(tOsVt, stage);
    CUTE_UNROLL
    for (int kk = 0; kk < kN / 16; ++kk) {
      copy(s2r_v, tOsVt_s(_, _, kk), tOrVt_v(_, _, kk));
      gemm(mma_o, tOrP(_, _, kk), tOrVt(_, _, kk), tOrO);
    }
#endif
  }
  cp_async_wait<0>();

  // ---- epilogue: normalise; write the output, or this split's partial + log-sum-exp
  l0 += __shfl_xor_sync(0xffffffff, l0, 1);
  l0 += __shfl_xor_sync(0xffffffff, l0, 2);
  l1 += __shfl_xor_sync(0xffffffff, l1, 1);
  l1 += __shfl_xor_sync(0xffffffff, l1, 2);
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const int t4 = threadIdx.x & 3;
  if (num_splits == 1) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = h ? r1 : r0;
      if (r >= M) continue;
      const float inv = h ? inv1 : inv0;
      elem_t* dst = out + ((static_cast<long long>(b) * qb + r / group) * hq + kvh * group + r % group) * kD;
      CUTE_UNROLL
      for (int n = 0; n < kD / 8; ++n) {
        const int col = get<1>(cO(2 * h + 4 * n));
        *reinterpret_cast<uint32_t*>(dst + col) =
            pack2(acc(tOrO, 0, h, n) * inv, acc(tOrO, 1, h, n) * inv);
      }
    }
  } else {
    const long long row_base = ((static_cast<long long>(split) * batch + b) * hkv + kvh) * M;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = h ? r1 : r0;
      if (r >= M) continue;
      const float inv = h ? inv1 : inv0;
      float* dst = o_part + (row_base + r) * kD;
      CUTE_UNROLL
      for (int n = 0; n < kD / 8; ++n) {
        const int col = get<1>(cO(2 * h + 4 * n));
        *reinterpret_cast<float2*>(dst + col) =
            make_float2(acc(tOrO, 0, h, n) * inv, acc(tOrO, 1, h, n) * inv);
      }
      if (t4 == 0) {
        const float l = h ? l1 : l0, m = h ? m1 : m0;
        lse_part[row_base + r] = l > 0.f ? m + log2f(l) : -INFINITY;
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(cute_drafter::kThreads, MIN_CTAS)
    drafter_attention(DRAFTER_KERNEL_PARAMS) {
  cute_attention_body(DRAFTER_BODY_ARGS);
}
#endif  // CUTE_DRAFTER_LAYOUTS_ONLY
