"""Every kernel backend against the torch reference on the GPU (marker `gpu`).

One matrix for all backends (parametrised by registry name): random geometries drawn from the
presets and edge geometries, every page size 8..256 and the arena, ragged context lengths with
0, 1, page edges and 64k, every mask mode with windows below and above Qb, bf16 and fp16.
Outputs are poisoned with NaN before each run (the caching allocator hands the poisoned block
to the backend's output), so an unwritten element fails.
"""

from __future__ import annotations

import random

import pytest
import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.cache import random_arena_context, random_paged_context
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Geometry, Problem

pytestmark = pytest.mark.gpu

# Registry names, optionally with pinned params: "cupy" runs wgmma on sm_90 where the shape allows
# (pipelined, lean cp.async tiles below batch 8), "cupy:wgmma=0" forces the mma.sync path
# everywhere; "cupy:overlap=1" / "=2" software-pipeline the wgmma path without lean or TMA
# (sm_90a only; they refuse shapes without it, e.g. 9-warp CTAs), "cupy:tma=1" loads its
# context tiles with bulk tensor copies (the same shapes, sm_90a only), "cupy:lean=1" (and on
# mma.sync, "cupy:lean=1,wgmma=0") issues a tile's copies from one base address and folds the
# softmax scale into exp2 (tests/test_lean.py), "cupy:ws=2" is the warp-specialised kernel (a
# producer warpgroup issuing TMA copies, two to four consumer warpgroups, "ws=4" and
# "ws=3,tile_n=32" on 32-key tiles, each with its consumers' lean tile loop, "lean=0" without it:
# a mask branch a score, O rescaled every tile; "early_ids=1" a split's first page ids, Q and
# the tensor maps fetched before the context length; "ws_overlap=1" a tile's P V under the next
# tile's S; "q_step=1" Q's copies addressed by a step a row instead of a division, both before
# the context length (early_ids) and after; sm_90a only, rows dealt over CTAs of at most 64),
# "cupy:trim=1" the pipelined wgmma path's tile loop trimmed as ws's lean one (tests/test_trim.py),
# "cupy:combine=1" merges
# the splits with a warp a row (every SM; the tests' shapes pack at most 1024 rows a call, where
# "cupy" merges a CTA a row), "one_trip=1" either combine with its lse values and first partials
# read in one round trip (16 splits a CTA a row, 4 a warp a row, then 4 a trip: the forced split
# counts' 40 take several); "pair=1" runs ws split pairs as clusters of two CTAs, each handing
# the other the half of the rows it keeps through shared memory (st.async; no combine at two
# splits, half the partials above; odd forced counts refused);
# "cutlass" is the CuTe
# port of the same algorithm (mma.sync), "cutlass:wgmma=1" its warpgroup-MMA path on sm_90 where
# the shape allows. `cupy:wgmma=1` on CTAs that are not whole warpgroups (laguna's 9 warps padded
# to 3 warpgroups) is checked by the test_padded_wgmma_* tests at the end of this file.
BACKENDS = ["cupy", "cupy:wgmma=0", "cupy:overlap=1", "cupy:overlap=2", "cupy:tma=1", "cupy:lean=1",
            "cupy:lean=1,wgmma=0", "cupy:ws=2", "cupy:ws=3", "cupy:ws=4",
            "cupy:ws=3,tile_n=32", "cupy:ws=3,tile_n=32,stages=9", "cupy:ws=2,lean=0",
            "cupy:ws=3,tile_n=32,stages=9,lean=0", "cupy:ws=4,lean=0",
            "cupy:ws=2,early_ids=1", "cupy:ws=3,tile_n=32,stages=9,early_ids=1",
            "cupy:ws=4,early_ids=1", "cupy:ws=2,ws_overlap=1",
            "cupy:ws=3,tile_n=32,early_ids=1,ws_overlap=1", "cupy:ws=3,tile_n=32,stages=9,early_ids=1,q_step=1",
            "cupy:ws=2,q_step=1", "cupy:trim=1",
            "cupy:combine=1", "cupy:one_trip=1", "cupy:combine=1,one_trip=1",
            "cupy:ws=3,tile_n=32,stages=9,early_ids=1,q_step=1,one_trip=1",
            "cupy:ws=3,tile_n=32,stages=6,early_ids=1,one_trip=1,pair=1", "cupy:ws=2,stages=4,pair=1",
            "cutlass", "cutlass:wgmma=1"]


def _backend(spec: str):
    return registry.from_spec(spec)


def _preset_for(impl, name: str, layout: str, page: int | None, lens) -> Geometry:
    """PRESETS[name], or, where `impl` refuses it (the overlap variants take no 9-warp CTA such as
    laguna's 144 rows), the same geometry with 64 query heads (G=8: 128 rows, two warpgroups),
    or, refused again (`pair`: at most 64 rows, one CTA), with 32 (G=4: 64 rows); each keeps its
    mask, window and block size."""
    for group in (None, 8, 4):
        geom = PRESETS[name] if group is None else PRESETS[name].with_(
            num_q_heads=group * PRESETS[name].num_kv_heads)
        problem = Problem(geom, layout, page if layout == "paged" else None, len(lens), max(lens))
        if impl.supports(problem) is None:
            return geom
    return geom


