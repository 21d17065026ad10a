// The warp-specialised body of drafter_attention (WARP_SPEC=1, sm_90a; cupy_backend `ws=2`..`=4`).
// Included by drafter_attention.cu after its tile layout and TMA constants, whose names it uses.
//
// One CTA of 1 + WS_CONSUMERS warpgroups (2, 3 or 4 consumers), one CTA an SM:
// - warpgroup 0, the producer: lane 0 of its first warp issues every context tile's bulk tensor
//   copies (TMA) into a ring of STAGES K/V stages, each completing on that stage's `full`
//   barrier; the warp's lanes hold the split's page ids, 32 at a time, a chunk ahead. The block's
//   own K/V (the last split's last tile) the same warp copies by cp.async. The math warps never
//   issue a copy or wait for a page id, and a tile's copies go out as soon as its stage is free.
// - consumer 0 copies the CTA's Q rows into shared memory once, where S = Q K^T reads both
//   operands (32 registers a thread fewer; three consumers still spill 64-80 bytes at 160 on
//   64-key tiles, and none on 32-key tiles).
// - warpgroups 1 .. WS_CONSUMERS, the consumers: consumer c takes tiles c, c + WS_CONSUMERS, ...
//   (stage v % STAGES, STAGES a multiple of WS_CONSUMERS, so a stage always serves the same
//   consumer and its barriers' phases follow that consumer's tiles in order). Each runs
//   S = Q K^T and P V on wgmma with its own online softmax over its tiles, and frees the stage
//   on its `empty` barrier. One consumer's softmax runs while another's wgmmas do, and no copy
//   issue sits on their chain. Two consumers are as many math warps an SM as the pipelined
//   kernel's two one-warpgroup CTAs; three are 1.5 times as many, at 160 registers a thread;
//   four twice as many, at 112, which holds a 64 x 128 fp32 O only beside 32-key tiles' scores.
//   Measured on the H200 (results/perf-notes.md, "Three and four consumers on 32-key tiles"):
//   three on 32-key tiles are the fastest below batch 8 (B=1 8k 20.7 us against 24.2 for the
//   pipelined kernel); all are slower at large batch, long contexts and laguna; four spill
//   without LEAN.
// LEAN (ws's default; `lean=0` turns it off) trims the consumers' tile loop: descriptors made
// once and advanced by offsets, the mask behind one uniform branch instead of a branch a score,
// and O rescaled only when some row's running max moves by more than RESCALE_SLACK (the loop's
// static length 1158 -> 558 instructions for ws=3 on 32-key tiles at page 64; H200: 3-12%
// faster at B=1-8 on the presets other than the main one; results/perf-notes.md, "The ws
// consumers' tile loop, trimmed").
// At the end each other consumer hands its rows (unnormalised O, max and sum) to consumer 0
// through its own stages (the K and V halves of its last tile's, and of another of its own
// where 32-key stages are too small), and consumer 0 merges them and writes the output or the
// split's partial, as the other paths do. Rows: at most 64 a CTA (one wgmma M tile; ROW_SPLIT
// deals more over CTAs).
// WS_ROWS (`ws_rows`) deals the rows instead of the tiles: consumer c holds its share of the
// CTA's rows (row_share: laguna's 144 as 3 x 48, each padded to one 64-row wgmma tile) in a Q
// stage of its own, every consumer reads every tile (a stage is free once all have read it), and
// each stores its own rows, with no hand-over. A tile then leaves DRAM once for all the rows of
// its (request, KV head), where ROW_SPLIT's CTAs read it once each (all but the first from L2).
#pragma once

#ifndef WS_CONSUMERS
#define WS_CONSUMERS 2
#endif
#ifndef EARLY_IDS
#define EARLY_IDS 0  // a split's first page ids copied before the context length lands (`early_ids`)
#endif
#ifndef WS_ROWS
#define WS_ROWS 0  // the consumers share every tile, each holding its own share of the rows (`ws_rows`)
#endif
#ifndef Q_STEP
#define Q_STEP 0  // Q's copies addressed by a constant step a row, not a division (`q_step`)
#endif
#ifndef WS_OVERLAP
#define WS_OVERLAP 0  // a consumer's P V of one tile under the S = Q K^T of its next (`ws_overlap`)
#endif
#ifndef WS_PAIR
#define WS_PAIR 0  // split pairs as clusters of two, merged through shared memory (`pair`)
#endif
namespace {
constexpr int WS_THREADS = 128 * (1 + WS_CONSUMERS);
static_assert(WS_CONSUMERS >= 2 && WS_CONSUMERS <= 4, "WARP_SPEC: 2, 3 or 4 consumer warpgroups");
static_assert(WGMMA && TMA_LOADS && NUM_WARPS == 4 && !Q_SMEM && !OVERLAP,
              "WARP_SPEC: wgmma with TMA copies, 64-row consumers, its own Q stage");
constexpr int Q_ELEMS = 64 * D;  // the CTA's 64 packed rows, in 64-column halves as a K tile
// WS_ROWS: a Q stage a consumer (its own rows), and no hand-over of O at the end
constexpr int Q_STAGES = WS_ROWS ? WS_CONSUMERS : 1;
static_assert(!WS_ROWS || ROW_SPLIT == 1, "WS_ROWS holds all of a split's rows in one CTA");
// element offset of (row, col) in the Q stage: the 128-byte-swizzled K-major layout of tile_off
__device__ __forceinline__ int q_off(int row, int col) {
  const int c = col >> 3;
  return (c >> 3) * 64 * 64 + row * 64 + (((c & 7) ^ (row & 7)) << 3);
}
static_assert(!WS_PAIR || (!WS_ROWS && ROW_SPLIT == 1),
              "WS_PAIR: a split's rows in one CTA, merged by one consumer");
static_assert(WS_ROWS || (STAGES >= WS_CONSUMERS && STAGES % WS_CONSUMERS == 0),
              "WARP_SPEC: stages a multiple of the consumers");
static_assert(PAGE_SIZE == 0 || PAGE_SIZE >= N || (BOXES <= 32 && 32 % BOXES == 0),
              "a tile's page ids lie in one chunk of 32");
// A consumer hands its fp32 O over in chunks of HO_FLOATS floats, each the K or V half of one of
// its stages: 2 chunks (one stage) from 64-key tiles up, 4 (two stages) at 32 keys.
constexpr int HO_FLOATS = (N < 64 ? N : 64) * D / 2;
constexpr int HO_CHUNKS = DTILES * 4 * 128 / HO_FLOATS;
static_assert(WS_ROWS || HO_CHUNKS <= 2 * (STAGES / WS_CONSUMERS),
              "the hand-over fits a consumer's stages");
// the named barrier of the merge: after the consumers' own (1 .. WS_CONSUMERS)
constexpr int MERGE_BARRIER = WS_CONSUMERS < 4 ? 4 : 1 + WS_CONSUMERS;
}  // namespace

