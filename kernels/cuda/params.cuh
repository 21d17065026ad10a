// The arguments of both drafter_attention kernel families (drafter_attention.cu and
// cute_drafter_attention.cu), as one struct. The host packs it once per shape
// (kernels/cupy_backend.py, `DrafterParams`, same field order), rewrites only the pointers per
// call and passes its fields as the kernels' parameters (DRAFTER_KERNEL_PARAMS below), so this
// struct, that macro and the ctypes mirror must change together (tests/test_ops.py checks it).
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

// The kernels' own parameters: DrafterParams' fields, in its order (the host passes the packed
// struct field by field). A struct parameter read through __grid_constant__ compiled to a slower
// schedule of the cupy kernel (H200, 2026-11-30: +9% at B=32 ctx 8k; 96 fewer FMULs, twice the
// branches in its SASS), so the struct stays the host's and the headers' single description.
#define DRAFTER_KERNEL_PARAMS                                                                    \
  const elem_t* __restrict__ q, const elem_t* __restrict__ k_blk,                              \
      const elem_t* __restrict__ v_blk, const elem_t* __restrict__ k_cache,                    \
      const elem_t* __restrict__ v_cache, const int* __restrict__ table,                       \
      const int* __restrict__ ctx_lens, elem_t* __restrict__ out, float* __restrict__ o_part,  \
      float* __restrict__ lse_part, int qb, int hq, int hkv, int group, int table_stride,      \
      int capacity, int mask_mode, int window, int loc_stride, float scale_log2

// Those parameters in the order of the kernel bodies' parameter list.
#define DRAFTER_BODY_ARGS                                                                        \
  q, k_blk, v_blk, k_cache, v_cache, table, ctx_lens, out, o_part, lse_part, qb, hq, hkv, group,  \
      table_stride, capacity, loc_stride, mask_mode, window, scale_log2
