"""Optional baselines, used side by side with the suite's kernels when installed.

FlashInfer (fa2 paged prefill): the drafter block is appended to the request's pages first and
attended with ``causal=False``, which is exactly the `full` mask (every context key and every
block key). Planning reads host-side lengths, as FlashInfer's API requires, so it happens once
before timing; `run()` is graph-capturable (the wrapper is built with ``use_cuda_graph=True``).
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from drafter_attn.kernels.spec import Geometry


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


class FlashInferPaged:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper over HND pages, block appended."""

    def __init__(self, geometry: Geometry, page_size: int, ctx_lens: list[int], device,
                 generator: torch.Generator | None = None, backend: str = "fa2"):
        if geometry.mask != "full":
            raise ValueError("the FlashInfer baseline covers mask='full' only")
        import flashinfer

        g = geometry
        self.geometry = g
        qb = g.block_size
        kv_lens = [P + qb for P in ctx_lens]  # context followed by the block's own rows
        pages_per = [math.ceil(n / page_size) for n in kv_lens]
        num_pages = sum(pages_per)
        gen = generator or torch.Generator().manual_seed(0)
        order = torch.randperm(num_pages, generator=gen).to(torch.int32)
        dt = g.torch_dtype
        shape = (num_pages, g.num_kv_heads, page_size, g.head_dim)
        self.k_pages = torch.randn(shape, generator=gen).to(device=device, dtype=dt)
        self.v_pages = torch.randn(shape, generator=gen).to(device=device, dtype=dt)
        batch = len(ctx_lens)
        self.q = torch.randn(batch * qb, g.num_q_heads, g.head_dim, generator=gen).to(device=device, dtype=dt)
        i32 = dict(dtype=torch.int32, device=device)
        qo_indptr = torch.arange(0, (batch + 1) * qb, qb, **i32)
        kv_indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0).tolist()), **i32)
        kv_indices = order.to(device)
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages_per)], **i32)
        self.kv_bytes = 2 * sum(kv_lens) * g.num_kv_heads * g.head_dim * self.k_pages.element_size()
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=True, qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last, backend=backend)
        self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, g.num_q_heads, g.num_kv_heads,
                          g.head_dim, page_size, causal=False, q_data_type=dt, kv_data_type=dt)

    def run(self) -> torch.Tensor:
        return self.wrapper.run(self.q, (self.k_pages, self.v_pages))


def set_flashinfer_cache(path: str) -> None:
    """FlashInfer JIT-compiles on first plan; keep its build cache in `path`."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", path)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
