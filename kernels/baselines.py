"""Optional baselines, run side by side with the suite's kernels when their library is installed.

Each baseline attends the drafter block over the same geometry, batch and context, on data of
its own layout (the block's K/V appended to the request's pages, as those libraries expect), and
exposes `run()` (graph-capturable, no host sync), `kv_bytes` and `label`. Built with `layers=L`
it holds L layers' pages and queries under one plan, and `run()` attends every layer back to back,
as a serving step runs them (what `bench decode` times beside a whole step):

  flashinfer-fa2        FlashInfer's BatchPrefillWithPagedKVCacheWrapper planned for this exact
                        shape (its per-shape plan: its strongest kernel choice)
  flashinfer-fa2-graph  the same wrapper built with use_cuda_graph=True, the plan a graph-replayed
                        serving step runs (valid for any lengths, slower per shape)
  trtllm-xqa            TensorRT-LLM's XQA decode kernel through FlashInfer's
                        trtllm_batch_decode_with_kv_cache, with q_len_per_req = Qb (SM90/SM120)

All three cover the `full` mask (every context key and every block key): FlashInfer with
causal=False, XQA with an all-ones speculative-decoding mask. Planning reads host-side lengths,
as these APIs require, so it happens once before timing.
"""

from __future__ import annotations

import importlib.util
import math
import os

import torch

from drafter_attn.kernels.cache import _randn
from drafter_attn.kernels.footprint import kv_bytes
from drafter_attn.kernels.spec import Geometry

FA2, FA2_GRAPH, XQA = "flashinfer-fa2", "flashinfer-fa2-graph", "trtllm-xqa"
NAMES = (FA2, FA2_GRAPH, XQA)
XQA_PAGE_SIZES = (16, 32, 64, 128)
_WORKSPACE_BYTES = 256 << 20


def is_baseline(impl: str) -> bool:
    """Whether a row's impl is a baseline (also as relabelled "NAME (attention xL)")."""
    return str(impl).split(" (", 1)[0] in NAMES


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def reason(name: str, geometry: Geometry, page_size: int, sm: int | None = None) -> str | None:
    """None when baseline `name` runs this geometry and page size here, else why not."""
    if name not in NAMES:
        return f"unknown baseline {name!r} (known: {', '.join(NAMES)})"
    if not flashinfer_available():
        return "FlashInfer is not installed (pip install flashinfer-python)"
    if geometry.mask != "full":
        return f"{name} covers mask 'full' only (this geometry: {geometry.mask})"
    if name == XQA:
        if page_size not in XQA_PAGE_SIZES:
            return f"{name} takes page sizes {XQA_PAGE_SIZES} only"
        if sm is not None and sm not in (90, 120, 121):
            return f"{name} runs on SM 90/120 (FlashInfer picks trtllm-gen elsewhere)"
    return None


class _AppendedPages:
    """Random HND pages holding each request's context followed by the block's own rows, in a
    random page order, plus the block queries: the data every baseline attends, for each of
    `layers` layers (one page order, so one plan serves them all)."""

    def __init__(self, geometry: Geometry, page_size: int, ctx_lens: list[int], device,
                 generator: torch.Generator | None, layers: int = 1):
        if layers < 1:
            raise ValueError(f"layers must be at least 1, got {layers}")
        g = geometry
        gen = generator or torch.Generator().manual_seed(0)
        qb = g.block_size
        self.kv_lens = [P + qb for P in ctx_lens]  # context followed by the block's own rows
        self.pages_per = [math.ceil(n / page_size) for n in self.kv_lens]
        num_pages = sum(self.pages_per)
        self.order = torch.randperm(num_pages, generator=gen).to(torch.int32)
        shape = (num_pages, g.num_kv_heads, page_size, g.head_dim)
        # drawn on the device from seeds of `gen` (GBs at long contexts would take minutes on the CPU)
        q_shape = (len(ctx_lens) * qb, g.num_q_heads, g.head_dim)
        self.layers = [(_randn(q_shape, g, device, gen), (_randn(shape, g, device, gen), _randn(shape, g, device, gen)))
                       for _ in range(layers)]  # (queries, (K pages, V pages)) of each layer
        self.kv_bytes = kv_bytes(sum(self.kv_lens), g.num_kv_heads, g.head_dim, layers,
                                 self.layers[0][0].element_size())
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def block_table(self) -> torch.Tensor:
        """[B, max pages] int32, each request's pages in order (padded with its last page)."""
        width = max(self.pages_per)
        rows, start = [], 0
        for n in self.pages_per:
            ids = self.order[start:start + n].tolist()
            rows.append(ids + ids[-1:] * (width - n))
            start += n
        return torch.tensor(rows, dtype=torch.int32)