namespace drafter {
// a named barrier among `count` threads (whole warps); 0 is __syncthreads'
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// the register budget of the calling warpgroup (every warp of it executes this)
template <int REGS>
__device__ __forceinline__ void regs_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void regs_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
}  // namespace drafter

#if WS_PAIR
// WS_PAIR: splits 2j and 2j + 1 of a (request, KV head) run as one cluster of two CTAs (the
// kernel's __cluster_dims__). At the end each CTA's consumer 0 sends the rows the other keeps
// (unnormalised O, max, sum: the first keeps rows 0-31, the second 32-63) into the other's shared
// memory by st.async, which completes there as transaction bytes on its pair barrier, then
// merges what it received into the rows it keeps and writes them: to the output (two splits) or
// as the pair's partial (num_splits / 2 partials for the combine). No partial goes through L2
// for the pair, and at two splits there is no combine kernel and no gap between kernels.
// (Measured on the H200: the second CTA handing all 64 rows to the first by stores, a fence and
// an arrival was 1.6 us slower at B=8 8k; results/perf-notes.md.)
namespace drafter {
// the address in cluster CTA `rank`'s shared memory of this CTA's shared address `addr`
__device__ __forceinline__ unsigned cluster_addr(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// the cluster barrier, split: every thread arrives once its CTA's barriers are set up; only the
// threads that touch the other CTA's shared memory wait (a thread that exits counts as arrived)
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}
// 16 bytes into another CTA's shared memory (`addr`), completing as transaction bytes on its
// barrier `bar`: no fence, no arrival
__device__ __forceinline__ void st_async_v4(unsigned addr, float4 v, unsigned bar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
      ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar)
      : "memory");
}
// spin until phase `parity` of a barrier that the other CTA's st.async completes has completed
__device__ __forceinline__ void mbar_wait_cluster(unsigned long long* bar, unsigned parity) {
  asm volatile(MBAR_TRY_WAIT(".acquire.cluster") ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
}  // namespace drafter
#endif

// Producer and consumer registers. The CTA launches with what ptxas gives every thread for one
// CTA an SM (WS_LAUNCH_REGS: 168, 128 or 96 for 2, 3 or 4 consumers); `setmaxnreg.inc` only takes
// what the producer's `setmaxnreg.dec` gave back, and waits for it forever otherwise. So
// 128 x 24 + 256 x 240 (2 consumers) = 384 x 168; 128 x 24 + 384 x 160 (3) <= 512 x 128;
// 128 x 24 + 512 x 112 (4) <= 640 x 96 (120 would hang: found on an H200). With EARLY_IDS, three
// and four consumers leave the producer 32 (both sums then equal), where 24 spill at page 128.
#ifndef WS_PRODUCER_REGS
#define WS_PRODUCER_REGS (EARLY_IDS && WS_CONSUMERS > 2 ? 32 : 24)
#endif
#ifndef WS_CONSUMER_REGS
#define WS_CONSUMER_REGS (WS_CONSUMERS == 2 ? 240 : WS_CONSUMERS == 3 ? 160 : 112)
#endif
namespace {
constexpr int WS_LAUNCH_REGS = (65536 / WS_THREADS / 8 * 8) < 255 ? 65536 / WS_THREADS / 8 * 8 : 255;
static_assert(WS_CONSUMERS * (WS_CONSUMER_REGS - WS_LAUNCH_REGS) <= WS_LAUNCH_REGS - WS_PRODUCER_REGS,
              "WARP_SPEC: the consumers' setmaxnreg.inc must fit what the producer gives back");
}  // namespace

__device__ __forceinline__ void ws_attention_body(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k_blk, const elem_t* __restrict__ v_blk,
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ table, const int* __restrict__ ctx_lens, elem_t* __restrict__ out,
    float* __restrict__ o_part, float* __restrict__ lse_part, int qb, int hq, int hkv, int group,
    int table_stride, int capacity, int loc_stride, int mask_mode, int window, float scale_log2,
    const TmaMap* __restrict__ tma_k, const TmaMap* __restrict__ tma_v) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  elem_t* sK = reinterpret_cast<elem_t*>(smem_raw);  // [STAGES][N][D] swizzled halves
  elem_t* sV = sK + STAGES * TILE_ELEMS;
  elem_t* sQ = sV + STAGES * TILE_ELEMS;  // [Q_STAGES][64][D]
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sQ + Q_STAGES * Q_ELEMS);
  unsigned long long* empty = full + STAGES;
  unsigned long long* qbar = empty + STAGES;  // Q landed (consumer 0's threads; WS_ROWS: all)
  // [WS_CONSUMERS - 1][4][128]: the m0 m1 l0 l1 of consumers 1.. for consumer 0
  float* sML = reinterpret_cast<float*>(qbar + 1);
