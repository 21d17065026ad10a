// Drafter-block attention over a paged or arena KV cache, plus the split-KV combine and the
// context store. One source for both cache layouts: PAGE_SIZE > 0 selects paged addressing
// ([num_pages, Hkv, PAGE_SIZE, D] pages through a block table), PAGE_SIZE == 0 the dense arena
// ([num_slots, max_ctx, Hkv, D] through a slot id). Nothing else differs, so a paged-vs-arena
// timing measures paging and nothing else.
//
// Compile-time knobs (NVRTC -D): DTYPE_BF16 (1 bf16, 0 fp16), HEAD_DIM, PAGE_SIZE, TILE_N (keys
// per pipeline stage), NUM_WARPS (16 packed query rows per warp), STAGES (cp.async depth),
// Q_SMEM (Q kept in shared memory instead of registers), WGMMA (sm_90a: S = QK^T and O = PV on
// warpgroup MMAs reading K/V straight from shared memory, once per 64 rows instead of once per
// 16-row warp; K/V stages then use the no-swizzle core-matrix layout instead of padded rows),
// OVERLAP (with WGMMA only: software-pipelined tiles, S(v+1) = Q K(v+1)^T on the tensor cores
// while tile v's softmax runs; K and V in separate stage rings; see the #if OVERLAP block),
// TMA_LOADS (with OVERLAP only: lane 0 of each warp issues a share of each context tile's bulk
// tensor copies, which land already swizzled and complete on a shared-memory barrier, instead
// of every thread's cp.async; see the #if TMA_LOADS blocks), ROW_SPLIT (the Qb*G rows of a
// (request, KV head) dealt over ROW_SPLIT CTAs of ceil(Qb*G / ROW_SPLIT) rows each, which read
// the same K/V: laguna's 144 rows as 3 CTAs of one warpgroup instead of one of 3 warpgroups),
// LEAN (a cp.async context tile's copies from one base address where the tile lies in one page
// or the arena slot; scores kept raw until exp2, whose FMA applies the scale; with WARP_SPEC
// the consumers' leaner tile loop), TRIM (the software-pipelined wgmma loop trimmed as that ws
// one: descriptors advanced by offsets, the mask behind one branch a tile, O rescaled only when a
// row's max moves by more than 2^8), WARP_SPEC (with WS_CONSUMERS: a producer warpgroup issuing
// the TMA copies and 2-4 consumer warpgroups taking the tiles in turn, one CTA an SM:
// warp_specialized.cuh, whose body replaces this file's).
//
// One CTA = one (request b, KV head, KV split). Its Qb*G query rows (all query heads sharing the KV
// head, for every block position) form one M-tile, so each K/V byte is read once per split and
// fed to tensor cores (mma.m16n8k16, fp32 accumulate). Scores live in the log2 domain
// (scale * log2 e folded in), softmax is online (FlashAttention-2 style) per warp.
#include "common.cuh"
#include "variant.cuh"

#ifndef SKIP_COMPUTE
#define SKIP_COMPUTE 0  // diagnostic only: stream K/V through the pipeline, compute nothing
#endif
#ifndef SKIP_LOADS
#define SKIP_LOADS 0  // diagnostic only: the math on whatever the stages hold, no K/V loads
#endif
#ifndef ROW_SPLIT
#define ROW_SPLIT 1  // CTAs a (request, KV head, split) deals its packed query rows over
#endif
#ifndef TRIM
#define TRIM 0  // the pipelined wgmma path's tile loop trimmed as the ws consumers' lean one
#endif
#ifndef LEAN
#define LEAN 0  // fewer instructions a tile: see the LEAN blocks (issue, the softmax)
#endif
#ifndef WARP_SPEC
#define WARP_SPEC 0  // a producer warpgroup and WS_CONSUMERS consumer warpgroups: warp_specialized.cuh
#endif
// cache_offset, and the drafter_combine / drafter_store kernels of this module
#include "combine_store.cuh"
#include "params.cuh"
#if WGMMA
#include "wgmma.cuh"
#endif
#if TMA_LOADS
#include "tma.cuh"
#define DRAFTER_TMA_PARAMS , const TmaMap* __restrict__ tma_k, const TmaMap* __restrict__ tma_v
#else
#define DRAFTER_TMA_PARAMS
#endif

using namespace drafter;

// DRAFTER_LAYOUTS_ONLY: the load-mapping helpers below, host-callable, without the kernel
// (tests/drafter_layout_check.cu checks every tile chunk, page id and bank on the host).
#ifdef DRAFTER_LAYOUTS_ONLY
#define DRAFTER_HD __host__ __device__
#else
#define DRAFTER_HD __device__
#endif