class FlashInferPaged(_AppendedPages):
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper over HND pages, block appended; `graph`
    builds the CUDA-graph plan (use_cuda_graph=True) instead of the per-shape plan."""

    def __init__(self, geometry: Geometry, page_size: int, ctx_lens: list[int], device,
                 generator: torch.Generator | None = None, graph: bool = False, backend: str = "fa2",
                 layers: int = 1):
        if geometry.mask != "full":
            raise ValueError("the FlashInfer baseline covers mask='full' only")
        import flashinfer

        super().__init__(geometry, page_size, ctx_lens, device, generator, layers)
        g = geometry
        self.label = FA2_GRAPH if graph else FA2
        qb, batch = g.block_size, len(ctx_lens)
        i32 = dict(dtype=torch.int32, device=device)
        qo_indptr = torch.arange(0, (batch + 1) * qb, qb, **i32)
        kv_indptr = torch.tensor([0, *torch.tensor(self.pages_per).cumsum(0).tolist()], **i32)
        kv_indices = self.order.to(device)
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(self.kv_lens, self.pages_per)], **i32)
        buffers = dict(qo_indptr_buf=qo_indptr, paged_kv_indptr_buf=kv_indptr,
                       paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last) if graph else {}
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "HND", use_cuda_graph=graph, backend=backend, **buffers)
        self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, g.num_q_heads, g.num_kv_heads,
                          g.head_dim, page_size, causal=False, q_data_type=g.torch_dtype,
                          kv_data_type=g.torch_dtype)

    def run(self) -> torch.Tensor:
        """Every layer's attention; the last layer's output."""
        for q, kv in self.layers:
            out = self.wrapper.run(q, kv)
        return out


class TrtllmXqa(_AppendedPages):
    """TensorRT-LLM's XQA kernel (FlashInfer's trtllm_batch_decode_with_kv_cache, backend xqa):
    Qb queries per request, the block visible to every block query (all-ones mask)."""

    label = XQA

    def __init__(self, geometry: Geometry, page_size: int, ctx_lens: list[int], device,
                 generator: torch.Generator | None = None, layers: int = 1):
        if geometry.mask != "full":
            raise ValueError("the XQA baseline covers mask='full' only")
        super().__init__(geometry, page_size, ctx_lens, device, generator, layers)
        g = geometry
        qb = g.block_size
        self.block_tables = self.block_table().to(device)
        self.seq_lens = torch.tensor(self.kv_lens, dtype=torch.int32, device=device)
        self.max_seq_len = max(self.kv_lens)
        words = ((qb + 31) // 32) * 2  # the mask packs each query row's block keys in uint16 words
        self.mask = torch.full((len(ctx_lens), qb, words), -1, dtype=torch.int16, device=device).view(torch.uint16)
        self.scale = g.head_dim ** -0.5
        self.qb = qb

    def run(self) -> torch.Tensor:
        """Every layer's attention; the last layer's output."""
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache

        for q, kv in self.layers:
            out = trtllm_batch_decode_with_kv_cache(
                q, kv, self.workspace, self.block_tables, self.seq_lens, self.max_seq_len,
                bmm1_scale=self.scale, bmm2_scale=1.0, kv_layout="HND", q_len_per_req=self.qb,
                mask=self.mask)  # FlashInfer picks XQA on SM90/SM120
        return out


def build(name: str, geometry: Geometry, page_size: int, ctx_lens: list[int], device,
          generator: torch.Generator | None = None, layers: int = 1):
    """Baseline `name` over `ctx_lens` requests, `layers` layers of them (see the module
    docstring for the names)."""
    if name == XQA:
        return TrtllmXqa(geometry, page_size, ctx_lens, device, generator, layers=layers)
    if name in (FA2, FA2_GRAPH):
        return FlashInferPaged(geometry, page_size, ctx_lens, device, generator, graph=name == FA2_GRAPH,
                               layers=layers)
    raise ValueError(f"unknown baseline {name!r} (known: {', '.join(NAMES)})")


def set_flashinfer_cache(path: str) -> None:
    """FlashInfer JIT-compiles on first plan; keep its build cache in `path`."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", path)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