#if WS_PAIR
  // past the merge area and EARLY_IDS' 64 page ids: the pair's barrier, then the peer's half of
  // the rows, O fragments and then m0 m1 l0 l1: [DTILES + 1][64] float4
  unsigned long long* pair_bar =
      reinterpret_cast<unsigned long long*>(sML + (WS_CONSUMERS - 1) * 512 + (EARLY_IDS ? 64 : 0));
  float4* pair_buf = reinterpret_cast<float4*>(pair_bar + 1);
#endif

  const int split = blockIdx.x / ROW_SPLIT, num_splits = gridDim.x / ROW_SPLIT;
  const int kvh = blockIdx.y, b = blockIdx.z, batch = gridDim.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
#if TRACE
  if (tid == 0) TRACE_AT(0);
  unsigned long long t_len = 0;  // slot 11, with EARLY_IDS (stored past the first barrier)
#endif
  const int M = qb * group;
  int r_lo = 0, r_end = M;
  if (ROW_SPLIT > 1) row_share(M, ROW_SPLIT, static_cast<int>(blockIdx.x % ROW_SPLIT), r_lo, r_end);
  // WS_ROWS: a consumer's rows are its share of the CTA's (laguna's 144 as 3 x 48), in its own
  // Q stage; every consumer reads every tile, so a tile is read once for all the rows
  if (WS_ROWS && wg > 0) row_share(M, WS_CONSUMERS, wg - 1, r_lo, r_end);
  elem_t* const sQc = sQ + (WS_ROWS && wg > 0 ? (wg - 1) * Q_ELEMS : 0);

  // the CTA's Q rows into its Q stage (rows past its share zero-filled): consumer 0's threads
  // (WS_ROWS: each consumer's its own), before anything waits
#if Q_STEP
  // Q_STEP: a thread's rows lie STEP apart, so one division places its first row (query token
  // qi, head h of the group) and each further row is a constant step, plus a token's worth where
  // h wraps. Dividing by the group a row makes the copies about 480 instructions a thread, and
  // with EARLY_IDS the CTA's first barrier waits for them to be issued.
  auto q_copies = [&](int ctid) {
    constexpr int STEP = 128 / CPR;  // a multiple of 8 rows: the swizzle repeats
    const int col = (ctid % CPR) * 8;
    int r = r_lo + ctid / CPR;
    const int qi = r / group, dq = STEP / group, dh = STEP - dq * group;
    int h = r - qi * group;
    const elem_t* src = q + ((static_cast<long long>(b) * qb + qi) * hq + kvh * group + h) * D + col;
    const long long step = (static_cast<long long>(dq) * hq + dh) * D;
    const long long wrap = static_cast<long long>(hq - group) * D;  // h past the group: next token
    elem_t* dst = sQc + q_off(ctid / CPR, col);
#pragma unroll
    for (int k = 0; k < CPR / 2; ++k) {  // rows past r_end zero-filled (their src is never read)
      cp_async_16(dst, r < r_end ? src : q, r < r_end);
      r += STEP;
      dst += STEP * 64;
      h += dh;
      src += step;
      if (h >= group) {
        h -= group;
        src += wrap;
      }
    }
    cp_async_commit();
  };
#else
  auto q_copies = [&](int ctid) {
    for (int i = ctid; i < 64 * CPR; i += 128) {
      const int r = r_lo + i / CPR, col = (i % CPR) * 8;
      const int qi = min(r / group, qb - 1);
      const elem_t* src = q + ((static_cast<long long>(b) * qb + qi) * hq + kvh * group + r % group) * D + col;
      cp_async_16(sQc + q_off(r - r_lo, col), r < r_end ? src : q, r < r_end);
    }
    cp_async_commit();
  };
#endif
#if EARLY_IDS
  const int* trow = table + static_cast<long long>(b) * table_stride;
  const int len = ctx_lens[b];  // in flight while the producer's warp reads the table
#if PAGE_SIZE > 0
  // Before the context length lands, the producer's warp copies into shared memory (cp.async:
  // nothing waits for it yet) the page ids of this split's share as planned for a full table (a
  // context of `capacity`) and of the 32 pages before it. A shorter context never starts a
  // split's share later, and one a few pages short (a table sized to its context) starts it at
  // most 32 pages earlier: its first 32 ids are then among these 64. With the tensor maps'
  // prefetch and Q's copies also issued here, the first tiles' copies go out one round trip
  // after launch (the length, ids, maps and Q together) instead of two. Any other split reads
  // its ids again once the length is known. The 64 ids sit after the consumers' merge area (a
  // consumer without tiles writes that at once).
  int* sSpec = reinterpret_cast<int*>(sML + (WS_CONSUMERS - 1) * 512);
  int spec_base = 0;
  // Q lands beside the length, not a trip after it
  if (WS_ROWS ? wg > 0 : wg == 1) q_copies(tid - (WS_ROWS ? 128 * wg : 128));
