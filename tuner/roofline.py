"""The memory roofline: bytes a step must move, over the copy bandwidth measured on this GPU.

Decode attention of a drafter block is memory-bound on Hopper-class GPUs once the Qb*G query rows
of a KV head share tensor-core tiles, so its floor is the bytes that must cross HBM (each context
K/V byte read once, q / block K/V / out once) divided by what a plain device-to-device copy
achieves here (bytes read + bytes written), measured in the same process.
"""

from __future__ import annotations

import functools

import torch

from drafter_attn.kernels.footprint import TABLE_ENTRY_BYTES, kv_bytes, pages_for
from drafter_attn.kernels.spec import Geometry


@functools.cache
def copy_bandwidth(device_index: int | None = None, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes per second of a large device-to-device copy (read + write), median of `reps`."""
    index = torch.cuda.current_device() if device_index is None else device_index
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=f"cuda:{index}").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    times.sort()
    del src, dst
    return 2 * nbytes / times[len(times) // 2]


def visible_context(geometry: Geometry, ctx_len: int) -> int:
    """Context keys some row of the block can see (the window's left edge is row 0's)."""
    if geometry.mask == "full":
        return ctx_len
    return min(ctx_len, geometry.window - 1)


def attention_bytes(geometry: Geometry, ctx_lens: list[int], elem_bytes: int = 2,
                    page_size: int | None = None) -> int:
    """Least HBM bytes one attention call moves: context K/V read once, q, block K/V, out once,
    and the block-table entries of the pages read (paged)."""
    g = geometry
    kv_row = kv_bytes(1, g.num_kv_heads, g.head_dim, 1, elem_bytes)  # K and V of one token
    ctx = sum(visible_context(g, P) for P in ctx_lens)
    per_req = (2 * g.block_size * g.num_q_heads * g.head_dim * elem_bytes  # q, out
               + g.block_size * kv_row)  # block K/V
    table = (sum(pages_for(visible_context(g, P), page_size) for P in ctx_lens) * TABLE_ENTRY_BYTES
             if page_size else 0)
    return ctx * kv_row + len(ctx_lens) * per_req + table


def call_bytes(geometry: Geometry, batch: int, ctx: int, page_size: int | None = None) -> int:
    """`attention_bytes` of one attention call over `batch` requests of `ctx` tokens in the
    geometry's own dtype: the size of a table point's or a baseline row's read floor."""
    return attention_bytes(geometry, [ctx] * batch, geometry.torch_dtype.itemsize, page_size)


def store_bytes(geometry: Geometry, num_new: list[int], elem_bytes: int = 2) -> int:
    """Least bytes a store moves: each stored K/V row read once and written once."""
    return 2 * kv_bytes(sum(num_new), geometry.num_kv_heads, geometry.head_dim, 1, elem_bytes)
