// Host-side check of the CuTe kernel's gather partitions (tests/test_cutlass_compile.py builds and
// runs it with nvcc for a few variants): for every thread and row iteration of the K/V and Q
// cp.async copies, the 8 destination elements are where the shared-memory layout puts
// (row, col .. col + 7) in every pipeline stage, rows follow the mapping the page-id lookup assumes
// (thread t copies rows (t / chunks_per_row) * iters + it), and every tile element is written once.
// Then what the MMAs read (check_operands): the accumulator elements the softmax, P and the
// epilogue index, and with WGMMA the operands themselves, emulated from the PTX ISA's definitions.
#define CUTE_DRAFTER_LAYOUTS_ONLY 1
#include "cute_drafter_attention.cu"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <vector>

using namespace cute_drafter;

alignas(1024) static Elem buf[kQOffset + kM * kRowStride + kStages * kStageElems];

namespace {

// Accumulator elements as the kernel indexes them (acc(c, h, n) = c + 2h + 4n, rows r0 and
// r0 + 8 shared by the 4 lanes of a quad), and P: S's accumulator read through PLayout must be
// the A fragment the P V MMA expects, element for element.
int check_fragments() {
  int bad = 0;
  MmaS mma_s;
  MmaO mma_o;
  int r0_of[kThreads];
  const auto MN = make_identity_tensor(Shape<Int<kM>, Int<kN>>{});
  const auto MD = make_identity_tensor(Shape<Int<kM>, Int<kD>>{});
  for (int tid = 0; tid < kThreads; ++tid) {
    Tensor cS = mma_s.get_thread_slice(tid).partition_C(MN);
    Tensor cO = mma_o.get_thread_slice(tid).partition_C(MD);
    Tensor cP = mma_o.get_thread_slice(tid).partition_A(MN);  // P V's A operand (row, key)
    const int r0 = r0_of[tid] = get<0>(cS(0));
    for (int kk = 0; kk < kN / 16; ++kk)
      for (int v = 0; v < 8; ++v)
        if (cS(PLayout{}(v, 0, kk)) != cP(v, 0, kk)) ++bad;
    for (int n = 0; n < kN / 8; ++n)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < 2; ++c)
          if (cS(c + 2 * h + 4 * n) != make_coord(r0 + 8 * h, get<1>(cS(2 * h + 4 * n)) + c)) ++bad;
    for (int n = 0; n < kD / 8; ++n)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < 2; ++c)
          if (cO(c + 2 * h + 4 * n) != make_coord(r0 + 8 * h, get<1>(cO(2 * h + 4 * n)) + c)) ++bad;
  }
  for (int tid = 0; tid < kThreads; ++tid)
    if (r0_of[tid] != r0_of[tid & ~3]) ++bad;  // the row max / sum shuffles stay in a quad
  return bad;
}

#if WGMMA
long byte_of(const void* p) {
  return static_cast<const char*>(p) - reinterpret_cast<const char*>(buf);
}
// The 128-byte swizzle on a shared-memory byte address: 16-byte chunk ^= 128-byte row % 8.
long sw128(long a) { return a ^ (((a >> 7) & 7) << 4); }
struct Desc {
  long start, lbo, sbo;
  int type;
};
Desc decode(uint64_t raw) {
  GmmaDescriptor g(raw);
  return {16L * g.bitfield.start_address_, 16L * g.bitfield.leading_byte_offset_,
          16L * g.bitfield.stride_byte_offset_, int(g.bitfield.layout_type_)};
}
// Byte offsets (before the swizzle) of element (n, k) of a wgmma B operand (N x 16, 16-bit
// elements) in the PTX ISA's canonical 128-byte-swizzle layouts: K-major, ((8,m),(8,2)) 16-byte
// units with the 8-row groups SBO apart; MN-major, 64-element columns LBO apart and 8-row
// (along K) groups SBO apart.
long k_major(Desc d, int n, int k) { return d.start + (n % 8) * 128 + (n / 8) * d.sbo + k * 2; }
long mn_major(Desc d, int n, int k) {
  return d.start + (n % 64) * 2 + (n / 64) * d.lbo + (k % 8) * 128 + (k / 8) * d.sbo;
}
// The host pass of make_gmma_desc cannot map a shared-memory address (it prints so and uses 0):
// the descriptors come out relative to their tensor's base, the message goes to /dev/null.
struct QuietStdout {
  int saved, null;
  QuietStdout() {
    std::fflush(stdout);
    saved = dup(1);
    null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
  }
  ~QuietStdout() {
    std::fflush(stdout);
    dup2(saved, 1);
    close(saved);
    close(null);
  }
};