PAGE_SIZES = [8, 16, 32, 64, 128, 256]
N_CASES = 168  # x2 layouts (paged, arena) = 336 random cases per backend

EXTRA_GEOMETRIES = [
    Geometry(8, 8, 128, 16),  # G=1
    Geometry(32, 2, 64, 4),  # G=16
    Geometry(36, 4, 128, 12),  # G=9, Qb 12
    Geometry(16, 4, 128, 1),  # Qb=1
    Geometry(8, 1, 64, 16),  # G=8 over a single KV head
]


def _cases():
    rng = random.Random(20261130)
    geoms = list(PRESETS.values()) + EXTRA_GEOMETRIES
    cases = []
    for n in range(N_CASES):
        g = geoms[n % len(geoms)]
        mask = ["full", "sliding", "sliding_causal"][rng.randrange(3)] if n % 3 else g.mask
        window = None
        if mask != "full":
            window = rng.choice([1, 3, g.block_size - 1 or 1, g.block_size, 37, 200, 1024, 5000])
        dtype = rng.choice(["bfloat16", "float16"])
        page = PAGE_SIZES[n % len(PAGE_SIZES)]
        batch = rng.choice([1, 2, 3, 5])
        special = [0, 1, page - 1, page, page + 1, 2 * page + 3, rng.randrange(1, 3000)]
        lens = [rng.choice(special) for _ in range(batch)]
        if n % 40 == 7:  # a long context
            lens = [65536 + rng.randrange(0, 100)]
        cases.append(pytest.param(g.with_(mask=mask, window=window, dtype=dtype), page, lens,
                                  n, id=f"{n}-h{g.num_q_heads}/{g.num_kv_heads}-d{g.head_dim}"
                                  f"-qb{g.block_size}-{mask}{window or ''}-p{page}-{dtype}-{lens}"))
    return cases


def _block_inputs(g: Geometry, batch: int, gen: torch.Generator):
    dt = g.torch_dtype
    q = torch.randn(batch, g.block_size, g.num_q_heads, g.head_dim, generator=gen).to("cuda", dt)
    k = torch.randn(batch, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", dt)
    v = torch.randn(batch, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", dt)
    return q, k, v


def _poison_allocator(like: torch.Tensor) -> None:
    """Fill the block the next same-sized allocation will get with NaN."""
    torch.full_like(like, float("nan"))


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or poisoned elements)"
    o, r = out.double(), ref.double()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-12)).item()
    tol = 1e-2 if dtype == "bfloat16" else 3e-3
    assert rel < tol, f"relative error {rel:.2e} >= {tol:.0e}"
    assert (o - r).abs().max().item() < 0.1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["paged", "arena"])
@pytest.mark.parametrize("geom,page,lens,seed", _cases())
def test_attention_matches_reference(backend, layout, geom, page, lens, seed):
    impl = _backend(backend)
    gen = torch.Generator().manual_seed(seed)
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    kw = dict(mask=geom.mask, window=geom.window)
    problem = Problem(geom, layout, page if layout == "paged" else None, len(lens), max(lens))
    refused = impl.supports(problem)
    if refused:  # a variant that refuses a shape says so before any kernel runs
        cache = (random_paged_context(geom, lens, page, "cuda", gen) if layout == "paged"
                 else random_arena_context(geom, lens, max(lens) + 5, "cuda", gen))
        fn = impl.paged_attention if layout == "paged" else impl.arena_attention
        with pytest.raises(ValueError, match="cannot run this problem"):
            fn(q, kb, vb, *cache, **kw)
        return
    check_layout(impl, geom, layout, page, lens, (q, kb, vb), gen)


def check_layout(impl, geom: Geometry, layout: str, page: int | None, lens, block, gen) -> None:
    """`impl`'s call on a fresh random context of `lens` (paged at `page`, or the arena) against
    the reference, its output's memory poisoned first."""
    kw = dict(mask=geom.mask, window=geom.window)
    if layout == "paged":
        cache = random_paged_context(geom, lens, page, "cuda", gen)
        ref = reference.paged_attention(*block, *cache, **kw)
        _poison_allocator(block[0])
        out = impl.paged_attention(*block, *cache, **kw)
    else:
        cache = random_arena_context(geom, lens, max(lens) + 5, "cuda", gen)
        ref = reference.arena_attention(*block, *cache, **kw)
        _poison_allocator(block[0])
        out = impl.arena_attention(*block, *cache, **kw)
    _assert_close(out, ref, geom.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 16, 40])  # 40: more splits than lanes in the combine