#if TRACE
  if (tid == 128) TRACE_AT(13);  // consumer 0's first thread has issued its Q copies
#endif
  if (warp == 0 && !SKIP_LOADS) {
    if (lane == 0) {  // the tensor maps, which the first copies wait for as well
      tma_prefetch_map(tma_k);
      tma_prefetch_map(tma_v);
    }
    // split_tiles' first tile at P = capacity, in 32-bit arithmetic (its 64-bit division is a
    // call that makes the consumers spill): a product that wraps only costs a miss
    const int lo = mask_mode != MASK_FULL ? max(0, capacity - window + 1) : 0;
    const int t_lo = lo / N, n_ctx = (capacity + N - 1) / N - t_lo;
    const int s0 = t_lo + static_cast<int>(static_cast<unsigned>(n_ctx) * split / num_splits);
    spec_base = max(0, s0 * N / PAGE_SIZE - 32);
    const int p = spec_base + lane;  // never past the table's width (zero-filled there)
    cp_async_4(sSpec + lane, trow + (p < table_stride ? p : 0), p < table_stride);
    cp_async_4(sSpec + 32 + lane, trow + (p + 32 < table_stride ? p + 32 : 0), p + 32 < table_stride);
    cp_async_commit();
  }
#else
  if (WS_ROWS ? wg > 0 : wg == 1) q_copies(tid - (WS_ROWS ? 128 * wg : 128));
#if TRACE
  if (tid == 128) TRACE_AT(13);  // consumer 0's first thread has issued its Q copies
#endif
  if (warp == 0 && lane == 0 && !SKIP_LOADS) {
    tma_prefetch_map(tma_k);
    tma_prefetch_map(tma_v);
  }
  const int slot = warp == 0 && !SKIP_LOADS ? trow[0] : 0;  // the arena slot, read as early
#endif

  // this CTA's tiles, as in attention_body: context tiles [t0, t1), then the block if last split
  const int P = max(0, min(len, capacity));
#if TRACE  // when the context length lands (stored past the barrier, after the fence)
  if (tid == 0) {
    asm volatile("" ::"r"(P));
    t_len = TRACE_TIME();
  }
#endif
  int t0, t1;
  split_tiles(P, mask_mode, window, split, num_splits, t0, t1);
  const int n_ctx_here = t1 - t0;
  const bool windowed = mask_mode != MASK_FULL;
  const int n_iter = n_ctx_here + (split == num_splits - 1 ? 1 : 0);

#else
  // this CTA's tiles, as in attention_body: context tiles [t0, t1), then the block if last split
  const int P = max(0, min(ctx_lens[b], capacity));
  const bool windowed = mask_mode != MASK_FULL;
  const int lo = windowed ? max(0, P - window + 1) : 0;
  const int t_lo = lo / N, t_hi = (P + N - 1) / N;
  const int n_ctx = t_hi - t_lo;
  const int t0 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * split / num_splits);
  const int t1 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * (split + 1) / num_splits);
  const int n_ctx_here = t1 - t0;
  const int n_iter = n_ctx_here + (split == num_splits - 1 ? 1 : 0);
  const int* trow = table + static_cast<long long>(b) * table_stride;

#endif
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, 1);  // the producer's arrival (plus the copies' bytes)
      mbar_init(empty + s, 128 * Q_STAGES);  // every thread of the consumer(s) that read the stage
    }
    mbar_init(qbar, 128 * Q_STAGES);
#if WS_PAIR
    mbar_init(pair_bar, 1);  // this arrival below and the peer's half of the rows in bytes
#endif
    mbar_init_fence();
#if WS_PAIR
    mbar_arrive_expect_tx(pair_bar, (DTILES + 1) * 64 * sizeof(float4));
#endif
  }
  __syncthreads();
#if WS_PAIR
  cluster_arrive_relaxed();  // this CTA's pair barrier is set up (the fence released it)
#endif
#if TRACE  // and when the CTA is past its barriers' set-up
  if (tid == 0) {
    TRACE_AT(12);
    if (t_len) TRACE_PUT(11, t_len);
  }
