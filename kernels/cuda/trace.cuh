// TRACE=1 (scripts/diag_timeline.py only; no backend knob builds it): the warp-specialised
// attention kernel and the split combine record, a CTA a row, the %globaltimer (ns, one clock for
// the whole GPU) and clock64 (the SM's cycles) at which they reach their steps, to say where a
// small-batch call's time goes between launch and output. Each point sits behind its own `#if TRACE`:
// even an empty `if (tid == 0);` left in the source changed ptxas's code for three
// ws variants, and the untraced kernels must stay byte-identical.
#pragma once
#if TRACE
constexpr int TRACE_ROWS = 4096;  // CTAs a launch records; later ones do not
constexpr int TRACE_SLOTS = 32;   // 0-13: %globaltimer at a step; 15: the SM; 16 + i: clock64 at step i
// A CTA's row (the host reads them by these unmangled names). attention: 0 entry, 1 the
// producer's page ids in hand, 2 its last copy issued, 3 consumer 0's Q landed, 4 its first tile
// landed, 5 its tile loop done, 6 its output or partial stored, 7 the last consumer's tile loop
// done, 8 consumer 1's, 9 consumer 0 past the merge's barrier, 10 its merge done (its stores
// next), 11 the context length in hand (thread 0), 12 past the barriers' set-up (the CTA's first
// __syncthreads), 13 consumer 0's Q copies issued. combine: 0 entry, 8 the row's largest lse in
// hand, 6 stored.
__device__ unsigned long long drafter_trace[TRACE_ROWS * TRACE_SLOTS];
__device__ unsigned long long drafter_trace_combine[TRACE_ROWS * TRACE_SLOTS];
namespace drafter {
__device__ __forceinline__ void trace_at(unsigned long long* rows, int slot) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta >= TRACE_ROWS) return;
  unsigned long long t, c;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* row = rows + static_cast<unsigned long long>(cta) * TRACE_SLOTS;
  row[slot] = t;
  row[16 + slot] = c;
  row[15] = sm;
}
// a time taken now and stored later (TRACE_PUT), where a store would sit before a fence that
// may wait for it
__device__ __forceinline__ unsigned long long trace_time() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void trace_put(unsigned long long* rows, int slot, unsigned long long v) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta < TRACE_ROWS) rows[static_cast<unsigned long long>(cta) * TRACE_SLOTS + slot] = v;
}
}  // namespace drafter
#define TRACE_TIME() drafter::trace_time()
#define TRACE_PUT(slot, v) drafter::trace_put(drafter_trace, slot, v)
#define TRACE_AT(slot) drafter::trace_at(drafter_trace, slot)
#define TRACE_COMBINE_AT(slot) drafter::trace_at(drafter_trace_combine, slot)
#endif