namespace {
constexpr int D = HEAD_DIM;
constexpr int N = TILE_N;
constexpr int NT = NUM_WARPS * 32;
constexpr int ROW_STRIDE = D + 8;  // +16 bytes per smem row: ldmatrix rows hit distinct banks
constexpr int CPR = D / 8;  // 16-byte chunks per K/V row
constexpr int CHUNKS = N * CPR;
constexpr int RG8 = N / 8;  // 8-row groups per tile
constexpr int KSTEPS = D / 16;
constexpr int NTILES = N / 8;
constexpr int DTILES = D / 8;
#if WGMMA
// K/V stage layout: the canonical 128-byte-swizzle layout wgmma reads (K-major for K, MN-major
// for V; the same bytes serve both). Columns come in halves of 64 (128 bytes); a half is
// [N rows][128 B] with 16-byte chunk c of row r stored at chunk c ^ (r % 8), so 8-row x 128-byte
// atoms are 1024-byte aligned. A warp loads 4 whole 128-byte row segments per instruction (full
// L2 lines from HBM) and, thanks to the swizzle, writes them to shared memory without conflicts.
constexpr int TILE_ELEMS = N * D;
constexpr int HALF_ELEMS = N * 64;
constexpr bool CONTIG = false;
// Load iterations: CHUNKS / NT, or one more, predicated, where the thread count does not divide
// the chunk count (3 warpgroups, 384 threads: the padded 144-row CTAs of GQA 9, issue 12). A
// warp instruction loads 32 consecutive chunks (4 row segments of one half), so that predicate
// (tid + it * NT < CHUNKS in issue) is uniform across a warp: the warps whose unit
// warp + NUM_WARPS * it lies past the tile's last skip the last iteration whole.
constexpr int ITERS = (CHUNKS + NT - 1) / NT;
constexpr int QUADS = N / 4;  // 4-row groups per tile
static_assert(CHUNKS % 32 == 0 && D % 64 == 0, "wgmma tile loads need whole warps and halves");
constexpr bool GROUPED = QUADS % NUM_WARPS == 0;  // a thread's rows cover QUADS / NUM_WARPS quads
constexpr int QPW = GROUPED ? QUADS / NUM_WARPS : 1;  // quads a warp loads per 64-column half
// Pages smaller than a tile (PAGE_SIZE < N, WARP_ROWS): warp w loads the QPW consecutive quads
// [w*QPW, (w+1)*QPW) of each half instead of quads w, w + NUM_WARPS, ..., so its rows are one
// block of 4*QPW rows (16 at 64-key tiles and 4 warps) and a thread needs one page id per tile
// at pages >= 4*QPW, PG = 4*QPW / PAGE_SIZE below (2 at page 8). The same 4 x 128-byte row
// segments per warp instruction and the same swizzled, conflict-free destinations: only which
// warp loads which quad changes. Pages >= N keep the interleaved mapping (and their SASS).
constexpr bool WARP_ROWS = PAGE_SIZE > 0 && PAGE_SIZE < N && GROUPED;
constexpr int PG = (PAGE_SIZE == 0 || PAGE_SIZE >= N) ? 1
                   : WARP_ROWS ? (4 * QPW > PAGE_SIZE ? 4 * QPW / PAGE_SIZE : 1)
                               : ITERS;
DRAFTER_HD __forceinline__ int load_row(int tid, int it) {
  if (WARP_ROWS) return ((tid >> 5) * QPW + it % QPW) * 4 + ((tid >> 3) & 3);
  return (((tid >> 5) + NUM_WARPS * it) % QUADS) * 4 + ((tid >> 3) & 3);
}
DRAFTER_HD __forceinline__ int load_col(int tid, int it) {
  if (WARP_ROWS) return ((it / QPW) * 8 + (tid & 7)) * 8;
  return ((((tid >> 5) + NUM_WARPS * it) / QUADS) * 8 + (tid & 7)) * 8;
}
// The interleaved mapping's load iterations in steps of LOAD_QS (0 where it does not apply):
// warp < NUM_WARPS and NUM_WARPS | QUADS, so (warp + NUM_WARPS * it) % QUADS is the thread's
// first quad plus NUM_WARPS * (it % LOAD_QS), its half it / LOAD_QS; the compiler cannot see
// that (warp is a runtime value) and recomputes the modulo per copy. LEAN writes it out.
constexpr int LOAD_QS = GROUPED && !WARP_ROWS ? QUADS / NUM_WARPS : 0;
DRAFTER_HD __forceinline__ int tile_off(int row, int col) {
  const int c = col >> 3;
  return (c >> 3) * HALF_ELEMS + row * 64 + (((c & 7) ^ (row & 7)) << 3);
}
// first row of the page-id slot j of this thread (4 rows of a quad share a page: PS >= 8)
DRAFTER_HD __forceinline__ int page_row(int tid, int j) {
  if (WARP_ROWS) return (tid >> 5) * QPW * 4 + j * PAGE_SIZE;
  return GROUPED ? (((tid >> 5) + NUM_WARPS * j) % QUADS) * 4 : load_row(tid, j);
}
DRAFTER_HD __forceinline__ int page_slot(int it) {
  if (WARP_ROWS) return PG == 1 ? 0 : (it % QPW) * 4 / PAGE_SIZE;
  return PG == 1 ? 0 : (GROUPED ? it % PG : it);
}
// Page ids a thread holds between its lookup and the tile's issue: PGR. With WARP_ROWS a warp's
// PG ids are the same in every lane, so lane j (< PG) loads id j (one table load per thread and
// tile) and issue() takes id j from lane j with a shuffle. PG separate loads per thread, in flight
// across the math, made ptxas wait for them at the QK^T WARPGROUP.ARRIVE: every tile paid a
// table round trip (results/perf-notes.md, "Page 16 on the wgmma path").
// The interleaved mapping (not GROUPED: 12 warps, whose quads do not divide among them) has the
// same property at pages smaller than a tile: iteration j's rows are one quad of 4 rows, chosen
// by warp and j alone, so slot j's page id is warp-uniform too and lane j looks it up (LANE_IDS).
constexpr bool LANE_IDS = WARP_ROWS || (!GROUPED && PAGE_SIZE > 0 && PAGE_SIZE < N);
static_assert(PG <= 32, "one lane per page-id slot");
constexpr int PGR = LANE_IDS ? 1 : PG;
DRAFTER_HD __forceinline__ int lookup_row(int tid, int j) {
  return LANE_IDS ? page_row(tid, PG == 1 ? 0 : (tid & 31) % PG) : page_row(tid, j);
}
// OVERLAP at pages smaller than a tile: the page ids go through shared memory, not registers.
// Held in a register (an LDG at the end of iteration v for the tile issued at the end of v+1),
// ptxas made the first branch of iteration v+1, before S = QK^T, wait for that load: every tile
// paid a table round trip (+11-15% at page 16, +28% at page 8 on the H200; results/perf-notes.md,
// "Page ids through shared memory"). Instead lanes j < PG of each warp cp.async id j of tile t into
// ring slot t % ID_SLOTS with the loads of tile t - STAGES (cp.async group t - STAGES, complete
// at the top of iteration t - STAGES, where tile t is issued); every lane then reads its id with
// a shared load. Slots in use at iteration v: tiles v+STAGES (read) .. v+2*STAGES (written).
// LEAN at pages of a tile or more takes the ring too (lane 0 of each warp, the tile's one id):
// its copies' base address, computed from the id, otherwise made ptxas wait for the table load
// at the top of the iteration (measured: B=1 ctx 8k 3.6% slower than without LEAN).
constexpr bool ID_RING = OVERLAP && !TMA_LOADS && (LANE_IDS || (LEAN && PAGE_SIZE >= N));
constexpr int ID_SLOTS = STAGES + 1;
#if TMA_LOADS
// TMA_LOADS: a context tile is BOXES boxes of BOX_ROWS keys per 64-column half (one box per page at
// pages smaller than a tile), each landing in the layout above: the map's 128-byte swizzle is
// the same XOR of chunk and row % 8 within 1024-byte atoms. K and V of a tile complete on one
// barrier, TILE_BYTES in all (boxes past the tensor's bounds are zero-filled and count too).
constexpr int BOX_ROWS = (PAGE_SIZE > 0 && PAGE_SIZE < N) ? PAGE_SIZE : N;
constexpr int BOXES = N / BOX_ROWS;
constexpr unsigned TILE_BYTES = 2u * N * D * sizeof(elem_t);
static_assert((OVERLAP || WARP_SPEC) && !Q_SMEM,
              "TMA feeds the pipelined wgmma path (Q in registers) or the warp-specialised one");
// A tile's COPIES box copies (K and V, each 64-column half, each box) are spread over ISSUERS
// warps, lane 0 of warp w issuing copies w, w + ISSUERS, ...: one warp per SM sub-partition,
// so no one math warp spends a tile's worth of issue slots (16 copies at page 16, 32 at page 8)
// while its warpgroup waits for it at the next wgmma. Each issuing warp arrives on the stage's
// barrier with the bytes of its own copies (barriers count ISSUERS arrivals).
constexpr int COPIES = BOXES * 2 * (D / 64);
constexpr int ISSUERS = NUM_WARPS < COPIES ? NUM_WARPS : COPIES;
static_assert(COPIES % ISSUERS == 0, "every issuing warp takes the same number of copies");
// page ids travel in chunks of IDS per issuing warp; a tile's pages never straddle two chunks
constexpr int IDS = 16;
static_assert(PAGE_SIZE == 0 || PAGE_SIZE >= N || (BOXES <= IDS && IDS % BOXES == 0),
              "a tile's pages fit one page-id chunk");
#endif
#else
constexpr int TILE_ELEMS = N * ROW_STRIDE;
// Load mapping. CONTIG: CPR threads share a row (coalesced), and each thread walks ITERS
// consecutive rows, so for page sizes >= ITERS a thread's rows sit in one page: one page-id
// lookup per thread per tile. Otherwise rows are strided by NT / CPR.
constexpr bool CONTIG = NT % CPR == 0 && N % (NT / CPR) == 0;
constexpr int ITERS = CONTIG ? N / (NT / CPR) : (CHUNKS + NT - 1) / NT;
// Page ids a thread needs per tile: one when its rows never cross a page, else one per row.
constexpr int PG = (PAGE_SIZE == 0 || PAGE_SIZE >= N || (CONTIG && PAGE_SIZE >= ITERS)) ? 1 : ITERS;
DRAFTER_HD __forceinline__ int load_row(int tid, int it) {
  return CONTIG ? (tid / CPR) * ITERS + it : (tid + it * NT) / CPR;
}
DRAFTER_HD __forceinline__ int load_col(int tid, int it) { return (tid % CPR) * 8; }
constexpr int LOAD_QS = 0;  // rows are affine in the iteration already (CONTIG)
DRAFTER_HD __forceinline__ int tile_off(int row, int col) { return row * ROW_STRIDE + col; }
DRAFTER_HD __forceinline__ int page_row(int tid, int j) {
  return PG == 1 ? load_row(tid, 0) : load_row(tid, j);
}
DRAFTER_HD __forceinline__ int page_slot(int it) { return PG == 1 ? 0 : it; }
constexpr int PGR = PG;
DRAFTER_HD __forceinline__ int lookup_row(int tid, int j) { return page_row(tid, j); }
constexpr bool ID_RING = false;
constexpr int ID_SLOTS = 1;
static_assert(!TMA_LOADS, "TMA needs the wgmma path");
#endif

constexpr int LOAD_QS_1 = LOAD_QS > 0 ? LOAD_QS : 1;  // a divisor where LOAD_QS is 0
// LEAN's copies: load_row / load_col written out as affine in `it` where LOAD_QS applies
// (tests/drafter_layout_check.cu checks they agree for every thread and iteration)
DRAFTER_HD __forceinline__ int lean_row(int tid, int it) {
  return LOAD_QS ? load_row(tid, 0) + 4 * NUM_WARPS * (it % LOAD_QS_1) : load_row(tid, it);
}
DRAFTER_HD __forceinline__ int lean_col(int tid, int it) {
  return LOAD_QS ? load_col(tid, 0) + 64 * (it / LOAD_QS_1) : load_col(tid, it);
}

// Packed query row of a thread's accumulator rows: half 0 holds row g = lane / 4 of its warp's
// 16 (this), half 1 row g + 8 (the m16n8 C layout; on the wgmma path warp w's rows are rows
// 16 (w % 4) .. +15 of its warpgroup's 64, the same packed rows). Rows >= M = Qb * G (the
// padding of the last warp or warpgroup) hold zero Q and are never stored. With ROW_SPLIT the
// CTA's rows start at its share's first row (`r_lo`) and rows >= its share's end are padding.
DRAFTER_HD __forceinline__ int query_row(int warp, int g) { return warp * 16 + g; }
// The packed rows [lo, end) of CTA `part` of the `parts` CTAs a (request, KV head, split) deals
// its M rows over (ROW_SPLIT): ceil(M / parts) each, the last one the rest.
DRAFTER_HD __forceinline__ void row_share(int M, int parts, int part, int& lo, int& end) {
  const int share = (M + parts - 1) / parts;
  lo = part * share;
  end = min(M, lo + share);
}

static_assert(D % 16 == 0 && N % 16 == 0, "tile shapes must be multiples of 16");
static_assert(NT % CPR == 0, "a thread must keep its column across load iterations");
static_assert(PAGE_SIZE == 0 || (PAGE_SIZE & (PAGE_SIZE - 1)) == 0, "page size: power of two");

enum { MASK_FULL = 0, MASK_SLIDING = 1, MASK_SLIDING_CAUSAL = 2 };

// The context tiles [t0, t1) of split `split` of `num_splits` for a context of P keys: the
// tiles any row can see (row i sees context keys kp > P + i - window under a windowed mask; row
// 0 has the leftmost edge, so a windowed layer costs O(window), not O(context)), dealt evenly.
// (attention_body and ws without EARLY_IDS spell it out inline: their machine code is what the
// profile's rows were measured on.)
DRAFTER_HD __forceinline__ void split_tiles(int P, int mask_mode, int window, int split,
                                            int num_splits, int& t0, int& t1) {
  const int lo = mask_mode != MASK_FULL ? max(0, P - window + 1) : 0;
  const int t_lo = lo / N, n_ctx = (P + N - 1) / N - t_lo;
  t0 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * split / num_splits);
  t1 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * (split + 1) / num_splits);
}

