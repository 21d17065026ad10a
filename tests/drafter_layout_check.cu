// Host-side check of the cupy kernel's K/V tile-load mapping (tests/test_page_small.py builds it
// with nvcc for several shapes and page sizes): over all threads and load iterations every 16-byte
// chunk of a tile is written exactly once and where tile_off puts (row, col); each chunk's page
// id is the one the thread looked up (page_row of its page_slot, and on the WARP_ROWS path the id
// lane j looked up for slot j); a warp instruction reads whole 128-byte row segments and writes
// shared memory without bank conflicts (wgmma layout); and the number of page ids per thread
// is what the kernel holds (PG, PGR).
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
  // each 8-lane phase writes 8 distinct 16-byte bank groups.
  for (int w = 0; w < NUM_WARPS; ++w) {
    for (int it = 0; it < ITERS; ++it) {
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
  if (bad) {
    std::printf("%d failures (D=%d N=%d warps=%d page=%d wgmma=%d)\n", bad, D, N, NUM_WARPS, PAGE_SIZE, WGMMA);
    return 1;
  }
  std::printf("ok: D=%d N=%d warps=%d page=%d wgmma=%d PG=%d PGR=%d\n", D, N, NUM_WARPS, PAGE_SIZE, WGMMA, PG, PGR);
  return 0;
}
