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
  // From one page to the next in packed pages (1 when packed, 2 for K and V views of a pool
  // [pages, 2, Hkv, PAGE_SIZE, D]), or one arena slot to the next in token rows (max_ctx when
  // packed); shared by K and V. See cache_offset in combine_store.cuh.
  int loc_stride;
  float scale_log2;
};

// The fields as the kernel bodies' parameter list (their restrict-qualified parameters let the
// compiler schedule the loads as before; locals copied from the struct cost registers).
#define DRAFTER_PARAMS_ARGS(p)                                                                \
  (p).q, (p).k_blk, (p).v_blk, (p).k_cache, (p).v_cache, (p).table, (p).ctx_lens, (p).out,    \
      (p).o_part, (p).lse_part, (p).qb, (p).hq, (p).hkv, (p).group, (p).table_stride,         \
      (p).capacity, (p).loc_stride, (p).mask_mode, (p).window, (p).scale_log2