#if WGMMA
template <int NN>
struct WgMma;
template <>
struct WgMma<32> {
  static __device__ __forceinline__ void rs(float (&d)[4][4], const unsigned (&a)[4], unsigned long long b, int acc) { wgmma_rs_n32(d, a, b, acc); }
  static __device__ __forceinline__ void rs_tb(float (&d)[4][4], const unsigned (&a)[4], unsigned long long b, int acc) { wgmma_rs_n32_tb(d, a, b, acc); }
  static __device__ __forceinline__ void ss(float (&d)[4][4], unsigned long long a, unsigned long long b, int acc) { wgmma_ss_n32(d, a, b, acc); }
};
template <>
struct WgMma<64> {
  static __device__ __forceinline__ void rs(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b, int acc) { wgmma_rs_n64(d, a, b, acc); }
  static __device__ __forceinline__ void rs_tb(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b, int acc) { wgmma_rs_n64_tb(d, a, b, acc); }
  static __device__ __forceinline__ void ss(float (&d)[8][4], unsigned long long a, unsigned long long b, int acc) { wgmma_ss_n64(d, a, b, acc); }
};
template <>
struct WgMma<128> {
  static __device__ __forceinline__ void rs(float (&d)[16][4], const unsigned (&a)[4], unsigned long long b, int acc) { wgmma_rs_n128(d, a, b, acc); }
  static __device__ __forceinline__ void rs_tb(float (&d)[16][4], const unsigned (&a)[4], unsigned long long b, int acc) { wgmma_rs_n128_tb(d, a, b, acc); }
  static __device__ __forceinline__ void ss(float (&d)[16][4], unsigned long long a, unsigned long long b, int acc) { wgmma_ss_n128(d, a, b, acc); }
};
static_assert(NUM_WARPS % 4 == 0, "wgmma needs whole warpgroups");

// Masks a tile of wgmma scores (the accumulator layout: NT8 groups of 8 columns, 2 a thread,
// rows i0 and i1), the trimmed loops' way (ws's LEAN, the pipelined path's TRIM): one uniform
// branch a tile, no branch a score. A test inside each score's update compiles to a branch and
// its reconvergence per score, which every unmasked tile walks. The block's own keys follow the
// mask mode; context keys past the context or left of the row's window are cut.
template <int NT8>
__device__ __forceinline__ void mask_wgmma_scores(float (&sc)[NT8][4], bool is_block,
                                                  bool need_mask, int t4, int i0, int i1, int qb,
                                                  int mask_mode, int window, bool windowed,
                                                  int kstart, int P) {
  if (is_block) {
#pragma unroll
    for (int n = 0; n < NT8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n * 8 + 2 * t4 + (e & 1), dj = (e < 2 ? i0 : i1) - col;
        const bool in_window = mask_mode == MASK_SLIDING ? (dj < window) & (-dj < window)
                                                         : (dj >= 0) & (dj < window);
        if (!((col < qb) & ((mask_mode == MASK_FULL) | in_window))) sc[n][e] = -INFINITY;
      }
    }
  } else if (need_mask) {
#pragma unroll
    for (int n = 0; n < NT8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kp = kstart + n * 8 + 2 * t4 + (e & 1), i = e < 2 ? i0 : i1;
        if (!((kp < P) & (!windowed | (kp > P + i - window)))) sc[n][e] = -INFINITY;
      }
    }
  }
}
#endif