#endif

  if (wg == 0) {  // ---- producer
    regs_down<WS_PRODUCER_REGS>();
    if (warp != 0 || SKIP_LOADS) return;
#if !EARLY_IDS
    if (lane == 0) {
      tma_prefetch_map(tma_k);
      tma_prefetch_map(tma_v);
    }
#endif
#if PAGE_SIZE > 0
    // lane L holds the id of the split's page 32 c + L of chunk c (-1 past the context: its
    // boxes land as zeros), and the next chunk's in flight
    const int pbase = t0 * N / PAGE_SIZE, p_end = (P + PAGE_SIZE - 1) / PAGE_SIZE;
    auto chunk_ids = [&](int c) {
      const int p = pbase + 32 * c + lane;
      return p < p_end ? trow[p] : -1;
    };
#if EARLY_IDS  // chunk 0 from the early copies where they hold it
    const int shift = pbase - spec_base;
    cp_async_wait<0>();
    __syncwarp();
    int ids = shift >= 0 && shift <= 32 ? (pbase + lane < p_end ? sSpec[shift + lane] : -1)
                                        : chunk_ids(0);
#else
    int ids = chunk_ids(0);
#endif
    int chunk = 0, ids_next = chunk_ids(1);
#elif !EARLY_IDS
    const int slot = trow[0];
#endif
#if TRACE
    if (lane == 0) {  // once the ids (the arena: the slot) have landed
#if PAGE_SIZE > 0
      asm volatile("" ::"r"(ids));
#else
      asm volatile("" ::"r"(slot));
#endif
      TRACE_AT(1);
    }
#endif
    for (int v = 0; v < n_iter; ++v) {
      const int s = v % STAGES;
      if (v >= STAGES) mbar_wait(empty + s, (v / STAGES - 1) & 1);  // its last reader is done
      elem_t* dK = sK + s * TILE_ELEMS;
      elem_t* dV = sV + s * TILE_ELEMS;
      if (v < n_ctx_here) {
        const int kt = (t0 + v) * N;  // the tile's first key
#if PAGE_SIZE > 0
        const int pi = kt / PAGE_SIZE - pbase;  // its first page, within the split
        while (pi >= 32 * (chunk + 1)) {
          ++chunk;
          ids = ids_next;
          ids_next = chunk_ids(chunk + 1);
        }
#endif
        if (lane == 0) mbar_arrive_expect_tx(full + s, TILE_BYTES);
#pragma unroll
        for (int j = 0; j < BOXES; ++j) {
          const int kb = kt + j * BOX_ROWS;
#if PAGE_SIZE > 0
          const int c1 = kb % PAGE_SIZE, c2 = kvh, c3 = __shfl_sync(0xffffffffu, ids, (pi + j) & 31);
#else
          const int c1 = kvh, c2 = kb, c3 = slot;  // arena map: {d, head, token, slot}
#endif
          if (lane == 0) {
#pragma unroll
            for (int h = 0; h < D / 64; ++h) {
              const int off = h * HALF_ELEMS + j * BOX_ROWS * 64;
              tma_load_4d(dK + off, tma_k, full + s, h * 64, c1, c2, c3);
              tma_load_4d(dV + off, tma_v, full + s, h * 64, c1, c2, c3);
            }
          }
        }
      } else {
        // the block's own K/V [B, Qb, Hkv, D]: rows past qb zero-filled
        for (int c = lane; c < N * CPR; c += 32) {
          const int row = c / CPR, col = (c % CPR) * 8;
          const bool valid = row < qb;
          const long long off = ((static_cast<long long>(b) * qb + (valid ? row : 0)) * hkv + kvh) * D + col;
          cp_async_16(dK + tile_off(row, col), k_blk + off, valid);
          cp_async_16(dV + tile_off(row, col), v_blk + off, valid);
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();  // read next by wgmma (the async proxy)
        __syncwarp();
        if (lane == 0) mbar_arrive(full + s);
      }
    }
#if TRACE
    if (lane == 0) TRACE_AT(2);
#endif
    return;
  }

  // ---- consumers
  const int c = wg - 1, ctid = tid - 128 * wg, cwarp = ctid >> 5;
#if !EARLY_IDS  // (there issued before the context length is waited for)
  if (WS_ROWS || c == 0) q_copies(ctid);
#if TRACE
  if (c == 0 && ctid == 0) TRACE_AT(13);
#endif
#endif
  regs_up<WS_CONSUMER_REGS>();
  if (WS_ROWS || c == 0) {
    cp_async_wait<0>();
    fence_proxy_async();  // read by wgmma
    mbar_arrive(qbar);
  }
  const int g = lane >> 2, t4 = lane & 3;
  const int r0 = r_lo + query_row(cwarp, g), r1 = r0 + 8;
  const int i0 = min(r0 / group, qb - 1), i1 = min(r1 / group, qb - 1);
  mbar_wait(qbar, 0);
#if TRACE
  if (c == 0 && ctid == 0) TRACE_AT(3);
#endif
  // LEAN: shared-memory descriptors of the Q stage and of K and V stage 0, made once. A stage or
  // a k-step is an offset added to the address field (16-byte units, bits 0-13; every operand
  // lies inside the CTA's shared memory, so no sum carries out of it): two instructions a wgmma,
  // where rebuilding a descriptor from its pointer takes about ten.
  const unsigned long long dq = wgmma_desc_sw128(sQc, 16, 1024);
  const unsigned long long dk0 = wgmma_desc_sw128(sK, 16, 1024);
  const unsigned long long dv0 = wgmma_desc_sw128(sV, HALF_ELEMS * 2, 1024);
  // After a wgmma.wait_group: the compiler may not move reads of accumulator `x` above it
  auto acc_fence = [](auto& x) {
#pragma unroll
    for (auto& row : x) {
#pragma unroll
      for (float& e : row) asm volatile("" : "+f"(e)::"memory");
    }
  };
  float o[DTILES][4];
#pragma unroll
  for (int d = 0; d < DTILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
#if WS_OVERLAP
  // WS_OVERLAP: a tile's P V is issued with the next tile's S = Q K^T and runs while that tile's
  // softmax does; its stage is freed once it completes. So the consumer holds two stages at once
  // (this tile's K, the previous tile's V), and its chain per tile is the softmax alone.
  static_assert(LEAN, "WS_OVERLAP pipelines the lean consumer loop");
  unsigned pa[N / 16][4] = {};  // the previous tile's P (bf16 pairs), which its P V in flight reads
  int pend = -1;  // that tile's stage (-1: none yet)
  auto pv = [&](int stage) {  // O += P V of the tile in `stage`, P from pa
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk)
      WgMma<D>::rs_tb(o, pa[kk], dv0 + desc_offset(stage * TILE_ELEMS + kk * 16 * 64), 1);
    wgmma_commit();
  };
  auto pv_done = [&]() {  // the P V in flight completed: O readable, pa and its stage free
    wgmma_wait<0>();
    acc_fence(o);
#pragma unroll
    for (auto& row : pa) {
#pragma unroll
      for (unsigned& e : row) asm volatile("" : "+r"(e)::"memory");
    }
    if (pend >= 0) mbar_arrive(empty + pend);
  };
#endif

  for (int v = WS_ROWS ? 0 : c; v < n_iter; v += WS_ROWS ? 1 : WS_CONSUMERS) {
    const int s = v % STAGES;
    const elem_t* cK = sK + s * TILE_ELEMS;
    elem_t* cV = sV + s * TILE_ELEMS;
    if (!SKIP_LOADS) mbar_wait(full + s, (v / STAGES) & 1);
#if TRACE
    if (c == 0 && ctid == 0 && v == (WS_ROWS ? 0 : c)) TRACE_AT(4);
#endif
    const bool is_block = v >= n_ctx_here;
    const int kstart = (t0 + v) * N;
    // V rows at or past P in the context's last tile hold whatever the page (slot) holds: zero
    // them (their P is 0, and 0 * NaN would poison P V), visible to this consumer's wgmma
    // (WS_ROWS: to every consumer's, all of which read the tile)
    if (!SKIP_LOADS && !is_block && P - kstart < N) {
      const int first = P - kstart;
      for (int i = WS_ROWS ? tid - 128 : ctid; i < (N - first) * CPR; i += 128 * Q_STAGES) {
        const int r = first + i / CPR, col = (i % CPR) * 8;
        *reinterpret_cast<uint4*>(cV + tile_off(r, col)) = make_uint4(0u, 0u, 0u, 0u);
      }
      fence_proxy_async();
      named_barrier(WS_ROWS ? MERGE_BARRIER : 1 + c, 128 * Q_STAGES);
    }
    if (SKIP_COMPUTE) {
      mbar_arrive(empty + s);
      continue;
    }
    float sc[NTILES][4];
#if WS_OVERLAP
    // S's accumulator, which nothing but its wgmma writes: ptxas serialises every wgmma where an
    // ordinary instruction defines an accumulator while one is in flight (here the P V)
    float sacc[NTILES][4];
#else
    float (&sacc)[NTILES][4] = sc;
#endif
#pragma unroll
    for (int n = 0; n < NTILES; ++n) sacc[n][0] = sacc[n][1] = sacc[n][2] = sacc[n][3] = 0.f;
    wgmma_fence();
    if constexpr (LEAN) {
      const unsigned long long dk = dk0 + desc_offset(s * TILE_ELEMS);
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        WgMma<N>::ss(sacc, dq + desc_offset((ks >> 2) * 64 * 64 + (ks & 3) * 16),
                     dk + desc_offset((ks >> 2) * HALF_ELEMS + (ks & 3) * 16), ks > 0);
    } else {
#pragma unroll
      for (int ks = 0; ks < KSTEPS; ++ks)
        WgMma<N>::ss(sacc, wgmma_desc_sw128(sQc + (ks >> 2) * 64 * 64 + (ks & 3) * 16, 16, 1024),
                     wgmma_desc_sw128(cK + (ks >> 2) * HALF_ELEMS + (ks & 3) * 16, 16, 1024), ks > 0);
    }
    wgmma_commit();
#if WS_OVERLAP
    // the previous tile's P V behind this S (at the first tile a zero P on this tile's V, so
    // that no wgmma sits in a branch), then wait for the S alone
    pv(pend >= 0 ? pend : s);
    wgmma_wait<1>();
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("mov.b32 %0, %1;" : "=f"(sc[n][e]) : "f"(sacc[n][e]));
    }
#else
    wgmma_wait<0>();
    acc_fence(sc);
#endif

    // mask (only tiles some row cannot fully see), online softmax on raw scores: scale_log2 > 0,
    // so the scaled max is the max scaled, and exp2's FMA applies the scale. LEAN masks before
    // the max, behind one uniform branch, with no branch a score: the test in each score's update
    // compiles to 16 branches, each with its reconvergence, that every unmasked tile walks.
    const bool need_mask = is_block || kstart + N > P || (windowed && kstart <= P + qb - 1 - window);
    if (LEAN)
      mask_wgmma_scores(sc, is_block, need_mask, t4, i0, i1, qb, mask_mode, window, windowed,
                        kstart, P);
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!LEAN && need_mask) {
          const int col = n * 8 + 2 * t4 + (e & 1);
          const int i = e < 2 ? i0 : i1;
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
          if (!vis) sc[n][e] = -INFINITY;
        }
      }
      mx0 = fmaxf(mx0, fmaxf(sc[n][0], sc[n][1]));
      mx1 = fmaxf(mx1, fmaxf(sc[n][2], sc[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
    // LEAN: a row's running max moves only where the tile's passes it by more than
    // RESCALE_SLACK (drafter_attention.cu). Past the first tiles a max seldom moves that far, and
    // a warp none of whose rows moved skips O's rescale.
    const float tm0 = mx0 * scale_log2, tm1 = mx1 * scale_log2;
    const bool up0 = !LEAN || tm0 > m0 + RESCALE_SLACK, up1 = !LEAN || tm1 > m1 + RESCALE_SLACK;
    const float mn0 = LEAN ? (up0 ? tm0 : m0) : fmaxf(m0, tm0);
    const float mn1 = LEAN ? (up1 ? tm1 : m1) : fmaxf(m1, tm1);
    const float base0 = mn0 == -INFINITY ? 0.f : mn0;  // a fully masked row stays at zero
    const float base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float a0 = up0 ? fast_exp2(m0 - base0) : 1.f, a1 = up1 ? fast_exp2(m1 - base1) : 1.f;
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      sc[n][0] = fast_exp2(fmaf(sc[n][0], scale_log2, -base0));
      sc[n][1] = fast_exp2(fmaf(sc[n][1], scale_log2, -base0));
      sc[n][2] = fast_exp2(fmaf(sc[n][2], scale_log2, -base1));
      sc[n][3] = fast_exp2(fmaf(sc[n][3], scale_log2, -base1));
      ps0 += sc[n][0] + sc[n][1];
      ps1 += sc[n][2] + sc[n][3];
    }
    l0 = l0 * a0 + ps0;
    l1 = l1 * a1 + ps1;
#if WS_OVERLAP
    pv_done();  // O holds the previous tile's P V before its rescale
#endif
    if (!LEAN || __any_sync(0xffffffffu, up0 | up1)) {
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        o[d][0] *= a0;
        o[d][1] *= a0;
        o[d][2] *= a1;
        o[d][3] *= a1;
      }
    }
#if WS_OVERLAP
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      pa[kk][0] = pack2(sc[2 * kk][0], sc[2 * kk][1]);
      pa[kk][1] = pack2(sc[2 * kk][2], sc[2 * kk][3]);
      pa[kk][2] = pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[kk][3] = pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    pend = s;  // its P V goes out with the next tile's S (or after the loop)
#else
    wgmma_fence();  // o was rescaled by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const unsigned a[4] = {pack2(sc[2 * kk][0], sc[2 * kk][1]), pack2(sc[2 * kk][2], sc[2 * kk][3]),
                             pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                             pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
      WgMma<D>::rs_tb(o, a, LEAN ? dv0 + desc_offset(s * TILE_ELEMS + kk * 16 * 64)
                                 : wgmma_desc_sw128(cV + kk * 16 * 64, HALF_ELEMS * 2, 1024), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    acc_fence(o);
    mbar_arrive(empty + s);  // this thread is done with the stage
#endif
  }
#if WS_OVERLAP
  if (pend >= 0) {  // the last tile's P V
    wgmma_fence();  // o was rescaled and pa written by ordinary instructions
    pv(pend);
    pv_done();
  }
#endif
#if TRACE
  if (ctid == 0 && c == 0) TRACE_AT(5);
  if (ctid == 0 && c == WS_CONSUMERS - 1) TRACE_AT(7);
  if (ctid == 0 && c == 1) TRACE_AT(8);
#endif

  // ---- consumers 1.. hand their rows to consumer 0, each through the stage of its own last
  // tile (no tile is copied into it any more: that tile is one of the CTA's last WS_CONSUMERS),
  // or its first stage if it had none
  l0 += __shfl_xor_sync(0xffffffff, l0, 1);
  l0 += __shfl_xor_sync(0xffffffff, l0, 2);
  l1 += __shfl_xor_sync(0xffffffff, l1, 1);
  l1 += __shfl_xor_sync(0xffffffff, l1, 2);
  constexpr int HALF_D = DTILES / 2, QUARTER_D = DTILES / 4;
  // consumer k's hand-over: its O fragments in its stage's K (d < HALF_D) and V halves
  auto handover = [&](int k, bool v_half) {
    const int last = n_iter > k ? k + (n_iter - 1 - k) / WS_CONSUMERS * WS_CONSUMERS : k;
    return reinterpret_cast<float*>((v_half ? sV : sK) + (last % STAGES) * TILE_ELEMS);
  };
  // with 32-key stages (HO_CHUNKS 4) the second half of the fragments goes to another of the
  // consumer's stages (k or k + WS_CONSUMERS, whichever its last tile did not take)
  auto handover2 = [&](int k, bool v_half) {
    const int last = n_iter > k ? k + (n_iter - 1 - k) / WS_CONSUMERS * WS_CONSUMERS : k;
    const int s = last % STAGES == k ? k + WS_CONSUMERS : k;
    return reinterpret_cast<float*>((v_half ? sV : sK) + s * TILE_ELEMS);
  };
  // where fragment d's 4 x 128 floats go: K, V (2 chunks), or K, V, K2, V2 (4)
  auto ho_at = [&](int d, float* xK, float* xV, float* xK2, float* xV2) {
    if constexpr (HO_CHUNKS <= 2) {
      return (d < HALF_D ? xK : xV) + (d % HALF_D) * 4 * 128;
    } else {
      const int q = d / QUARTER_D;
      return (q == 0 ? xK : q == 1 ? xV : q == 2 ? xK2 : xV2) + (d % QUARTER_D) * 4 * 128;
    }
  };
  if constexpr (!WS_ROWS) {  // (WS_ROWS: each consumer stores its own rows)
    if (c > 0) {
      float* xK = handover(c, false);
      float* xV = handover(c, true);
      float* xK2 = HO_CHUNKS > 2 ? handover2(c, false) : nullptr;
      float* xV2 = HO_CHUNKS > 2 ? handover2(c, true) : nullptr;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
#pragma unroll
        for (int e = 0; e < 4; ++e) ho_at(d, xK, xV, xK2, xV2)[e * 128 + ctid] = o[d][e];
      }
      float* ml = sML + (c - 1) * 512;
      ml[ctid] = m0;
      ml[128 + ctid] = m1;
      ml[256 + ctid] = l0;
      ml[384 + ctid] = l1;
    }
    named_barrier(MERGE_BARRIER, 128 * WS_CONSUMERS);
    if (c > 0) return;
#if TRACE
    if (ctid == 0) TRACE_AT(9);
#endif
#pragma unroll 1
    for (int k = 1; k < WS_CONSUMERS; ++k) {
      float* xK = handover(k, false);
      float* xV = handover(k, true);
      float* xK2 = HO_CHUNKS > 2 ? handover2(k, false) : nullptr;
      float* xV2 = HO_CHUNKS > 2 ? handover2(k, true) : nullptr;
      const float* ml = sML + (k - 1) * 512;
      const float om0 = ml[ctid], om1 = ml[128 + ctid];
      const float mm0 = fmaxf(m0, om0), mm1 = fmaxf(m1, om1);
      const float base0 = mm0 == -INFINITY ? 0.f : mm0, base1 = mm1 == -INFINITY ? 0.f : mm1;
      const float a0 = fast_exp2(m0 - base0), b0 = fast_exp2(om0 - base0);
      const float a1 = fast_exp2(m1 - base1), b1 = fast_exp2(om1 - base1);
      l0 = l0 * a0 + ml[256 + ctid] * b0;
      l1 = l1 * a1 + ml[384 + ctid] * b1;
      m0 = mm0;
      m1 = mm1;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        const float* x = ho_at(d, xK, xV, xK2, xV2) + ctid;
        o[d][0] = o[d][0] * a0 + x[0] * b0;
        o[d][1] = o[d][1] * a0 + x[128] * b0;
        o[d][2] = o[d][2] * a1 + x[256] * b1;
        o[d][3] = o[d][3] * a1 + x[384] * b1;
      }
    }
  }