// Every element the warpgroup MMAs read: K (S's B operand) and V (P V's B operand) through the
// kernel's GMMA descriptors, at the address the swizzled tile holds (row, col) in every stage;
// Q (S's A operand) through an emulated ldmatrix.x4 over the swizzled Q tile (lane l gives the
// row address of matrix l / 8; register r of lane l gets row l / 4, elements 2 (l % 4) + {0, 1}
// of matrix r), compared with the coordinates of the MMA's A fragment.
int check_operands() {
  int bad = 0;
  MmaS mma_s;
  MmaO mma_o;
  for (int s = 0; s < kStages; ++s) {
    Elem* base = buf + s * kStageElems;
    Tensor sK = make_tensor(make_smem_ptr(base), SmemKV{});
    Tensor sV = make_tensor(make_smem_ptr(base + kTileElems), SmemKV{});
    Tensor sVt = make_tensor(make_smem_ptr(base + kTileElems), SmemVt{});
    auto descs = [&] {
      QuietStdout quiet;
      return make_tuple(mma_s.get_thread_slice(0).partition_fragment_B(sK),
                        mma_o.get_thread_slice(0).partition_fragment_B(sVt));
    }();
    for (int ks = 0; ks < kKSteps; ++ks) {
      const Desc d = decode(get<0>(descs)(0, 0, ks));
      if (d.type != 1) ++bad;  // 128-byte swizzle
      for (int n = 0; n < kN; ++n)
        for (int k = 0; k < 16; ++k)
          if (sw128(byte_of(base) + k_major(d, n, k)) != byte_of(&sK(n, 16 * ks + k))) ++bad;
    }
    for (int kk = 0; kk < kN / 16; ++kk) {
      const Desc d = decode(get<1>(descs)(0, 0, kk));
      if (d.type != 1) ++bad;
      for (int n = 0; n < kD; ++n)
        for (int k = 0; k < 16; ++k)
          if (sw128(byte_of(base + kTileElems) + mn_major(d, n, k)) != byte_of(&sV(16 * kk + k, n)))
            ++bad;
    }
  }
  Tensor sQ = make_tensor(make_smem_ptr(buf + kQOffset), SmemQ{});
  std::vector<int> q_row(sizeof(buf) / sizeof(Elem), -1), q_col(sizeof(buf) / sizeof(Elem), -1);
  for (int r = 0; r < kM; ++r)
    for (int c = 0; c < kD; ++c) {
      q_row[&sQ(r, c) - buf] = r;
      q_col[&sQ(r, c) - buf] = c;
    }
  auto s2r_q = make_tiled_copy_A(LdsmN{}, mma_s);
  for (int w = 0; w < kWarps; ++w)
    for (int ks = 0; ks < kKSteps; ++ks) {
      long row_addr[32];
      for (int l = 0; l < 32; ++l) {
        Tensor src = s2r_q.get_thread_slice(w * 32 + l).partition_S(sQ);
        row_addr[l] = &src(0, 0, ks) - buf;
        for (int e = 0; e < 8; ++e)
          if (&src(e, 0, ks) - buf != row_addr[l] + e) ++bad;  // one 16-byte row per lane
      }
      for (int l = 0; l < 32; ++l) {
        auto thr = mma_s.get_thread_slice(w * 32 + l);
        Tensor frag = thr.partition_fragment_A(sQ);
        Tensor want = thr.partition_A(make_identity_tensor(Shape<Int<kM>, Int<kD>>{}));
        Tensor dst = s2r_q.get_thread_slice(w * 32 + l).retile_D(frag);
        for (int e = 0; e < 8; ++e) {
          const long got = row_addr[8 * (e / 2) + l / 4] + 2 * (l % 4) + e % 2;
          int i = 0;
          while (i < size(frag) && &frag(i) != &dst(e, 0, ks)) ++i;
          if (i == size(frag) || q_row[got] != get<0>(want(i)) || q_col[got] != get<1>(want(i)))
            ++bad;
        }
      }
    }
  return bad;
}
#endif

}  // namespace

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
  bad += check_fragments();
#if WGMMA
  bad += check_operands();
#endif
  std::printf("HEAD_DIM=%d TILE_N=%d NUM_WARPS=%d STAGES=%d Q_SMEM=%d WGMMA=%d: %d mismatches\n",
              kD, kN, kWarps, kStages, Q_SMEM, WGMMA, bad);
  return bad != 0;
}