// The trimmed loops' running max (ws's LEAN, TRIM): how far, in log2 units, a row's tile max may
// pass it before it moves. Against a stale max a probability is at most 2^RESCALE_SLACK, far
// inside fp32 and the 16-bit P, and O and l share one max, so the result is the same.
constexpr float RESCALE_SLACK = 8.f;

}  // namespace

#if !defined(DRAFTER_LAYOUTS_ONLY) && WARP_SPEC
#include "warp_specialized.cuh"
#if WS_PAIR
#define WS_CLUSTER __cluster_dims__(2, 1, 1)  // a split pair a cluster (warp_specialized.cuh)
#else
#define WS_CLUSTER
#endif
extern "C" __global__ void WS_CLUSTER __launch_bounds__(WS_THREADS, 1)
    drafter_attention(DRAFTER_KERNEL_PARAMS, const __grid_constant__ TmaMap tma_k,
                      const __grid_constant__ TmaMap tma_v) {
  ws_attention_body(DRAFTER_BODY_ARGS, &tma_k, &tma_v);
}
#elif !defined(DRAFTER_LAYOUTS_ONLY)
// The kernel's body takes the fields as parameters: __restrict__ holds for parameters only.
__device__ __forceinline__ void attention_body(
    const elem_t* __restrict__ q, const elem_t* __restrict__ k_blk, const elem_t* __restrict__ v_blk,
    const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
    const int* __restrict__ table, const int* __restrict__ ctx_lens, elem_t* __restrict__ out,
    float* __restrict__ o_part, float* __restrict__ lse_part, int qb, int hq, int hkv, int group,
    int table_stride, int capacity, int loc_stride, int mask_mode, int window, float scale_log2
    DRAFTER_TMA_PARAMS) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // swizzle atoms: 1024 B
  // V stages: OVERLAP keeps V(v-1) in use one tile longer than K (see the #if OVERLAP block).
  // (Function-local: a namespace-scope constant would add a symbol to every cubin.)
  constexpr int V_STAGES = STAGES + (OVERLAP ? 1 : 0);
  elem_t* sK = reinterpret_cast<elem_t*>(smem_raw);  // [STAGES][N][ROW_STRIDE]
  elem_t* sV = sK + STAGES * TILE_ELEMS;  // [V_STAGES][N][ROW_STRIDE]
  // ID_RING: [ID_SLOTS][NUM_WARPS][PG] page ids after the stages and Q; TMA: [STAGES] barriers
  int* sIds = reinterpret_cast<int*>(sV + V_STAGES * TILE_ELEMS + (Q_SMEM ? NUM_WARPS * 16 * ROW_STRIDE : 0));

  // ROW_SPLIT: the ROW_SPLIT CTAs of one split are adjacent in x, so they run together and
  // their common K/V tiles come from L2 after the first read (ROW_SPLIT 1 folds all of it away)
  const int split = blockIdx.x / ROW_SPLIT, num_splits = gridDim.x / ROW_SPLIT;
  const int kvh = blockIdx.y, b = blockIdx.z, batch = gridDim.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int M = qb * group;
  int r_lo = 0, r_end = M;  // this CTA's rows
  if (ROW_SPLIT > 1) row_share(M, ROW_SPLIT, static_cast<int>(blockIdx.x % ROW_SPLIT), r_lo, r_end);

  // ---- this CTA's share of the context: tiles [t0, t1), plus the block's own K/V if last split
  const int P = max(0, min(ctx_lens[b], capacity));
  const bool windowed = mask_mode != MASK_FULL;
  // Row i sees context keys kp > P + i - window; row 0 has the leftmost edge. Tiles left of it
  // are skipped, so a windowed layer costs O(window), not O(context).
  const int lo = windowed ? max(0, P - window + 1) : 0;
  const int t_lo = lo / N, t_hi = (P + N - 1) / N;
  const int n_ctx = t_hi - t_lo;
  const int t0 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * split / num_splits);
  const int t1 = t_lo + static_cast<int>(static_cast<long long>(n_ctx) * (split + 1) / num_splits);
  const int n_ctx_here = t1 - t0;
  const bool has_block = split == num_splits - 1;
  const int n_iter = n_ctx_here + (has_block ? 1 : 0);
  const int* trow = table + static_cast<long long>(b) * table_stride;

  // ---- Q: A operand of S = Q K^T. Kept in registers, or (Q_SMEM, for many-warp CTAs whose
  // per-thread register budget is small) in shared memory behind the K/V stages, re-read per tile.
  const int g = lane >> 2, t4 = lane & 3;
  const int r0 = r_lo + query_row(warp, g), r1 = r0 + 8;
  const int i0 = min(r0 / group, qb - 1), i1 = min(r1 / group, qb - 1);
#if Q_SMEM
  elem_t* sQ = sV + V_STAGES * TILE_ELEMS;  // [NUM_WARPS*16][ROW_STRIDE]
  for (int c = tid; c < NUM_WARPS * 16 * CPR; c += NT) {
    const int r = r_lo + c / CPR, col = (c % CPR) * 8;
    const int i = min(r / group, qb - 1);
    const elem_t* src = q + ((static_cast<long long>(b) * qb + i) * hq + kvh * group + r % group) * D + col;
    cp_async_16(sQ + (r - r_lo) * ROW_STRIDE + col, r < r_end ? src : q, r < r_end);
  }
  // committed together with the first K/V group; visible after the first wait + barrier
#else
  unsigned qf[KSTEPS][4];
  {
    const elem_t* q0 = q + ((static_cast<long long>(b) * qb + i0) * hq + kvh * group + r0 % group) * D;
    const elem_t* q1 = q + ((static_cast<long long>(b) * qb + i1) * hq + kvh * group + r1 % group) * D;
    const bool v0 = r0 < r_end, v1 = r1 < r_end;
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int c = ks * 16 + 2 * t4;
      qf[ks][0] = v0 ? *reinterpret_cast<const unsigned*>(q0 + c) : 0u;
      qf[ks][1] = v1 ? *reinterpret_cast<const unsigned*>(q1 + c) : 0u;
      qf[ks][2] = v0 ? *reinterpret_cast<const unsigned*>(q0 + c + 8) : 0u;
      qf[ks][3] = v1 ? *reinterpret_cast<const unsigned*>(q1 + c + 8) : 0u;
    }
  }