#if WS_PAIR
  // ---- the pair's merge, rows dealt: the first CTA keeps rows 0-31 (consumer warps 0 and 1), the
  // second rows 32-63; each sends the other's half and merges and stores its own
  const int pslot = ctid & 63;
  if ((cwarp < 2) == ((split & 1) != 0)) {
    cluster_wait();  // the peer's pair barrier is set up
    const unsigned peer = (split & 1) ^ 1;
    const unsigned dst = cluster_addr(smem_addr(pair_buf + pslot), peer);
    const unsigned bar = cluster_addr(smem_addr(pair_bar), peer);
#pragma unroll
    for (int d = 0; d < DTILES; ++d)
      st_async_v4(dst + d * 64 * sizeof(float4), make_float4(o[d][0], o[d][1], o[d][2], o[d][3]), bar);
    st_async_v4(dst + DTILES * 64 * sizeof(float4), make_float4(m0, m1, l0, l1), bar);
    return;
  }
  {
    mbar_wait_cluster(pair_bar, 0);
    const float4 ml = pair_buf[DTILES * 64 + pslot];
    const float mm0 = fmaxf(m0, ml.x), mm1 = fmaxf(m1, ml.y);
    const float base0 = mm0 == -INFINITY ? 0.f : mm0, base1 = mm1 == -INFINITY ? 0.f : mm1;
    const float a0 = fast_exp2(m0 - base0), b0 = fast_exp2(ml.x - base0);
    const float a1 = fast_exp2(m1 - base1), b1 = fast_exp2(ml.y - base1);
    l0 = l0 * a0 + ml.z * b0;
    l1 = l1 * a1 + ml.w * b1;
    m0 = mm0;
    m1 = mm1;
#pragma unroll
    for (int d = 0; d < DTILES; ++d) {
      const float4 x = pair_buf[d * 64 + pslot];
      o[d][0] = o[d][0] * a0 + x.x * b0;
      o[d][1] = o[d][1] * a0 + x.y * b0;
      o[d][2] = o[d][2] * a1 + x.z * b1;
      o[d][3] = o[d][3] * a1 + x.w * b1;
    }
  }
  const int out_split = split >> 1, out_splits = num_splits >> 1;  // the pairs' partials
