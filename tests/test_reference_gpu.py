"""The reference on a GPU: same answers as on the CPU, no host sync, and CUDA-graph capturable."""

import contextlib

import pytest
import torch

from helpers import dense_into_arena, make_generator, random_block
from drafter_attn.kernels import reference
from drafter_attn.kernels.cache import paged_to_dense, random_arena_context, random_paged_context
from drafter_attn.kernels.spec import Geometry

pytestmark = pytest.mark.gpu

CASES = [("full", None), ("sliding", 24), ("sliding_causal", 7)]
LENS, PS, T = [0, 15, 16, 17, 300], 16, 16


@contextlib.contextmanager
def sync_forbidden():
    """Any host synchronisation inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _inputs(mask, window, seed=0):
    """One decode step's inputs on the GPU, the same context in both layouts (room for T new rows)."""
    g = Geometry(32, 8, 128, 16, mask, window)
    gen = make_generator(seed)
    paged = random_paged_context(g, LENS, PS, "cuda", gen, extra_pages=T // PS)
    arena = random_arena_context(g, LENS, max(LENS) + T, "cuda", gen)
    dense_into_arena(*arena[:3], *paged_to_dense(*paged))  # the same logical context
    q, k_blk, v_blk = random_block(g, len(LENS), "cuda", gen)
    _, k_new, v_new = random_block(g, len(LENS), "cuda", gen)
    num_new = torch.tensor([16, 0, 1, 5, 16], dtype=torch.int32, device="cuda")
    return g, paged, arena, (q, k_blk, v_blk), (k_new, v_new, num_new)


def _step(g, paged, arena, block, new):
    """A decode step on both layouts: store, then attend. Returns both outputs."""
    reference.store_paged(*new, *paged)
    reference.store_arena(*new, *arena)
    kw = dict(mask=g.mask, window=g.window)
    return (reference.paged_attention(*block, *paged, **kw), reference.arena_attention(*block, *arena, **kw))


@pytest.mark.parametrize("mask,window", CASES)
def test_gpu_matches_cpu(mask, window):
    g, paged, arena, block, new = _inputs(mask, window)
    cpu = lambda ts: [t.cpu() for t in ts]  # noqa: E731
    cpu_out = _step(g, cpu(paged), cpu(arena), cpu(block), cpu(new))
    gpu_out = _step(g, paged, arena, block, new)
    for want, got in zip(cpu_out, gpu_out):
        torch.testing.assert_close(got.cpu(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gpu_out[0], gpu_out[1], atol=8e-3, rtol=0)


@pytest.mark.parametrize("mask,window", CASES)
def test_no_host_sync(mask, window):
    g, paged, arena, block, new = _inputs(mask, window)
    with sync_forbidden():
        _step(g, paged, arena, block, new)
    torch.cuda.synchronize()


@pytest.mark.parametrize("mask,window", CASES)
def test_cuda_graph_replay_matches_eager(mask, window):
    g, paged, arena, block, new = _inputs(mask, window)
    state = [t.clone() for t in paged + arena]  # the store mutates caches and ctx_lens

    def restore():
        for dst, src in zip(paged + arena, state):
            dst.copy_(src)

    eager = _step(g, paged, arena, block, new)
    eager_state = [t.clone() for t in paged + arena]

    # Warm up on a side stream (lazy initialisation must not happen during capture).
    restore()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(g, paged, arena, block, new)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(g, paged, arena, block, new)
    restore()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(static_out, eager):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for got, want in zip(paged + arena, eager_state):
        assert torch.equal(got, want)


def test_sync_detector_works():
    """Control: the detector used above does catch a blocking read of device memory."""
    x = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError), sync_forbidden():
        x.item()