#endif

  // ---- loaders. Tile v < n_ctx_here is context tile t0 + v; tile n_ctx_here is the block.
  auto lookup = [&](int v, int (&pg)[PGR]) {
    if (SKIP_LOADS || v >= n_ctx_here) return;
#if PAGE_SIZE > 0
    const int kstart = (t0 + v) * N;
#pragma unroll
    for (int j = 0; j < PGR; ++j) {
      // a slot's first row; its page holds all rows of the slot (kstart < P when PS >= N)
      const int kp = kstart + (PAGE_SIZE >= N ? 0 : lookup_row(tid, j));
      pg[j] = kp < P ? trow[kp / PAGE_SIZE] : 0;  // never read table entries past P
    }
#else
    pg[0] = trow[0];  // the slot
#endif
  };
  // ID_RING: the page ids of tile t into ring slot t % ID_SLOTS (lanes j < PG, id j of the warp)
  auto fetch_ids = [&](int t) {
#if PAGE_SIZE > 0
    if (!ID_RING || SKIP_LOADS || t >= n_ctx_here || lane >= PG) return;
    const int kp = (t0 + t) * N + (PAGE_SIZE >= N ? 0 : page_row(tid, lane));
    cp_async_4(sIds + ((t % ID_SLOTS) * NUM_WARPS + warp) * PG + lane, trow + kp / PAGE_SIZE,
               kp < P);  // never read table entries past P (zero-filled instead)
#endif
  };
  auto issue = [&](int v, int kstage, int vstage, const int (&pgr)[PGR]) {
    if (SKIP_LOADS) return;
#if LEAN
    // LEAN, a context tile that lies in one page (pages of a tile or more) or in the arena slot:
    // one base address a tile and a fixed per-thread offset a copy, which fold into the copies'
    // address arithmetic, instead of the page-id select, cache_offset and the block-or-context
    // choice per copy (about 45 instructions for every 2 copies, measured in the SASS).
    if ((PAGE_SIZE == 0 || PAGE_SIZE >= N) && v < n_ctx_here) {
      const int kstart = (t0 + v) * N;
      const long long base = cache_offset(pgr[0], kvh, hkv, kstart, loc_stride);
      const elem_t* tK = k_cache + base;
      const elem_t* tV = v_cache + base;
      const int key_stride = PAGE_SIZE > 0 ? D : hkv * D;  // elements from one key to the next
      // the thread's first copy; the others at offsets that are constants where LOAD_QS applies
      const int row0 = lean_row(tid, 0), col0 = lean_col(tid, 0);
      const int rows_left = P - kstart - row0;  // copies of rows at or past it are zero-filled
      const elem_t* gK = tK + row0 * key_stride + col0;
      const elem_t* gV = tV + row0 * key_stride + col0;
      elem_t* dK = sK + kstage * TILE_ELEMS + tile_off(row0, col0);
      elem_t* dV = sV + vstage * TILE_ELEMS + tile_off(row0, col0);
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        if (CONTIG || CHUNKS % NT == 0 || tid + it * NT < CHUNKS) {
          const int dr = lean_row(tid, it) - row0, dc = lean_col(tid, it) - col0;
          const bool valid = dr < rows_left;
          // A page holds every row of the tile, so any row's address is inside the pool; the
          // arena's last slot can end inside the tile: rows past the context point at row 0.
          const int off = (PAGE_SIZE > 0 || valid ? dr * key_stride : -row0 * key_stride) + dc;
          // row0 + dr keeps row0's row % 8 (dr is a multiple of 8), so the swizzle is row0's
          const int soff = tile_off(row0 + dr, col0 + dc) - tile_off(row0, col0);
          cp_async_16(dK + soff, gK + off, valid);
          cp_async_16(dV + soff, gV + off, valid);
        }
      }
      return;
    }
#endif
#if WGMMA && PAGE_SIZE > 0 && PAGE_SIZE < TILE_N
    int pg[PG];
#pragma unroll
    for (int j = 0; j < PG; ++j) {
      if constexpr (PGR == PG) pg[j] = pgr[j];
      else pg[j] = __shfl_sync(0xffffffffu, pgr[0], j);  // id j from lane j; every lane issues
    }
#else
    const int(&pg)[PG] = pgr;
#endif
    elem_t* dK = sK + kstage * TILE_ELEMS;
    elem_t* dV = sV + vstage * TILE_ELEMS;
    const bool is_block = v >= n_ctx_here;
    const int kstart = (t0 + v) * N;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (CONTIG || CHUNKS % NT == 0 || tid + it * NT < CHUNKS) {
        const int row = load_row(tid, it), col = load_col(tid, it);
        long long off;
        bool valid;
        const elem_t *baseK, *baseV;
        if (is_block) {
          valid = row < qb;
          off = ((static_cast<long long>(b) * qb + (valid ? row : 0)) * hkv + kvh) * D + col;
          baseK = k_blk;
          baseV = v_blk;
        } else {
          const int kp = kstart + row;
          valid = kp < P;
          off = valid ? cache_offset(pg[page_slot(it)], kvh, hkv, kp, loc_stride) + col : 0;
          baseK = k_cache;
          baseV = v_cache;
        }
        cp_async_16(dK + tile_off(row, col), baseK + off, valid);
        cp_async_16(dV + tile_off(row, col), baseV + off, valid);
      }
    }
  };

  float o[DTILES][4];
#pragma unroll
  for (int d = 0; d < DTILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

#if OVERLAP
  // ---- OVERLAP (sm_90a wgmma only): the tiles software-pipelined inside the warpgroup.
  // Iteration v: barrier; S(v+1) = Q K(v+1)^T issued as async wgmmas; tile v's masking and
  // online softmax on the CUDA cores while the tensor cores run S(v+1); P(v) V(v) issued, queued
  // behind S(v+1); one wgmma.wait_group 0 at the end for both. Two S register sets: `sc` (tile
  // v, in the softmax) and `sn` (tile v+1, in flight). The cp.async loads of tile v + STAGES go
  // right after the S(v+1) issue (OVERLAP 1: a tile's K lands STAGES - 1 iterations ahead of its
  // S, as without OVERLAP) or after the P V issue (OVERLAP 2: the load issue hides P V too, but
  // the loads run about one iteration less ahead).
  //
  // S(v+1) needs K(v+1) while V(v) is still in use, so V gets one stage more than K: K(t) sits
  // in K stage t % STAGES, V(t) in V stage t % (STAGES + 1), and cp.async group t loads both of
  // tile t. Iteration v waits for group v+1 (cp.async.wait_group STAGES - 2, as without
  // OVERLAP, because it issues tile v + STAGES instead of v + STAGES - 1) and, after the
  // barrier, refills K stage v % STAGES (S(v) done) and V stage (v-1) % (STAGES + 1)
  // (P(v-1)V(v-1) done): every warpgroup waited for both at the end of iteration v-1. S(v+1)
  // reads K stage (v+1) % STAGES and P(v)V(v) V stage v % (STAGES + 1), neither of them refilled.
  static_assert(WGMMA && STAGES >= 2 && (OVERLAP == 1 || OVERLAP == 2),
                "OVERLAP 1 or 2 needs the wgmma path and at least two stages");
  // Register fence: the compiler may not move accesses of `x` across it (nor across the
  // wgmma.wait_group before it), so nothing reads an accumulator a wgmma still writes.
  auto reg_fence = [](float& x) { asm volatile("" : "+f"(x)::"memory"); };

#if TMA_LOADS
  // ---- TMA_LOADS: lane 0 of each of the first ISSUERS warps issues its share of a context
  // tile's copies; tile t completes on barrier t % STAGES (phase t / STAGES), armed when its
  // loads are issued: at iteration t - STAGES, after the barrier at which every thread has
  // passed its wait for tile t - STAGES. The block's own tile (last) still goes by cp.async,
  // with a cp.async.wait_group before use.
  unsigned long long* bars = reinterpret_cast<unsigned long long*>(sIds);
  const bool issuer = !SKIP_LOADS && warp < ISSUERS && n_ctx_here > 0;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) mbar_init(bars + s, ISSUERS);
    mbar_init_fence();
  }
  if (issuer && lane == 0) {
    tma_prefetch_map(tma_k);
    tma_prefetch_map(tma_v);
  }
  __syncthreads();