#else
  const int out_split = split, out_splits = num_splits;
#endif

  // ---- epilogue (consumer 0; WS_ROWS: every consumer, its rows): the output, or this split's
  // partial and log-sum-exp
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const long long row_base = ((static_cast<long long>(out_split) * batch + b) * hkv + kvh) * M;
#if TRACE
  if (c == 0 && ctid == 0) TRACE_AT(10);
#endif
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? r1 : r0;
    if (r >= r_end) continue;
    const float inv = half ? inv1 : inv0;
    if (out_splits == 1) {
      elem_t* dst = out + ((static_cast<long long>(b) * qb + r / group) * hq + kvh * group + r % group) * D;
#pragma unroll
      for (int d = 0; d < DTILES; ++d)
        *reinterpret_cast<unsigned*>(dst + d * 8 + 2 * t4) =
            pack2(o[d][2 * half] * inv, o[d][2 * half + 1] * inv);
    } else {
      float* dst = o_part + (row_base + r) * D;
#pragma unroll
      for (int d = 0; d < DTILES; ++d)
        *reinterpret_cast<float2*>(dst + d * 8 + 2 * t4) =
            make_float2(o[d][2 * half] * inv, o[d][2 * half + 1] * inv);
      if (t4 == 0) {
        const float l = half ? l1 : l0, m = half ? m1 : m0;
        lse_part[row_base + r] = l > 0.f ? m + log2f(l) : -INFINITY;
      }
    }
  }
#if TRACE
  if (c == 0 && ctid == 0) TRACE_AT(6);
#endif
}
