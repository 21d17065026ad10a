// Host-side check of the cupy kernel's K/V tile-load mapping (tests/test_page_small.py builds it
// with nvcc for several shapes and page sizes): over all threads and load iterations every 16-byte
// chunk of a tile is written exactly once and where tile_off puts (row, col); each chunk's page
// id is the one the thread looked up (page_row of its page_slot, and on the WARP_ROWS path the id
// lane j looked up for slot j); a warp instruction reads whole 128-byte row segments and writes
// shared memory without bank conflicts (wgmma layout); and the number of page ids per thread
// is what the kernel holds (PG, PGR); LEAN's affine rows and columns (lean_row, lean_col) are
// load_row's and load_col's; and the packed query rows (query_row, row_share): every
// output element of the M = Qb * G rows stored once, also when ROW_SPLIT CTAs share them, the
// padding rows never.
#define DRAFTER_LAYOUTS_ONLY 1
#include "drafter_attention.cu"

#include <cstdio>
#include <set>
#include <vector>

#ifndef EXPECT_PG
#error "EXPECT_PG: the page ids per thread and tile the shape should need"
#endif
#ifndef EXPECT_PGR
#error "EXPECT_PGR: the page-id registers per thread the shape should hold"
#endif

static int page_of(int row) { return PAGE_SIZE > 0 ? row / PAGE_SIZE : 0; }

