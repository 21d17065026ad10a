// Host-side check of the CuTe kernel's gather partitions (tests/test_cutlass_compile.py builds and
// runs it with nvcc for a few variants): for every thread and row iteration of the K/V and Q
// cp.async copies, the 8 destination elements are where the shared-memory layout puts
// (row, col .. col + 7) in every pipeline stage, rows follow the mapping the page-id lookup assumes
// (thread t copies rows (t / chunks_per_row) * iters + it), and every tile element is written once.
#define CUTE_DRAFTER_LAYOUTS_ONLY 1
#include "cute_drafter_attention.cu"

#include <cstdio>
#include <vector>

using namespace cute_drafter;

alignas(1024) static Elem buf[kQOffset + kM * kRowStride + kStages * kStageElems];

int main() {
  int bad = 0;
  for (int s = 0; s < kStages; ++s) {
    Tensor sK = make_tensor(make_smem_ptr(buf), SmemKV{});
    Tensor sKs = make_tensor(make_smem_ptr(buf + s * kStageElems), SmemKV{});
    std::vector<int> seen(sizeof(buf) / sizeof(Elem), 0);
    G2SKV g;
    for (int tid = 0; tid < kLoaders; ++tid) {
      auto thr = g.get_thread_slice(tid);
      Tensor c = thr.partition_S(make_identity_tensor(Shape<Int<kN>, Int<kD>>{}));
      Tensor d0 = thr.partition_D(sK);
      Tensor d = make_tensor(d0.data() + s * kStageElems, d0.layout());  // as at_stage()
      for (int it = 0; it < kIters; ++it) {
        auto rc = c(make_coord(0, it), 0, 0);
        const int row = get<0>(rc), col = get<1>(rc);
        if (row != (tid / kCPR) * kIters + it || col != (tid % kCPR) * 8) ++bad;
        Tensor dd = d(make_coord(_, it), 0, 0);
        for (int e = 0; e < 8; ++e) {
          if (&dd(e) != &sKs(row, col + e)) ++bad;
          ++seen[&dd(e) - buf];
        }
      }
    }
    int count = 0;
    for (int x : seen) {
      if (x > 1) ++bad;
      count += x;
    }
    if (count != kN * kD) ++bad;
  }
  {
    Tensor sQ = make_tensor(make_smem_ptr(buf + kQOffset), SmemQ{});
    std::vector<int> seen(sizeof(buf) / sizeof(Elem), 0);
    G2SQ g;
    for (int tid = 0; tid < kThreads; ++tid) {
      auto thr = g.get_thread_slice(tid);
      Tensor c = thr.partition_S(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
      Tensor d = thr.partition_D(sQ);
      for (int it = 0; it < kQIters; ++it) {
        auto rc = c(make_coord(0, it), 0, 0);
        Tensor dd = d(make_coord(_, it), 0, 0);
        for (int e = 0; e < 8; ++e) {
          if (&dd(e) != &sQ(get<0>(rc), get<1>(rc) + e)) ++bad;
          ++seen[&dd(e) - buf];
        }
      }
    }
    int count = 0;
    for (int x : seen) {
      if (x > 1) ++bad;
      count += x;
    }
    if (count != kM * kD) ++bad;
  }
  // V's (d, key) view for the P V operand is the same memory as its (key, d) tile
  {
    Tensor sV = make_tensor(make_smem_ptr(buf), SmemKV{});
    Tensor sVt = make_tensor(make_smem_ptr(buf), SmemVt{});
    for (int n = 0; n < kN; ++n)
      for (int d = 0; d < kD; ++d)
        if (&sV(n, d) != &sVt(d, n)) ++bad;
  }
  std::printf("HEAD_DIM=%d TILE_N=%d NUM_WARPS=%d STAGES=%d Q_SMEM=%d WGMMA=%d: %d mismatches\n",
              kD, kN, kWarps, kStages, Q_SMEM, WGMMA, bad);
  return bad != 0;
}
