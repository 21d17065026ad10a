"""Engine-sized block tables and long contexts on the GPU (marker `gpu`, issue 12), against the
torch reference: tables 16x wider than the context with and without the `max_ctx` hint, the
split count planned from the hint, lengths beyond the hint (a caller's error the kernels still
compute right), graph capture with the hint, and contexts of 128k to 512k at batch 1-2.
The host-side logic (validation, split choice, buckets, bench options) is in tests/test_max_ctx.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.presets import PRESETS

pytestmark = pytest.mark.gpu

MAIN = PRESETS["qwen3-8b-dflash-b16"]
BACKENDS = ["cupy", "cupy:wgmma=0", "cutlass"]


def _fresh(spec: str):
    """The backend of `spec` with no plans yet (plans are per backend object)."""
    return dataclasses.replace(registry.from_spec(spec))


def _block(g, batch, gen):
    dt = g.torch_dtype
    shapes = ((batch, g.block_size, g.num_q_heads, g.head_dim), (batch, g.block_size, g.num_kv_heads, g.head_dim))
    q = torch.randn(*shapes[0], generator=gen).to("cuda", dt)
    kb = torch.randn(*shapes[1], generator=gen).to("cuda", dt)
    vb = torch.randn(*shapes[1], generator=gen).to("cuda", dt)
    return q, kb, vb


def _widen(table: torch.Tensor, factor: int, gen) -> torch.Tensor:
    """The table `factor` times as wide, the new columns random garbage ids (out of range too)."""
    extra = torch.randint(-(1 << 20), 1 << 20, (table.shape[0], table.shape[1] * (factor - 1)), generator=gen,
                          dtype=torch.int32).to(table.device)
    return torch.cat([table, extra], 1).contiguous()


def _assert_close(out, ref, dtype="bfloat16"):
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or poisoned elements)"
    o, r = out.double(), ref.double()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-12)).item()
    tol = 1e-2 if dtype == "bfloat16" else 3e-3
    assert rel < tol, f"relative error {rel:.2e} >= {tol:.0e}"


def _poison(like):
    torch.full_like(like, float("nan"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geom, page, lens", [
    (MAIN, 64, [8192, 100, 0, 3000]),
    (MAIN, 16, [1000, 4097]),
    (PRESETS["dflash2-w2048"], 128, [9000, 50]),
    (PRESETS["gpt-oss-20b-dflash"], 32, [2048, 777, 1]),
    (PRESETS["laguna-dflash"], 64, [5000, 600]),
])
def test_tables_16x_wider_with_and_without_the_hint(backend, geom, page, lens):
    impl = _fresh(backend)
    gen = torch.Generator().manual_seed(sum(lens) + page)
    q, kb, vb = _block(geom, len(lens), gen)
    kp, vp, table, ctx = random_paged_context(geom, lens, page, "cuda", gen)
    wide = _widen(table, 16, gen)
    kw = dict(mask=geom.mask, window=geom.window)
    ref = reference.paged_attention(q, kb, vb, kp, vp, table, ctx, **kw)
    for max_ctx in (None, max(lens) or 1):
        extra = {} if max_ctx is None else {"max_ctx": max_ctx}
        _poison(q)
        _assert_close(impl.paged_attention(q, kb, vb, kp, vp, wide, ctx, **kw, **extra), ref, geom.dtype)


@pytest.mark.parametrize("backend", ["cupy", "cutlass"])
def test_the_hint_plans_the_fitted_split_count(backend):
    """B=8 at 8k over a table of 128k: without the hint the split count follows the table's 2048
    tiles; with it, the fitted table's."""
    gen = torch.Generator().manual_seed(8)
    lens = [8192] * 8
    q, kb, vb = _block(MAIN, 8, gen)
    kp, vp, table, ctx = random_paged_context(MAIN, lens, 64, "cuda", gen)
    wide = _widen(table, 131072 // (table.shape[1] * 64), gen)
    assert wide.shape[1] * 64 == 131072
    splits = {}
    for name, t, hint in (("fitted", table, None), ("wide", wide, None), ("hinted", wide, 8192 + 16)):
        impl = _fresh(backend)
        out = impl.paged_attention(q, kb, vb, kp, vp, t, ctx, **({} if hint is None else {"max_ctx": hint}))
        (plan,) = impl._plans.values()
        splits[name] = plan.splits
        _assert_close(out, reference.paged_attention(q, kb, vb, kp, vp, table, ctx))
    assert splits["hinted"] == splits["fitted"]
    assert splits["wide"] >= splits["fitted"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_lengths_beyond_the_hint_still_compute_right(backend, layout):
    """ctx_lens above max_ctx break the contract; on the GPU nothing checks them (a device read),
    but the kernels read each request's whole context: only the split count was planned short."""
    impl = _fresh(backend)
    gen = torch.Generator().manual_seed(3)
    lens = [20000, 300]
    q, kb, vb = _block(MAIN, 2, gen)
    if layout == "paged":
        kp, vp, table, ctx = random_paged_context(MAIN, lens, 64, "cuda", gen)
        wide = _widen(table, 4, gen)
        ref = reference.paged_attention(q, kb, vb, kp, vp, table, ctx)
        _poison(q)
        out = impl.paged_attention(q, kb, vb, kp, vp, wide, ctx, max_ctx=256)
    else:
        ka, va, slots, ctx = random_arena_context(MAIN, lens, 65536, "cuda", gen)
        ref = reference.arena_attention(q, kb, vb, ka, va, slots, ctx)
        _poison(q)
        out = impl.arena_attention(q, kb, vb, ka, va, slots, ctx, max_ctx=256)
    _assert_close(out, ref)


def test_hinted_step_captures_without_host_syncs():
    """store + hinted attention over a wide table: eager under sync-debug "error", then a CUDA
    graph replays to the same output."""
    impl = _fresh("cupy")
    gen = torch.Generator().manual_seed(11)
    lens = [4000, 70]
    q, kb, vb = _block(MAIN, 2, gen)
    kp, vp, table, ctx = random_paged_context(MAIN, lens, 64, "cuda", gen, extra_pages=1)
    wide = _widen(table, 16, gen)
    k_new, v_new = kb.clone(), vb.clone()
    num_new = torch.tensor([16, 3], dtype=torch.int32, device="cuda")
    start = ctx.clone()

    def step():
        ctx.copy_(start)
        impl.store_paged(k_new, v_new, num_new, kp, vp, wide, ctx)
        return impl.paged_attention(q, kb, vb, kp, vp, wide, ctx, max_ctx=4016)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step().clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, eager)
    _assert_close(eager, reference.paged_attention(q, kb, vb, kp, vp, table, ctx))


# the default, the portable mma.sync path, and the warp-specialised kernels the sm90 table runs
# at 128k (tuner/specs/sm90-long.toml)
@pytest.mark.parametrize("backend", ["cupy", "cupy:wgmma=0", "cupy:ws=3,tile_n=32,lean=1,stages=9",
                                     "cupy:ws=2,stages=4"])
@pytest.mark.parametrize("layout", ["paged", "arena"])
@pytest.mark.parametrize("lens, page", [
    ([131072 + 5], 64),
    ([262144, 131072 - 3], 128),
    ([524288], 64),
], ids=["128k", "256k+128k", "512k"])
def test_long_contexts(backend, layout, lens, page):
    impl = _fresh(backend)
    gen = torch.Generator().manual_seed(len(lens) + page)
    q, kb, vb = _block(MAIN, len(lens), gen)
    hint = max(lens) + MAIN.block_size
    if layout == "paged":
        cache = random_paged_context(MAIN, lens, page, "cuda", gen)
        ref = reference.paged_attention(q, kb, vb, *cache)
        for extra in ({}, {"max_ctx": min(hint, cache[2].shape[1] * page)}):
            _poison(q)
            _assert_close(impl.paged_attention(q, kb, vb, *cache, **extra), ref)
    else:
        cache = random_arena_context(MAIN, lens, hint, "cuda", gen, extra_slots=0)
        ref = reference.arena_attention(q, kb, vb, *cache)
        _poison(q)
        _assert_close(impl.arena_attention(q, kb, vb, *cache), ref)
    del cache, ref
    torch.cuda.empty_cache()


def test_long_context_decode_step_checks():
    """The measured step at 256k x 2 (one layer), paged with a table of 512k and the hint, and
    arena: each passes its correctness check against the reference."""
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner.step import DecodeStep

    g = MAIN.with_(num_layers=1)
    for kw in (dict(layout="paged", page=64, table_capacity=524288, max_ctx_hint=True),
               dict(layout="arena", page=None)):
        layout, page = kw.pop("layout"), kw.pop("page")
        step = DecodeStep(Problem(g, layout, page, 2, 262144), "cupy", **kw)
        assert step.check() < 1e-2
        step.run()
        torch.cuda.synchronize()
        del step
        torch.cuda.empty_cache()