int main() {
  int bad = 0;
  auto fail = [&](const char* what, int tid, int it, int a, int b) {  // (row, col) for chunks
    if (bad++ < 20) std::printf("FAIL %s: tid %d it %d (%d vs %d)\n", what, tid, it, a, b);
  };
  if (PG != EXPECT_PG) fail("PG", -1, -1, PG, EXPECT_PG);
  if (PGR != EXPECT_PGR) fail("PGR", -1, -1, PGR, EXPECT_PGR);
  const int elems = TILE_ELEMS;
  std::vector<int> seen(elems, 0);
  for (int tid = 0; tid < NT; ++tid) {
    for (int it = 0; it < ITERS; ++it) {
      if (!(CONTIG || CHUNKS % NT == 0 || tid + it * NT < CHUNKS)) continue;
      const int row = load_row(tid, it), col = load_col(tid, it);
      if (lean_row(tid, it) != row || lean_col(tid, it) != col)  // LEAN's affine form
        fail("lean row/col", tid, it, lean_row(tid, it) * 1000 + lean_col(tid, it), row * 1000 + col);
      if (row < 0 || row >= N || col < 0 || col >= D || col % 8) {
        fail("row/col range", tid, it, row, col);
        continue;
      }
      const int off = tile_off(row, col);
      if (off < 0 || off + 8 > elems || off % 8) {
        fail("tile_off range", tid, it, off, elems);
        continue;
      }
      seen[off] += 1;
      if (PAGE_SIZE > 0 && PAGE_SIZE < N) {
        const int slot = page_slot(it);
        if (slot < 0 || slot >= PG) fail("page_slot range", tid, it, slot, PG);
        // the slot's first row lies in the chunk's page
        if (page_of(page_row(tid, slot)) != page_of(row)) fail("page of slot", tid, it, page_row(tid, slot), row);
        // the id the kernel uses for the slot: its own lookup, or lane `slot`'s (a shuffle)
        const int src = PGR == PG ? tid : (tid & ~31) + slot;
        const int looked = lookup_row(src, PGR == PG ? slot : 0);
        if (page_of(looked) != page_of(row)) fail("page of looked-up row", tid, it, looked, row);
      }
    }
  }
  for (int row = 0; row < N; ++row) {
    for (int col = 0; col < D; col += 8) {
      const int n = seen[tile_off(row, col)];
      if (n != 1) fail("chunk written once", row, col, n, 1);
    }
  }
#if WGMMA
  // One warp instruction: 4 rows x 8 chunks of one 64-column half (whole 128-byte segments), and
  // each 8-lane phase writes 8 distinct 16-byte bank groups. Where the thread count does not
  // divide the chunk count (a predicated last iteration), a warp's lanes all load or all skip.
  for (int w = 0; w < NUM_WARPS; ++w) {
    for (int it = 0; it < ITERS; ++it) {
      int loading = 0;
      for (int lane = 0; lane < 32; ++lane) loading += (w * 32 + lane) + it * NT < CHUNKS;
      if (loading != 0 && loading != 32) fail("warp-uniform load predicate", w * 32, it, loading, 32);
      if (loading == 0) continue;
      std::set<std::pair<int, int>> segs;
      for (int lane = 0; lane < 32; ++lane) {
        const int tid = w * 32 + lane;
        segs.insert({load_row(tid, it), load_col(tid, it) / 64});
      }
      if (segs.size() != 4) fail("4 row segments per warp instruction", w * 32, it, (int)segs.size(), 4);
      for (int phase = 0; phase < 4; ++phase) {
        std::set<int> banks;
        for (int lane = phase * 8; lane < phase * 8 + 8; ++lane) {
          const int tid = w * 32 + lane;
          banks.insert((tile_off(load_row(tid, it), load_col(tid, it)) * 2 / 16) % 8);
        }
        if (banks.size() != 8) fail("bank groups per 8-lane phase", w * 32 + phase * 8, it, (int)banks.size(), 8);
      }
    }
  }
#endif
  // Query rows (query_row, the kernel's r0 / r0 + 8): for every CTA of M = Qb * G rows this
  // NUM_WARPS serves (M > 16 * (NUM_WARPS - 4) on the wgmma path: whole warpgroups, each with
  // rows), every row < M and column is stored by exactly one (thread, element) and maps to a
  // block position i = r / G < Qb; the rows >= M (padding) are never stored. Every warpgroup
  // holds at least one row < M (no warpgroup idles around its wgmmas). The same with the rows
  // dealt over `parts` CTAs (row_share, ROW_SPLIT): the CTAs' rows together store each element
  // once, each CTA holds at least one row (where the host allows the split: row_split_reason)
  // and only rows of its own share, and every warpgroup of a full share holds rows.
  int ms = 0;
  for (int parts = 1; parts <= 4; ++parts) {
    for (int qb = 1; qb <= 64; ++qb) {
      for (int group = 1; group <= 16; ++group) {
        const int M = qb * group, share = (M + parts - 1) / parts;
        if (parts > 1 && (parts - 1) * share >= M) continue;  // refused by the host
        const int w16 = share < 64 ? 4 : (share + 15) / 16;  // num_warps(..., row_split=parts)
        const int want = WGMMA ? (w16 + 3) / 4 * 4 : w16;  // padded_warps on the wgmma path
        if (want != NUM_WARPS) continue;
        ++ms;
        std::vector<int> stored(M * D, 0);
        for (int part = 0; part < parts; ++part) {
          int lo = 0, end = M;
          if (parts > 1) row_share(M, parts, part, lo, end);
          if (lo >= end) fail("row share without rows", part, parts, lo, end);
          if (end - lo > 16 * NUM_WARPS) fail("row share past the CTA's rows", part, parts, end - lo, NUM_WARPS);
          for (int warp = 0; warp < NUM_WARPS; ++warp) {
            for (int lane = 0; lane < 32; ++lane) {
              const int r0 = lo + query_row(warp, lane >> 2), t4 = lane & 3;
              for (int half = 0; half < 2; ++half) {
                const int r = half ? r0 + 8 : r0;
                if (r >= end) continue;  // the kernel's epilogue: `if (r >= r_end) continue`
                if (r / group >= qb) fail("row's block position", r, group, r / group, qb);
                for (int d = 0; d < D / 8; ++d) {
                  stored[r * D + d * 8 + 2 * t4] += 1;
                  stored[r * D + d * 8 + 2 * t4 + 1] += 1;
                }
              }
            }
          }
#if WGMMA
          // (a short last share, e.g. 129 rows as 65 + 64 over 2 warpgroups, may leave its last
          // warpgroup on zero rows: correct, never stored, only idle)
          for (int wg = 0; wg < NUM_WARPS / 4 && end - lo == share; ++wg)
            if (lo + query_row(wg * 4, 0) >= end) fail("warpgroup without query rows", wg, M, qb, group);
#endif
        }
        for (int e = 0; e < M * D; ++e)
          if (stored[e] != 1) fail("output element stored once", e / D, e % D, stored[e], 1);
      }
    }
  }
  if (ms == 0 && NUM_WARPS <= 16) fail("no (Qb, G) of this NUM_WARPS checked", NUM_WARPS, 0, 0, 0);
  if (bad) {
    std::printf("%d failures (D=%d N=%d warps=%d page=%d wgmma=%d)\n", bad, D, N, NUM_WARPS, PAGE_SIZE, WGMMA);
    return 1;
  }
  std::printf("ok: D=%d N=%d warps=%d page=%d wgmma=%d PG=%d PGR=%d ITERS=%d, %d row counts\n", D, N,
              NUM_WARPS, PAGE_SIZE, WGMMA, PG, PGR, ITERS, ms);
  return 0;
}