def test_forced_split_counts(backend, splits):
    """The split-KV combine against the single-pass result, including splits with no work (a
    count a variant refuses, `pair`'s odd ones, refused before any kernel runs)."""
    geom = PRESETS["qwen3-8b-dflash-b16"]
    impl = _backend(backend).with_params(num_splits=splits)
    gen = torch.Generator().manual_seed(splits)
    lens = [0, 5, 700, 4097]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    cache = random_paged_context(geom, lens, 64, "cuda", gen)
    if impl.supports(Problem(geom, "paged", 64, len(lens), max(lens))):
        with pytest.raises(ValueError, match="cannot run this problem"):
            impl.paged_attention(q, kb, vb, *cache)
        return
    ref = reference.paged_attention(q, kb, vb, *cache)
    _poison_allocator(q)
    _assert_close(impl.paged_attention(q, kb, vb, *cache), ref, geom.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page,extra,mask", [(64, 0, "full"), (64, 1, "full"), (64, 30, "sliding"),
                                             (64, 70, "full"), (16, 5, "sliding_causal")])
def test_tables_wider_than_the_context(backend, page, extra, mask):
    """Tables `extra` pages wider than the longest context needs (the unused columns garbage
    ids) over 16 splits. The ws producer with `early_ids` copies each split's first page ids
    before the context length lands, planned for a context that fills the table: the longest
    request here takes them from there (shifted by up to a page), a request 30 pages short a part
    shifted further (every split but the first), 70 pages short none (they are read again); the
    short requests go the second way."""
    geom = PRESETS["qwen3-8b-dflash-b16"]
    geom = geom.with_(mask=mask, window=None if mask == "full" else 700)
    impl = _backend(backend).with_params(num_splits=16)
    gen = torch.Generator().manual_seed(page + extra)
    lens = [4000, 4000 - 3 * page + 1, 900, 0]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    width = -(-max(lens) // page) + extra
    cache = random_paged_context(geom, lens, page, "cuda", gen, max_pages=width)
    kw = dict(mask=geom.mask, window=geom.window)
    ref = reference.paged_attention(q, kb, vb, *cache, **kw)
    _poison_allocator(q)
    _assert_close(impl.paged_attention(q, kb, vb, *cache, **kw), ref, geom.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("profile", ["climbing", "sink"])
def test_scores_that_move_the_running_max(backend, profile):
    """Keys scaled up along the context make every row's running max climb tile after tile past
    any slack (the ws `lean` loop rescales O only when a max moves by more than 2^8), and a sink
    (the first tokens' keys scaled 4x) leaves every later max of its split stale; each row's
    query differs, so within a warp some rows move and others do not."""
    geom = PRESETS["qwen3-8b-dflash-b16"]
    impl = _backend(backend)
    page = 64
    gen = torch.Generator().manual_seed(11 if profile == "climbing" else 12)
    lens = [3000, 1111]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    k_pages, v_pages, table, ctx_lens = random_paged_context(geom, lens, page, "cuda", gen)
    factor = torch.ones(k_pages.shape[0], 1, page, 1, device="cuda")
    for b, n in enumerate(lens):
        pos = torch.arange(n, device="cuda", dtype=torch.float32)
        f = 1 + pos / 400 if profile == "climbing" else torch.where(pos < 4, 4.0, 1.0)
        f = torch.nn.functional.pad(f, (0, -n % page)).view(-1, page)
        factor[table[b, :f.shape[0]].long(), 0] = f.unsqueeze(-1)
    k_pages = (k_pages.float() * factor).to(k_pages.dtype)
    cache = (k_pages, v_pages, table, ctx_lens)
    ref = reference.paged_attention(q, kb, vb, *cache)
    _poison_allocator(q)
    _assert_close(impl.paged_attention(q, kb, vb, *cache), ref, geom.dtype)


def _store_inputs(geom, lens, rows, gen):
    batch = len(lens)
    dt = geom.torch_dtype
    k_new = torch.randn(batch, rows, geom.num_kv_heads, geom.head_dim, generator=gen).to("cuda", dt)
    v_new = torch.randn_like(k_new)
    num_new = torch.randint(0, rows + 1, (batch,), generator=gen, dtype=torch.int32).to("cuda")
    num_new[0] = rows  # all rows valid in one request, and often 0 in another
    return k_new, v_new, num_new


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [8, 16, 64, 256, None])
@pytest.mark.parametrize("rows", [16, 300])
def test_store_matches_reference(backend, page, rows):
    impl = _backend(backend)
    geom = PRESETS["gpt-oss-20b-dflash"] if rows == 16 else PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(rows + (page or 1))
    lens = [0, page - 1 if page else 9, 1000, 31]
    k_new, v_new, num_new = _store_inputs(geom, lens, rows, gen)
    if page:
        # extra pages per request give the store room to write past each context
        cache = list(random_paged_context(geom, lens, page, "cuda", gen, extra_pages=rows // page + 2))
        ref_cache = [t.clone() for t in cache]
        reference.store_paged(k_new, v_new, num_new, *ref_cache)
        impl.store_paged(k_new, v_new, num_new, *cache)
    else:
        cache = list(random_arena_context(geom, lens, max(lens) + rows + 3, "cuda", gen))
        ref_cache = [t.clone() for t in cache]
        reference.store_arena(k_new, v_new, num_new, *ref_cache)
        impl.store_arena(k_new, v_new, num_new, *cache)
    for got, want in zip(cache, ref_cache):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["cupy", "cutlass"])
def test_stores_on_two_streams_at_once(backend):
    """Two decode loops on two streams, their stores in flight together (arena, one slot per
    request, rows over many CTAs): each store's per-request arrival counters are its stream's,
    so every length advances by exactly its rows and every row lands (with one buffer for both
    streams, their arrivals mixed: lengths not advanced, counters left non-zero)."""
    impl = _fresh(backend)
    geom = PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(11)
    lens, steps, rows = [5, 40, 0, 700] * 16, 24, 16
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    loops = []
    for _ in streams:
        cache = list(random_arena_context(geom, lens, max(lens) + steps * rows, "cuda", gen))
        news = [_store_inputs(geom, lens, rows, gen) for _ in range(steps)]
        want = [t.clone() for t in cache]
        for new in news:
            reference.store_arena(*new, *want)
        loops.append((cache, news, want))
    torch.cuda.synchronize()
    for step in range(steps):  # interleaved: the two streams' stores overlap on the GPU
        for s, (cache, news, _) in zip(streams, loops):
            with torch.cuda.stream(s):
                impl.store_arena(*news[step], *cache)
    torch.cuda.synchronize()
    for cache, _, want in loops:
        assert torch.equal(cache[-1], want[-1])  # ctx_lens
        for got, ref in zip(cache, want):
            assert torch.equal(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_graph_replay_and_no_host_sync(backend, layout):
    """store + attention: eager under sync-debug "error", then a captured graph replays to the
    same result (the graph replays against a fresh copy of the cache state)."""
    impl = _backend(backend)
    lens = [100, 2049, 5]
    geom = _preset_for(impl, "laguna-dflash", layout, 64, lens)
    gen = torch.Generator().manual_seed(7)
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    k_new, v_new, num_new = _store_inputs(geom, lens, geom.block_size, gen)
    if layout == "paged":
        cache = list(random_paged_context(geom, lens, 64, "cuda", gen, extra_pages=8))
        store, attend = impl.store_paged, impl.paged_attention
    else:
        cache = list(random_arena_context(geom, lens, 2200, "cuda", gen))
        store, attend = impl.store_arena, impl.arena_attention
    kw = dict(mask=geom.mask, window=geom.window)
    initial = [t.clone() for t in cache]

    def step():
        store(k_new, v_new, num_new, *cache)
        return attend(q, kb, vb, *cache, **kw)

    step()  # warm-up: compile, load, allocate workspaces
    for t, t0 in zip(cache, initial):
        t.copy_(t0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager_cache = [t.clone() for t in cache]

    for t, t0 in zip(cache, initial):
        t.copy_(t0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for t, t0 in zip(cache, initial):
        t.copy_(t0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)
    for got, want in zip(cache, eager_cache):
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [16, 64, 128, None])
def test_nan_past_the_context(backend, page):
    """Cache rows past each context (the rest of its last page, pages no table names, arena
    rows past the length, unassigned slots) hold NaN, as never-written pool memory may: a kernel
    that reads them in whole tiles (the TMA path) must keep them out of P.V."""
    impl = _fresh(backend)
    geom = PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(page or 3)
    lens = [1, 63, 65, 700, 2049, 0]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    if page:
        k, v, table, ctx = random_paged_context(geom, lens, page, "cuda", gen, extra_pages=1)
        ref = reference.paged_attention(q, kb, vb, k, v, table, ctx)
        used = torch.zeros(k.shape[0], page, dtype=torch.bool, device="cuda")
        for b, n in enumerate(lens):
            for j in range(-(-n // page)):
                used[int(table[b, j]), : min(page, n - j * page)] = True
        for t in (k, v):
            t.masked_fill_(~used[:, None, :, None], float("nan"))
        fn, cache = impl.paged_attention, (k, v, table, ctx)
    else:
        k, v, slots, ctx = random_arena_context(geom, lens, 2100, "cuda", gen, extra_slots=2)
        ref = reference.arena_attention(q, kb, vb, k, v, slots, ctx)
        used = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool, device="cuda")
        for b, n in enumerate(lens):
            used[int(slots[b]), :n] = True
        for t in (k, v):
            t.masked_fill_(~used[:, :, None, None], float("nan"))
        fn, cache = impl.arena_attention, (k, v, slots, ctx)
    _poison_allocator(q)
    _assert_close(fn(q, kb, vb, *cache), ref, geom.dtype)


def _main_paged_case(seed: int, lens: list[int]):
    """The main preset's block inputs and a random page-64 cache of `lens` (geometry, (q, k_blk,
    v_blk), cache)."""
    geom = PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(seed)
    block = _block_inputs(geom, len(lens), gen)
    return geom, block, random_paged_context(geom, lens, 64, "cuda", gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_cache_addresses_between_calls(backend):
    """A plan's second call on other cache tensors of the same shapes reads those (the TMA
    path's tensor maps hold the cache addresses: they are encoded again)."""
    impl = _fresh(backend)
    geom, (q, kb, vb), first = _main_paged_case(5, [300, 1500])
    second = [t.clone() for t in first]
    second[0].normal_(generator=torch.Generator("cuda").manual_seed(1))
    second[1].normal_(generator=torch.Generator("cuda").manual_seed(2))
    for cache in (first, second, first):
        ref = reference.paged_attention(q, kb, vb, *cache)
        _assert_close(impl.paged_attention(q, kb, vb, *cache), ref, geom.dtype)


def _shifted(t: torch.Tensor, elems: int) -> torch.Tensor:
    """A contiguous copy of `t` whose data_ptr is `elems` elements past an allocation's start:
    the same shape and strides, so a planned call's fast path takes it."""
    flat = torch.empty(t.numel() + elems, dtype=t.dtype, device=t.device)
    view = flat[elems:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("backend", ["cupy", "cupy:tma=1", "cupy:ws=2", "cutlass"])
def test_a_misaligned_tensor_is_refused_on_every_call_and_the_gpu_stays_usable(backend):
    """The kernels copy q, the block's K/V and the caches in 16-byte pieces: a tensor 2 bytes off
    (same shape and strides as a planned call's, so no plan key or guard tells it apart) is a
    ValueError before any launch, on the C runner's path and in a capture, and the next call is
    still right (a misaligned copy would have faulted the context)."""
    impl = _fresh(backend)
    geom, (q, kb, vb), cache = _main_paged_case(6, [700, 90])
    ref = reference.paged_attention(q, kb, vb, *cache)
    for _ in range(2):  # the first plans and builds the stream's graph; the second is the runner's
        _assert_close(impl.paged_attention(q, kb, vb, *cache), ref, geom.dtype)
    with pytest.raises(ValueError, match="q: data_ptr .* is not 16-byte aligned"):
        impl.paged_attention(_shifted(q, 1), kb, vb, *cache)
    with pytest.raises(ValueError, match="k_cache: data_ptr .* is not 16-byte aligned"):
        impl.paged_attention(q, kb, vb, _shifted(cache[0], 1), *cache[1:])
    with pytest.raises(ValueError, match="out: data_ptr .* is not 4-byte aligned"):
        impl.paged_attention(q, kb, vb, *cache, out=_shifted(torch.empty_like(q), 1))
    graph, vb_off = torch.cuda.CUDAGraph(), _shifted(vb, 3)
    with pytest.raises(ValueError, match="v_blk: data_ptr"), torch.cuda.graph(graph):
        impl.paged_attention(q, kb, vb_off, *cache)  # the Python path, inside a capture
    torch.cuda.synchronize()
    _assert_close(impl.paged_attention(q, kb, vb, *cache), ref, geom.dtype)
    # a plan's first call checks as well
    with pytest.raises(ValueError, match="q: data_ptr .* is not 16-byte aligned"):
        _fresh(backend).paged_attention(_shifted(q, 4), kb, vb, *cache)


# ---------------------------------------------------------------------------------------------
# engine pools, out=, capture from the first call, DRAFTER_CHECKS=0 (issue 13)


def _fresh(spec: str):
    """The backend of `spec` with no plans yet (plans are per backend object)."""
    import dataclasses

    return dataclasses.replace(_backend(spec))


def _pool_views(k_pages, v_pages):
    """K and V pages as views of one TensorRT-LLM pool [blocks, 2, Hkv, page, D]."""
    pool = torch.stack([k_pages, v_pages], dim=1)
    return pool, pool[:, 0], pool[:, 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page", [16, 64])
def test_trtllm_pool_views(backend, page):
    """Attention and store over K/V views of one pool, against the reference on packed copies;
    the store writes through the views into the pool."""
    impl = _fresh(backend)
    geom = PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(page)
    lens = [3, 700, 2049]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    k_pages, v_pages, table, ctx = random_paged_context(geom, lens, page, "cuda", gen,
                                                        extra_pages=2)
    pool, k_view, v_view = _pool_views(k_pages, v_pages)
    assert k_view.data_ptr() == pool.data_ptr() and not k_view.is_contiguous()
    ref = reference.paged_attention(q, kb, vb, k_pages, v_pages, table, ctx)
    _poison_allocator(q)
    _assert_close(impl.paged_attention(q, kb, vb, k_view, v_view, table, ctx), ref, geom.dtype)
    k_new, v_new, num_new = _store_inputs(geom, lens, geom.block_size, gen)
    ref_cache = [k_pages.clone(), v_pages.clone(), table, ctx.clone()]
    reference.store_paged(k_new, v_new, num_new, *ref_cache)
    impl.store_paged(k_new, v_new, num_new, k_view, v_view, table, ctx)
    assert torch.equal(pool[:, 0], ref_cache[0]) and torch.equal(pool[:, 1], ref_cache[1])
    assert torch.equal(ctx, ref_cache[3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_out_buffer_is_written_and_returned(backend, layout):
    impl = _fresh(backend)
    lens = [100, 2049]
    geom = _preset_for(impl, "laguna-dflash", layout, 64, lens)
    gen = torch.Generator().manual_seed(11)
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    if layout == "paged":
        cache = random_paged_context(geom, lens, 64, "cuda", gen)
        fn, ref_fn = impl.paged_attention, reference.paged_attention
    else:
        cache = random_arena_context(geom, lens, 2100, "cuda", gen)
        fn, ref_fn = impl.arena_attention, reference.arena_attention
    kw = dict(mask=geom.mask, window=geom.window)
    out = torch.full_like(q, float("nan"))
    assert fn(q, kb, vb, *cache, **kw, out=out) is out
    _assert_close(out, ref_fn(q, kb, vb, *cache, **kw), geom.dtype)
    with pytest.raises(ValueError, match="out has dtype"):
        fn(q, kb, vb, *cache, **kw, out=out.float())


@pytest.mark.parametrize("backend", ["cupy", "cutlass"])
def test_store_and_attention_capture_from_their_first_call(backend, monkeypatch):
    """No eager call before capture: plans, module loads and the store's counters all happen
    inside the capture, and every replay (and an eager call afterwards) is right."""
    from drafter_attn.kernels import cupy_backend as cb

    monkeypatch.setattr(cb, "_loaded", {})  # load the modules again, during capture
    monkeypatch.setattr(cb, "_counter_bufs", {})
    impl = _fresh(backend)
    geom = PRESETS["gpt-oss-20b-dflash"]
    gen = torch.Generator().manual_seed(5)
    lens = [10, 1500, 64]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    k_new, v_new, num_new = _store_inputs(geom, lens, geom.block_size, gen)
    cache = list(random_paged_context(geom, lens, 32, "cuda", gen, extra_pages=1))
    initial = [t.clone() for t in cache]
    want_cache = [t.clone() for t in cache]
    reference.store_paged(k_new, v_new, num_new, *want_cache)
    want = reference.paged_attention(q, kb, vb, *want_cache)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.store_paged(k_new, v_new, num_new, *cache)
        static_out = impl.paged_attention(q, kb, vb, *cache)
    for _ in range(2):
        for t, t0 in zip(cache, initial):
            t.copy_(t0)
        graph.replay()
        torch.cuda.synchronize()
        for got, exp in zip(cache, want_cache):
            assert torch.equal(got, exp)
        _assert_close(static_out, want, geom.dtype)
    for t, t0 in zip(cache, initial):
        t.copy_(t0)
    impl.store_paged(k_new, v_new, num_new, *cache)  # eager after capture: its own counters
    assert torch.equal(cache[3], want_cache[3])


@pytest.mark.parametrize("backend", ["cupy", "cutlass"])
def test_checks_off_runs_the_same(backend, monkeypatch):
    """DRAFTER_CHECKS=0: the shorter plan key still finds the right plan for each shape."""
    from drafter_attn.kernels import cupy_backend as cb

    monkeypatch.setattr(cb, "CHECKS", False)
    impl = _fresh(backend)
    geom = PRESETS["qwen3-8b-dflash-b16"]
    gen = torch.Generator().manual_seed(2)
    for lens in ([5, 300], [5, 300, 4000]):
        q, kb, vb = _block_inputs(geom, len(lens), gen)
        cache = random_paged_context(geom, lens, 64, "cuda", gen)
        _assert_close(impl.paged_attention(q, kb, vb, *cache),
                      reference.paged_attention(q, kb, vb, *cache), geom.dtype)
    assert len(impl._plans) == 2


# ---------------------------------------------------------------------------------------------
# the wgmma path with rows padded to whole warpgroups (issue 12, GQA 9; opt-in `cupy:wgmma=1`)

# `cupy:wgmma=1` on CTAs that are not whole warpgroups or whose tile loads leave some threads a
# chunk more than others: laguna's 144 rows (9 warps) as 3 warpgroups of 64 row slots, the last
# 48 zero rows; a GQA 12 geometry (192 rows: 12 warps, no padding, 384 threads); GQA 9 at
# head_dim 64; Qb 12 x G 9 = 108 rows as 2 warpgroups (7 warps padded to 8). The default
# (`cupy`, wgmma=None) never takes this path, so the random matrix above does not reach it.
# Specs: the forced defaults (32-key tiles in 8 stages, Q in registers), 64-key tiles (3 load
# iterations, the last predicated; spills a few bytes at 12 warps) and the pipelined variant.
PADDED_SPECS = ["cupy:wgmma=1", "cupy:wgmma=1,tile_n=64,stages=4", "cupy:wgmma=1,overlap=2"]
PADDED_GEOMETRIES = [
    PRESETS["laguna-dflash"],
    Geometry(96, 8, 128, 16, "sliding_causal", 512),  # GQA 12: 192 rows
    Geometry(36, 4, 64, 16, "sliding_causal", 512),  # GQA 9, head_dim 64
    Geometry(36, 4, 128, 12, "full"),  # Qb 12 x G 9: 108 rows, 7 warps -> 2 warpgroups
]


def _random_cases(geometries, count: int, seed: int, *, pages, windows, short_lens, fp16_every: int,
                  long_at: tuple[int, int]):
    """`count` random cases over `geometries` in turn: every mask (a window from `windows(block
    size)`), `pages` in turn, fp16 every `fp16_every`-th case, 1-5 ragged requests of lengths
    from `short_lens(page)` or random, and a 20k-token request beside a short one at every case
    n with n % long_at[0] == long_at[1]."""
    rng = random.Random(seed)
    cases = []
    for n in range(count):
        g = geometries[n % len(geometries)]
        mask = ["full", "sliding", "sliding_causal"][(n // len(geometries)) % 3]
        window = None if mask == "full" else rng.choice(windows(g.block_size))
        page = pages[n % len(pages)]
        dtype = "bfloat16" if n % fp16_every else "float16"
        p = page or 64
        lens = [rng.choice([*short_lens(p), rng.randrange(1, 3000)])
                for _ in range(rng.choice([1, 2, 3, 5]))]
        if n % long_at[0] == long_at[1]:
            lens = [20000 + rng.randrange(100), 7]
        cases.append(pytest.param(g.with_(mask=mask, window=window, dtype=dtype), page, lens, n,
                                  id=f"{n}-h{g.num_q_heads}/{g.num_kv_heads}-d{g.head_dim}"
                                  f"-qb{g.block_size}-{mask}{window or ''}-p{page or 'arena'}"
                                  f"-{dtype}-{lens}"))
    return cases


def _padded_cases():
    return _random_cases(PADDED_GEOMETRIES, 48, 12, pages=[8, 16, 32, 64, 128, None],
                         windows=lambda bs: [1, bs - 1, bs, 37, 512, 5000],
                         short_lens=lambda p: [0, 1, p - 1, p, p + 1, 2 * p + 3, 31, 32, 33],
                         fp16_every=5, long_at=(16, 9))


@pytest.mark.parametrize("spec", PADDED_SPECS)
@pytest.mark.parametrize("geom,page,lens,seed", _padded_cases())
def test_padded_wgmma_matches_reference(spec, geom, page, lens, seed):
    """The padded wgmma path against the reference (sm_90 only: elsewhere it is refused)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path is sm_90a's")
    layout = "paged" if page else "arena"
    test_attention_matches_reference(spec, layout, geom, page, lens, seed)


@pytest.mark.parametrize("spec", PADDED_SPECS[:1])
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("geom", PADDED_GEOMETRIES[:2], ids=["laguna", "gqa12"])
def test_padded_wgmma_forced_splits(spec, splits, geom):
    """Split-KV partials of the padded CTAs (o_part rows < M only) through the combine."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma path is sm_90a's")
    impl = _backend(spec).with_params(num_splits=splits)
    gen = torch.Generator().manual_seed(splits)
    lens = [0, 5, 700, 4097]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    cache = random_paged_context(geom, lens, 64, "cuda", gen)
    kw = dict(mask=geom.mask, window=geom.window)
    assert impl.supports(Problem(geom, "paged", 64, len(lens), max(lens)), 90) is None
    ref = reference.paged_attention(q, kb, vb, *cache, **kw)
    _poison_allocator(q)
    _assert_close(impl.paged_attention(q, kb, vb, *cache, **kw), ref, geom.dtype)


# ---------------------------------------------------------------------------------------------
# a (request, KV head)'s rows dealt over several CTAs (`row_split`, issue 12: laguna's 144 rows
# as 3 CTAs of one warpgroup, on the pipelined 4-warp path and its TMA loads)

# Specs: the 4-warp pipelined path the split rows take by default on sm_90 (cp.async below batch
# 8), its TMA loads, mma.sync (every SM), and 2 CTAs a group (laguna: 72 rows, 5 mma.sync warps).
ROW_SPLIT_SPECS = ["cupy:row_split=3", "cupy:row_split=3,tma=1", "cupy:row_split=3,wgmma=0",
                   "cupy:row_split=2"]
ROW_SPLIT_GEOMETRIES = PADDED_GEOMETRIES + [PRESETS["qwen3-8b-dflash-b16"]]  # 64 rows: 22/22/20


def _row_split_cases():
    return _random_cases(ROW_SPLIT_GEOMETRIES, 30, 13, pages=[8, 16, 64, 128, None, 32],
                         windows=lambda bs: [1, bs - 1, 37, 512, 5000],
                         short_lens=lambda p: [0, 1, p - 1, p, p + 1, 2 * p + 3, 33],
                         fp16_every=4, long_at=(10, 7))


@pytest.mark.parametrize("spec", ROW_SPLIT_SPECS)
@pytest.mark.parametrize("geom,page,lens,seed", _row_split_cases())
def test_row_split_matches_reference(spec, geom, page, lens, seed):
    """Every CTA of a split writes its own rows, none twice, none missing (poisoned output)."""
    if "wgmma=0" not in spec and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the pipelined path and TMA are sm_90a's")
    layout = "paged" if page else "arena"
    test_attention_matches_reference(spec, layout, geom, page, lens, seed)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("geom", [PRESETS["laguna-dflash"], PADDED_GEOMETRIES[3]],
                         ids=["laguna", "qb12g9"])
def test_row_split_forced_splits(splits, geom):
    """Split-KV partials of row-split CTAs (each CTA its rows' partials) through the combine, and
    the launch grid: a split's row_split CTAs adjacent in x."""
    _check_forced_splits("cupy:row_split=3,wgmma=0", splits, geom, ctas_per_split=3)


def _check_forced_splits(spec: str, splits: int, geom: Geometry, ctas_per_split: int) -> None:
    """`spec` at `splits` forced splits over ragged lengths (0 included) against the reference,
    and its launch grid: `ctas_per_split` CTAs a split in x."""
    impl = _backend(spec).with_params(num_splits=splits)
    gen = torch.Generator().manual_seed(splits)
    lens = [0, 5, 700, 4097]
    q, kb, vb = _block_inputs(geom, len(lens), gen)
    cache = random_paged_context(geom, lens, 64, "cuda", gen)
    kw = dict(mask=geom.mask, window=geom.window)
    ref = reference.paged_attention(q, kb, vb, *cache, **kw)
    _poison_allocator(q)
    _assert_close(impl.paged_attention(q, kb, vb, *cache, **kw), ref, geom.dtype)
    (plan,) = impl._plans.values()
    assert plan.attention.grid == (ctas_per_split * splits, geom.num_kv_heads, len(lens))


# ---------------------------------------------------------------------------------------------
# a split's rows dealt over the ws consumers of one CTA (`ws_rows`, issue 12: laguna's 144 rows
# as 3 consumers of 48, each tile read once for all of them, each consumer storing its own rows)

# Specs: three consumers in 6 stages (the default) and in 9 with early_ids; two consumers (up to
# 128 rows: laguna and GQA 12 are refused, which the matrix checks too); with ws_overlap (each
# consumer then holds two stages: 2 stages leave the producer none to fill ahead); on 64-key
# tiles in 3 and 4 stages (half the steps of a consumer's chain a key); laguna's pick with Q's
# copies stepped (each consumer's rows start mid-group: 48 rows of G=9), and with the one-trip
# combine (laguna's 1152+ rows a call merge a warp a row).
WS_ROWS_SPECS = ["cupy:ws=3,ws_rows=1", "cupy:ws=3,ws_rows=1,stages=9,early_ids=1",
                 "cupy:ws=2,ws_rows=1", "cupy:ws=3,ws_rows=1,early_ids=1,ws_overlap=1",
                 "cupy:ws=3,ws_rows=1,stages=2,ws_overlap=1",
                 "cupy:ws=3,ws_rows=1,tile_n=64,stages=4,early_ids=1,ws_overlap=1",
                 "cupy:ws=3,ws_rows=1,tile_n=64,stages=3,early_ids=1",
                 "cupy:ws=3,ws_rows=1,early_ids=1,ws_overlap=1,q_step=1",
                 "cupy:ws=3,ws_rows=1,early_ids=1,ws_overlap=1,q_step=1,one_trip=1"]


def _ws_rows_cases():
    return _random_cases(ROW_SPLIT_GEOMETRIES, 30, 14, pages=[8, 16, 64, 128, None, 32, 256],
                         windows=lambda bs: [1, bs - 1, 37, 512, 5000],
                         short_lens=lambda p: [0, 1, p - 1, p, p + 1, 2 * p + 3, 31, 33],
                         fp16_every=4, long_at=(10, 3))


@pytest.mark.parametrize("spec", WS_ROWS_SPECS)
@pytest.mark.parametrize("geom,page,lens,seed", _ws_rows_cases())
def test_ws_rows_matches_reference(spec, geom, page, lens, seed):
    """Every consumer stores its own rows, none twice, none missing (poisoned output); shapes
    whose rows do not fit the consumers are refused before any kernel runs."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is sm_90a's")
    layout = "paged" if page else "arena"
    test_attention_matches_reference(spec, layout, geom, page, lens, seed)


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("geom", [PRESETS["laguna-dflash"], PADDED_GEOMETRIES[3]],
                         ids=["laguna", "qb12g9"])
def test_ws_rows_forced_splits(splits, geom):
    """Split-KV partials of the ws_rows consumers (each its rows' partials) through the combine;
    one CTA a split (no row_split)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is sm_90a's")
    _check_forced_splits("cupy:ws=3,ws_rows=1", splits, geom, ctas_per_split=1)