#if PAGE_SIZE > 0
  // Page ids, IDS at a time, through shared memory: lane L < IDS of each issuing warp cp.asyncs
  // the id of the split's page IDS c + L of chunk c into its own buffer c % 2, one chunk ahead
  // of its use. (An id loaded into a register in the loop made ptxas wait for it at the next
  // wgmma fence: a table round trip per chunk.) Pages at or past P are never read from the
  // table: their boxes get page -1, out of bounds, zero-filled.
  int* sPid = reinterpret_cast<int*>(bars + STAGES) + warp * 2 * IDS;  // [ISSUERS][2][IDS]
  const int pbase = t0 * N / PAGE_SIZE, p_end = (P + PAGE_SIZE - 1) / PAGE_SIZE;
  auto fetch_chunk = [&](int c) {
    const int pidx = pbase + IDS * c + lane;
    if (lane < IDS)
      cp_async_4(sPid + (c & 1) * IDS + lane, trow + (pidx < p_end ? pidx : 0), pidx < p_end);
  };
  int chunk = 0;
  if (issuer) {
    fetch_chunk(0);
    fetch_chunk(1);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
  }
#else
  const int slot = issuer ? trow[0] : 0;
#endif
  auto issue_tma = [&](int t, int kstage, int vstage) {
    if (!issuer) return;
    unsigned long long* bar = bars + t % STAGES;
    const int kt = (t0 + t) * N;  // the tile's first key
#if PAGE_SIZE > 0
    // Entering chunk c (the tile's first page in it): its ids (fetched on entering c - 1)
    // have landed; chunk c + 1 goes into c - 1's buffer.
    if (kt / PAGE_SIZE - pbase >= IDS * (chunk + 1)) {
      ++chunk;
      cp_async_wait<0>();
      __syncwarp();
      fetch_chunk(chunk + 1);
      cp_async_commit();
    }
#endif
    if (lane != 0) return;
    mbar_arrive_expect_tx(bar, TILE_BYTES / ISSUERS);
#pragma unroll
    for (int k = 0; k < COPIES / ISSUERS; ++k) {
      // copy i: box j, 64-column half h, K or V
      const int i = warp + k * ISSUERS, j = i % BOXES, h = (i / BOXES) >> 1;
      const bool is_v = (i / BOXES) & 1;
      const int kb = kt + j * BOX_ROWS;
#if PAGE_SIZE > 0
      const int c1 = kb % PAGE_SIZE, c2 = kvh;
      const int c3 = kb < P ? sPid[(chunk & 1) * IDS + (kb / PAGE_SIZE - pbase) % IDS] : -1;
#else
      const int c1 = kvh, c2 = kb, c3 = slot;  // arena map: {d, head, token, slot}
#endif
      elem_t* dst = (is_v ? sV + vstage * TILE_ELEMS : sK + kstage * TILE_ELEMS) + h * HALF_ELEMS +
                    j * BOX_ROWS * 64;
      tma_load_4d(dst, is_v ? tma_v : tma_k, bar, h * 64, c1, c2, c3);
    }
  };
  int no_ids[PGR] = {};
  // tile t: a context tile by TMA, the block's by cp.async (its rows past qb zero-filled)
  auto load_tile = [&](int t) {
    if (t < n_ctx_here) {
      issue_tma(t, t % STAGES, t % V_STAGES);
    } else if (t < n_iter) {
      issue(t, t % STAGES, t % V_STAGES, no_ids);
      cp_async_commit();
    }
  };
  auto wait_tile = [&](int t) {
    if (SKIP_LOADS || t >= n_iter) return;
    if (t < n_ctx_here) mbar_wait(bars + t % STAGES, (t / STAGES) & 1);
    else cp_async_wait<0>();
  };
  // The rows of a context tile at or past P hold whatever the page (or the arena slot) holds:
  // zero their V rows (P is 0 there, and 0 * NaN would poison P.V). Called after the barrier
  // that follows the tile's wait; the next iteration's fence and barrier publish the zeros to
  // the P.V wgmma. Only the last context tile of a request can have such rows.
  auto zero_tail = [&](int t) {
    if (SKIP_LOADS || t >= n_ctx_here) return;
    const int first = P - (t0 + t) * N;
    if (first >= N) return;
    elem_t* dV = sV + (t % V_STAGES) * TILE_ELEMS;
    for (int c = tid; c < (N - first) * CPR; c += NT) {
      const int r = first + c / CPR, col = (c % CPR) * 8;
      *reinterpret_cast<uint4*>(dV + tile_off(r, col)) = make_uint4(0u, 0u, 0u, 0u);
    }
  };
#pragma unroll
  for (int s = 0; s < STAGES; ++s) load_tile(s);
#else
  // Prologue: tiles 0..STAGES-1, every page-id lookup first where one id per tile suffices
  int pg[PGR];
  if (PGR == 1) {
    int pg_pro[STAGES][PGR];  // PGR == 1 here
#pragma unroll
    for (int s = 0; s < STAGES; ++s)
      if (s < n_iter) lookup(s, pg_pro[s]);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if (s < n_iter) issue(s, s, s, pg_pro[s]);
      fetch_ids(s + STAGES);  // ID_RING: group s carries the ids of tile s + STAGES
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if (s < n_iter) {
        lookup(s, pg);
        issue(s, s, s, pg);
      }
      cp_async_commit();
    }
  }
  if (!ID_RING && STAGES < n_iter) lookup(STAGES, pg);
#endif

  // Every warpgroup has query rows here (NUM_WARPS = 4 * ceil(M / 64) on this path, whole
  // warpgroups; the rows past M of the last one are zero Q rows, never stored), so no warp
  // skips the math: a warp-dependent branch around wgmmas in flight makes ptxas
  // serialize them (C7519).
  float sc[NTILES][4], sn[NTILES][4];
#pragma unroll
  for (int n = 0; n < NTILES; ++n) sn[n][0] = sn[n][1] = sn[n][2] = sn[n][3] = 0.f;
  // S(t) = Q K(t)^T into sn, committed as one wgmma group (waited for by the caller)
  auto issue_s = [&](int t) {
    const elem_t* cK = sK + (t % STAGES) * TILE_ELEMS;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#if Q_SMEM
      unsigned qa[4];
      ldmatrix_x4(qa[0], qa[1], qa[2], qa[3],
                  sQ + (warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_STRIDE + ks * 16 +
                      (lane >> 4) * 8);
#else
      const unsigned(&qa)[4] = qf[ks];
#endif
      if constexpr (TRIM)  // stage 0's descriptor advanced by offsets (see desc_offset)
        WgMma<N>::rs(sn, qa, wgmma_desc_sw128(sK, 16, 1024) +
                                 desc_offset((t % STAGES) * TILE_ELEMS + (ks >> 2) * HALF_ELEMS + (ks & 3) * 16),
                     ks > 0);
      else
        WgMma<N>::rs(sn, qa, wgmma_desc_sw128(cK + (ks >> 2) * HALF_ELEMS + (ks & 3) * 16, 16, 1024),
                     ks > 0);
    }
    wgmma_commit();
  };
  // After a wgmma.wait_group: the accumulators' values are final from here on
  auto fence_acc = [&]() {
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) reg_fence(sn[n][e]);
    }
#pragma unroll
    for (int d = 0; d < DTILES; ++d) {
#pragma unroll
      for (int e = 0; e < 4; ++e) reg_fence(o[d][e]);
    }
  };

  // Iteration v's loads: tile v + STAGES into K stage v % STAGES and V stage (v-1) % V_STAGES,
  // then the page ids of the tile after it (in flight until the next iteration's loads); with
  // ID_RING, that tile's ids from the ring and the ids of tile v + 2 * STAGES into it.
  auto load_next = [&](int v) {
    const int vn = v + STAGES;
#if TMA_LOADS
    load_tile(vn);
#else
    if (ID_RING) {
      if (vn < n_iter) {
        const int ids[PGR] = {sIds[((vn % ID_SLOTS) * NUM_WARPS + warp) * PG + lane % PG]};
        issue(vn, vn % STAGES, vn % V_STAGES, ids);
      }
      fetch_ids(vn + STAGES);
      cp_async_commit();
      return;
    }
    if (vn < n_iter) issue(vn, vn % STAGES, vn % V_STAGES, pg);
    cp_async_commit();
    if (vn + 1 < n_iter) lookup(vn + 1, pg);
#endif
  };

