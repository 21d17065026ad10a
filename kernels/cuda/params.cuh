// The one argument of both drafter_attention kernel families (drafter_attention.cu and
// cute_drafter_attention.cu). The host packs it once per shape (kernels/cupy_backend.py,
// `DrafterParams`, same field order) and rewrites only the pointers per call, so this struct and
// that ctypes mirror must change together.
#pragma once
#include "common.cuh"

struct DrafterParams {
  const elem_t* q;        // [B, Qb, Hq, D]
  const elem_t* k_blk;    // [B, Qb, Hkv, D]
  const elem_t* v_blk;
  const elem_t* k_cache;  // pages [., Hkv, PAGE_SIZE, D] or arena [., max_ctx, Hkv, D]
  const elem_t* v_cache;
  const int* table;       // block table [B, table_stride] or slots [B]
  const int* ctx_lens;    // [B]
  elem_t* out;            // [B, Qb, Hq, D]
  float* o_part;          // [splits, B, Hkv, Qb*G, D] when splits > 1
  float* lse_part;        // [splits, B, Hkv, Qb*G]
  int qb, hq, hkv, group, table_stride, capacity, mask_mode, window;
  // From one page to the next in head-pages (hkv when packed), or one arena slot to the next in
  // token rows (max_ctx when packed); shared by K and V. A pool [pages, 2, Hkv, PAGE_SIZE, D]
  // hands K and V in as views with 2 * hkv. In these units the address arithmetic is the packed
  // layout's (a byte stride costs the 9-warp variants registers, and spills).
  int loc_stride;
  float scale_log2;
};

// The fields both kernel bodies read by their old argument names, as locals.
#define DRAFTER_UNPACK_PARAMS(p)                                                             \
  const int* __restrict__ table = (p).table;                                                 \
  const int* __restrict__ ctx_lens = (p).ctx_lens;                                           \
  elem_t* __restrict__ out = (p).out;                                                        \
  float* __restrict__ o_part = (p).o_part;                                                   \
  float* __restrict__ lse_part = (p).lse_part;                                               \
  const int qb = (p).qb, hq = (p).hq, hkv = (p).hkv, group = (p).group;                      \
  const int table_stride = (p).table_stride, capacity = (p).capacity;                        \
  const int mask_mode = (p).mask_mode, window = (p).window;                                  \
  const float scale_log2 = (p).scale_log2
