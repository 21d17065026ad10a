"""Tensor maps for the sm_90a TMA loads of the cupy kernel (`tma=1`, drafter_attention.cu TMA).

One 4-D map per cache tensor, built on the host once per base address and passed to the kernel
as a `__grid_constant__` parameter. Each box is 64 head-dim elements (128 bytes, the 128-byte
swizzle's row) by the rows of one tile or one page; the kernel issues one box per 64-column half
(and per page below a tile) at the coordinates of that half, page and head:

    paged  [pages, Hkv, page, D]     dims {D, page, Hkv, pages}       box {64, rows, 1, 1}
                                      coordinates {half*64, row in page, head, page id}
    arena  [slots, max_ctx, Hkv, D]  dims {D, Hkv, max_ctx, slots}    box {64, 1, tile_n, 1}
                                      coordinates {half*64, head, first token, slot}

Strides are the cache's own, so a page (slot) stride larger than one packed page (TensorRT-LLM's
K and V views of one pool) needs no copy. A box out of the tensor's bounds (page id -1, tokens
past max_ctx) lands as zeros. `geometry` is pure arithmetic (tested on the CPU); `encode` calls
the driver's cuTensorMapEncodeTiled.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

BOX_COLS = 64  # head-dim elements per box: 128 bytes of 16-bit elements, the swizzle's row

# CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion (cuda.h)
_DTYPE = {"bfloat16": 9, "float16": 6}
_SWIZZLE_128B = 3
# L2 promotion of each request to 128 bytes, a box row's own size. 256-byte promotion fetched
# each 256-byte K/V row twice, once per 64-column box (H200, B=32 ctx 8k page 64, loads only:
# 263.2 us with 256-byte promotion, 248.5 with 128-byte or none; results/perf-notes.md).
_L2_PROMOTION_128B = 2


class TmaMap(ctypes.Structure):
    """A CUtensorMap's 128 bytes, as a kernel parameter (TmaMap in kernels/cuda/tma.cuh)."""

    _fields_ = [("bits", ctypes.c_uint64 * 16)]


@dataclass(frozen=True)
class MapGeometry:
    dims: tuple[int, int, int, int]  # elements, innermost first
    strides: tuple[int, int, int]  # bytes of dims 1..3
    box: tuple[int, int, int, int]


def geometry(shape: tuple, stride0: int, page_size: int | None, tile_n: int,
             elem_bytes: int = 2) -> MapGeometry:
    """The map of one cache tensor: `shape` its shape ([pages, Hkv, page, D] or
    [slots, max_ctx, Hkv, D]), `stride0` its stride between pages (slots) in elements."""
    if page_size:
        pages, hkv, page, d = shape
        if page != page_size:
            raise ValueError(f"cache page dimension {page} is not page_size {page_size}")
        return MapGeometry((d, page, hkv, pages),
                           (d * elem_bytes, page * d * elem_bytes, stride0 * elem_bytes),
                           (BOX_COLS, min(page, tile_n), 1, 1))
    slots, max_ctx, hkv, d = shape
    return MapGeometry((d, hkv, max_ctx, slots),
                       (d * elem_bytes, hkv * d * elem_bytes, stride0 * elem_bytes),
                       (BOX_COLS, 1, tile_n, 1))


def check(geo: MapGeometry, address: int) -> str | None:
    """Why the driver would refuse this map (None when it takes it): the limits of
    cuTensorMapEncodeTiled, checked before any kernel runs."""
    if address % 16:
        return f"base address {address:#x} is not 16-byte aligned"
    if any(not 0 < d <= 2**32 for d in geo.dims):
        return f"dims {geo.dims} out of 1..2**32"
    if any(s % 16 or s >= 2**40 for s in geo.strides):
        return f"strides {geo.strides} (bytes) must be multiples of 16 below 2**40"
    if any(not 0 < b <= 256 for b in geo.box):
        return f"box {geo.box} out of 1..256"
    return None


@functools.cache
def _encode_fn():
    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    u32, p = ctypes.c_uint32, ctypes.c_void_p
    fn.argtypes = [p, ctypes.c_int, u32, p, p, p, p, p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode(address: int, dtype: str, geo: MapGeometry) -> TmaMap:
    """cuTensorMapEncodeTiled: 128-byte swizzle, 128-byte L2 promotion, zero fill."""
    reason = check(geo, address)
    if reason:
        raise ValueError(f"TMA map: {reason}")
    # the driver writes the map to a 64-byte aligned address
    raw = ctypes.create_string_buffer(128 + 64)
    aligned = (ctypes.addressof(raw) + 63) & ~63
    u64x4, u64x3, u32x4 = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
    err = _encode_fn()(aligned, _DTYPE[dtype], 4, address, u64x4(*geo.dims),
                       u64x3(*geo.strides), u32x4(*geo.box), u32x4(1, 1, 1, 1), 0,
                       _SWIZZLE_128B, _L2_PROMOTION_128B, 0)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: CUresult {err} ({geo})")
    out = TmaMap()
    ctypes.memmove(ctypes.addressof(out), aligned, 128)
    return out