#if TMA_LOADS
  wait_tile(0);
#else
  cp_async_wait<STAGES - 1>();  // group 0: tile 0 (and Q with Q_SMEM)
#endif
  fence_proxy_async();
  __syncthreads();
#if TMA_LOADS
  zero_tail(0);
#endif
  if (!SKIP_COMPUTE && n_iter > 0) {
    issue_s(0);
    wgmma_wait<0>();
    fence_acc();
  }

  for (int v = 0; v < n_iter; ++v) {
#if TMA_LOADS
    wait_tile(v + 1);  // K(v+1) and V(v+1)
#else
    cp_async_wait<STAGES - 2>();  // group v+1: K(v+1) (V(v) came with group v)
#endif
    fence_proxy_async();  // cp.async data (generic proxy) is read next by wgmma (async proxy)
    // Tile v+1 visible to all. Every warpgroup waited for S(v) and P(v-1)V(v-1) at the end of
    // the last iteration: K stage v % STAGES and V stage (v-1) % (STAGES + 1) are free.
    __syncthreads();
#if TMA_LOADS
    zero_tail(v + 1);
#endif
    if (!SKIP_COMPUTE) {
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[n][e] = sn[n][e];
      }
      // S(v+1) on the tensor cores while the CUDA cores run tile v's softmax below
      if (v + 1 < n_iter) issue_s(v + 1);
    }
#if OVERLAP == 1
    load_next(v);  // under S(v+1)
#endif
    if (!SKIP_COMPUTE) {
      // scale into the log2 domain; mask only tiles that some row cannot fully see
      const bool is_block = v >= n_ctx_here;
      const int kstart = (t0 + v) * N;
      const bool need_mask =
          is_block || kstart + N > P || (windowed && kstart <= P + qb - 1 - window);
      if (TRIM)  // the mask behind one uniform branch a tile
        mask_wgmma_scores(sc, is_block, need_mask, t4, i0, i1, qb, mask_mode, window, windowed,
                          kstart, P);
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = LEAN ? sc[n][e] : sc[n][e] * scale_log2;
          if (!TRIM && need_mask) {
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
            if (!vis) x = -INFINITY;
          }
          sc[n][e] = x;
        }
      }

      // online softmax, rows g (e=0,1) and g+8 (e=2,3); a row is spread over a quad's 4 lanes
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
        mx0 = fmaxf(mx0, fmaxf(sc[n][0], sc[n][1]));
        mx1 = fmaxf(mx1, fmaxf(sc[n][2], sc[n][3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
      if (LEAN) {  // the scores are raw: scale_log2 > 0, so the scaled max is the max scaled
        mx0 *= scale_log2;
        mx1 *= scale_log2;
      }
      // TRIM: a row's running max moves only past RESCALE_SLACK
      const bool up0 = !TRIM || mx0 > m0 + RESCALE_SLACK, up1 = !TRIM || mx1 > m1 + RESCALE_SLACK;
      const float mn0 = TRIM ? (up0 ? mx0 : m0) : fmaxf(m0, mx0);
      const float mn1 = TRIM ? (up1 ? mx1 : m1) : fmaxf(m1, mx1);
      const float base0 = mn0 == -INFINITY ? 0.f : mn0;  // a fully masked row stays at zero
      const float base1 = mn1 == -INFINITY ? 0.f : mn1;
      const float a0 = up0 ? fast_exp2(m0 - base0) : 1.f, a1 = up1 ? fast_exp2(m1 - base1) : 1.f;
      m0 = mn0;
      m1 = mn1;
      float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
      for (int n = 0; n < NTILES; ++n) {
        sc[n][0] = fast_exp2(LEAN ? fmaf(sc[n][0], scale_log2, -base0) : sc[n][0] - base0);
        sc[n][1] = fast_exp2(LEAN ? fmaf(sc[n][1], scale_log2, -base0) : sc[n][1] - base0);
        sc[n][2] = fast_exp2(LEAN ? fmaf(sc[n][2], scale_log2, -base1) : sc[n][2] - base1);
        sc[n][3] = fast_exp2(LEAN ? fmaf(sc[n][3], scale_log2, -base1) : sc[n][3] - base1);
        ps0 += sc[n][0] + sc[n][1];
        ps1 += sc[n][2] + sc[n][3];
      }
      l0 = l0 * a0 + ps0;
      l1 = l1 * a1 + ps1;
      if (!TRIM || __any_sync(0xffffffffu, up0 | up1)) {
#pragma unroll
        for (int d = 0; d < DTILES; ++d) {
          o[d][0] *= a0;
          o[d][1] *= a0;
          o[d][2] *= a1;
          o[d][3] *= a1;
        }
      }

      // O += P V, queued behind S(v+1) on the tensor cores
      const elem_t* cV = sV + (v % V_STAGES) * TILE_ELEMS;
      wgmma_fence();  // o was rescaled by ordinary instructions
#pragma unroll
      for (int kk = 0; kk < N / 16; ++kk) {
        const unsigned a[4] = {pack2(sc[2 * kk][0], sc[2 * kk][1]),
                               pack2(sc[2 * kk][2], sc[2 * kk][3]),
                               pack2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                               pack2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
        // B = V, MN-major (transposed), 128B swizzle: LBO = next 64 columns (a half), SBO = next
        // 8 keys (1024 B)
        WgMma<D>::rs_tb(o, a, TRIM ? wgmma_desc_sw128(sV, HALF_ELEMS * 2, 1024) +
                                         desc_offset((v % V_STAGES) * TILE_ELEMS + kk * 16 * 64)
                                   : wgmma_desc_sw128(cV + kk * 16 * 64, HALF_ELEMS * 2, 1024), 1);
      }
      wgmma_commit();
    }
#if OVERLAP != 1
    load_next(v);  // under P(v)V(v)
#endif
    if (!SKIP_COMPUTE) {
      wgmma_wait<0>();  // S(v+1) and P(v)V(v), before the next barrier frees their stages
      fence_acc();
    }
  }
  cp_async_wait<0>();
#else
  // Prologue: every page-id lookup first (one dependent round trip, not STAGES - 1), then the
  // first STAGES - 1 tiles.
  // (With several page-id registers per thread, PGR > 1, they would spill: look up per stage.)
  int pg[PGR];
  if (PGR == 1) {
    int pg_pro[STAGES - 1][PGR];  // PGR == 1 here
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < n_iter) lookup(s, pg_pro[s]);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_iter) issue(s, s, s, pg_pro[s]);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < n_iter) {
        lookup(s, pg);
        issue(s, s, s, pg);
      }
      cp_async_commit();
    }
  }
  if (STAGES - 1 < n_iter) lookup(STAGES - 1, pg);

  for (int v = 0; v < n_iter; ++v) {
    cp_async_wait<STAGES - 2>();
#if WGMMA
    fence_proxy_async();  // cp.async data (generic proxy) is read next by wgmma (async proxy)
#endif
    __syncthreads();  // tile v visible to all; stage (v-1)%STAGES free for reuse
    {
      const int vn = v + STAGES - 1;
      if (vn < n_iter) issue(vn, vn % STAGES, vn % STAGES, pg);
      cp_async_commit();
      // Page ids for the tile after: loads stay in flight while this tile computes.
      if (vn + 1 < n_iter) lookup(vn + 1, pg);
    }
    if (SKIP_COMPUTE) continue;
#if WGMMA
    if (r_lo + (warp >> 2) * 64 >= r_end) continue;  // a warpgroup with no query rows only helps load
#else
    if (r_lo + warp * 16 >= r_end) continue;  // a warp with no query rows only helps load
#endif
    const int stage = v % STAGES;
    const elem_t* cK = sK + stage * TILE_ELEMS;
    const elem_t* cV = sV + stage * TILE_ELEMS;

    // S = Q K^T (16 rows x N keys per warp)
    float s[NTILES][4];
#pragma unroll
    for (int n = 0; n < NTILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#if WGMMA
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#if Q_SMEM
      unsigned qa[4];
      ldmatrix_x4(qa[0], qa[1], qa[2], qa[3],
                  sQ + (warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_STRIDE + ks * 16 +
                      (lane >> 4) * 8);
#else
      const unsigned(&qa)[4] = qf[ks];
#endif
      // B = K^T, K-major, 128B swizzle: k-step ks starts 32 bytes into its half's rows;
      // SBO = next 8 rows (1024 B); LBO unused
      WgMma<N>::rs(s, qa, wgmma_desc_sw128(cK + (ks >> 2) * HALF_ELEMS + (ks & 3) * 16, 16, 1024),
                   ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#else
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
#if Q_SMEM
      unsigned qa[4];
      ldmatrix_x4(qa[0], qa[1], qa[2], qa[3],
                  sQ + (warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_STRIDE + ks * 16 +
                      (lane >> 4) * 8);
#else
      const unsigned(&qa)[4] = qf[ks];
#endif
#pragma unroll
      for (int np = 0; np < NTILES / 2; ++np) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3,
                    cK + (np * 16 + ((lane >> 4) << 3) + (lane & 7)) * ROW_STRIDE + ks * 16 +
                        ((lane >> 3) & 1) * 8);
        mma_16816(s[2 * np], qa, b0, b1);
        mma_16816(s[2 * np + 1], qa, b2, b3);
      }
    }
#endif

    // scale into the log2 domain; mask only tiles that some row cannot fully see
    const bool is_block = v >= n_ctx_here;
    const int kstart = (t0 + v) * N;
    const bool need_mask =
        is_block || kstart + N > P || (windowed && kstart <= P + qb - 1 - window);
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = LEAN ? s[n][e] : s[n][e] * scale_log2;
        if (need_mask) {
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
          if (!vis) x = -INFINITY;
        }
        s[n][e] = x;
      }
    }

    // online softmax, rows g (e=0,1) and g+8 (e=2,3); a row is spread over the 4 lanes of a quad
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
      mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffff, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffff, mx1, 2));
    if (LEAN) {  // the scores are raw: scale_log2 > 0, so the scaled max is the max scaled
      mx0 *= scale_log2;
      mx1 *= scale_log2;
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float base0 = mn0 == -INFINITY ? 0.f : mn0;  // a fully masked row stays at zero
    const float base1 = mn1 == -INFINITY ? 0.f : mn1;
    const float a0 = fast_exp2(m0 - base0), a1 = fast_exp2(m1 - base1);
    m0 = mn0;
    m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int n = 0; n < NTILES; ++n) {
      s[n][0] = fast_exp2(LEAN ? fmaf(s[n][0], scale_log2, -base0) : s[n][0] - base0);
      s[n][1] = fast_exp2(LEAN ? fmaf(s[n][1], scale_log2, -base0) : s[n][1] - base0);
      s[n][2] = fast_exp2(LEAN ? fmaf(s[n][2], scale_log2, -base1) : s[n][2] - base1);
      s[n][3] = fast_exp2(LEAN ? fmaf(s[n][3], scale_log2, -base1) : s[n][3] - base1);
      ps0 += s[n][0] + s[n][1];
      ps1 += s[n][2] + s[n][3];
    }
    l0 = l0 * a0 + ps0;
    l1 = l1 * a1 + ps1;
#pragma unroll
    for (int d = 0; d < DTILES; ++d) {
      o[d][0] *= a0;
      o[d][1] *= a0;
      o[d][2] *= a1;
      o[d][3] *= a1;
    }

    // O += P V; P's accumulator layout is already the A-fragment layout of the next mma
#if WGMMA
    wgmma_fence();  // o was rescaled by ordinary instructions
#endif
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
      const unsigned a[4] = {pack2(s[2 * kk][0], s[2 * kk][1]), pack2(s[2 * kk][2], s[2 * kk][3]),
                             pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#if WGMMA
      // B = V, MN-major (transposed), 128B swizzle: LBO = next 64 columns (a half), SBO = next
      // 8 keys (1024 B)
      WgMma<D>::rs_tb(o, a, wgmma_desc_sw128(cV + kk * 16 * 64, HALF_ELEMS * 2, 1024), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
#else
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3,
                          cV + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_STRIDE +
                              dp * 16 + (lane >> 4) * 8);
        mma_16816(o[2 * dp], a, b0, b1);
        mma_16816(o[2 * dp + 1], a, b2, b3);
      }
    }
#endif
  }
  cp_async_wait<0>();
#endif  // OVERLAP

  // ---- epilogue: normalise; write the output, or this split's partial + log-sum-exp
  l0 += __shfl_xor_sync(0xffffffff, l0, 1);
  l0 += __shfl_xor_sync(0xffffffff, l0, 2);
  l1 += __shfl_xor_sync(0xffffffff, l1, 1);
  l1 += __shfl_xor_sync(0xffffffff, l1, 2);
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  if (num_splits == 1) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? r1 : r0;
      if (r >= r_end) continue;
      const int i = r / group;
      const float inv = half ? inv1 : inv0;
      elem_t* dst = out + ((static_cast<long long>(b) * qb + i) * hq + kvh * group + r % group) * D;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        *reinterpret_cast<unsigned*>(dst + d * 8 + 2 * t4) =
            pack2(o[d][2 * half] * inv, o[d][2 * half + 1] * inv);
      }
    }
  } else {
    const long long row_base = ((static_cast<long long>(split) * batch + b) * hkv + kvh) * M;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? r1 : r0;
      if (r >= r_end) continue;
      const float inv = half ? inv1 : inv0;
      float* dst = o_part + (row_base + r) * D;
#pragma unroll
      for (int d = 0; d < DTILES; ++d) {
        *reinterpret_cast<float2*>(dst + d * 8 + 2 * t4) =
            make_float2(o[d][2 * half] * inv, o[d][2 * half + 1] * inv);
      }
      if (t4 == 0) {
        const float l = half ? l1 : l0, m = half ? m1 : m0;
        lse_part[row_base + r] = l > 0.f ? m + log2f(l) : -INFINITY;
      }
    }
  }
}

#if TMA_LOADS
// The tensor maps of the K and V caches (kernels/tma.py), after the shared parameters.
extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS)
    drafter_attention(DRAFTER_KERNEL_PARAMS, const __grid_constant__ TmaMap tma_k,
                      const __grid_constant__ TmaMap tma_v) {
  attention_body(DRAFTER_BODY_ARGS, &tma_k, &tma_v);
}
#else
extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS) drafter_attention(DRAFTER_KERNEL_PARAMS) {
  attention_body(DRAFTER_BODY_ARGS);
}
#endif
#endif  // DRAFTER_LAYOUTS_ONLY
