"""The torch reference against a naive float64 loop, paged against arena, and the context store."""

import math
import random

import pytest
import torch

from helpers import dense_into_arena, expected_store, make_generator, naive_attention_f64, random_block
from drafter_attn.kernels import reference
from drafter_attn.kernels.cache import paged_to_dense, random_arena_context, random_paged_context
from drafter_attn.kernels.spec import MASKS, Geometry

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _case(n: int):
    """Case n of a deterministic grid that covers every mask, GQA groups 1..9, D 64/128, float32
    and bfloat16, windows below and above Qb, and context lengths 0, 1, ps-1, ps, ps+1, hundreds."""
    rnd = random.Random(n)
    mask = MASKS[n % 3]
    Qb = (16, 8, 10, 1)[(n // 3) % 4]
    ps = (8, 16, 32, 64)[(n // 5) % 4]
    if mask == "full":
        window = (None, 7)[n % 2]  # a window with "full" is ignored
    else:
        window = (1, 2, Qb // 2 + 1, Qb + 3, 50, 300)[(n // 3) % 6]
    geometry = Geometry(
        num_q_heads=(1 + n % 9) * (1 + (n // 9) % 2),
        num_kv_heads=1 + (n // 9) % 2,
        head_dim=(64, 128)[(n // 2) % 2],
        block_size=Qb,
        mask=mask,
        window=window,
        dtype=("float32", "bfloat16")[(n // 4) % 2],
    )
    kinds = {"0": 0, "1": 1, "ps-1": ps - 1, "ps": ps, "ps+1": ps + 1}
    lens = [list(kinds.values())[(n + b) % 5] if (n + b) % 6 else rnd.randint(200, 700) for b in range(1 + n % 4)]
    scale = 0.3 if n % 7 == 0 else None
    return geometry, lens, ps, window, scale


def _same_context_both_layouts(geometry, lens, ps, gen, extra_ctx=5):
    paged = random_paged_context(geometry, lens, ps, "cpu", gen)
    k_ctx, v_ctx = paged_to_dense(*paged)
    arena = random_arena_context(geometry, lens, max(lens) + extra_ctx, "cpu", gen)
    dense_into_arena(arena[0], arena[1], arena[2], k_ctx, v_ctx)
    return paged, arena, k_ctx, v_ctx


@pytest.mark.parametrize("n", range(48))
def test_reference_matches_naive_float64(n):
    geometry, lens, ps, window, scale = _case(n)
    gen = make_generator(n)
    paged, arena, k_ctx, v_ctx = _same_context_both_layouts(geometry, lens, ps, gen)
    q, k_blk, v_blk = random_block(geometry, len(lens), "cpu", gen)
    kw = dict(mask=geometry.mask, window=window, scale=scale)

    want = naive_attention_f64(q, k_blk, v_blk, k_ctx, v_ctx, **kw)
    out_paged = reference.paged_attention(q, k_blk, v_blk, *paged, **kw)
    out_arena = reference.arena_attention(q, k_blk, v_blk, *arena, **kw)

    assert out_paged.dtype == out_arena.dtype == q.dtype
    assert out_paged.shape == q.shape
    torch.testing.assert_close(out_paged.double(), want, **TOL[q.dtype])
    torch.testing.assert_close(out_arena.double(), want, **TOL[q.dtype])
    # Paged and arena hold the same logical context: they must agree far more tightly.
    torch.testing.assert_close(out_paged, out_arena, atol=1e-5 if q.dtype == torch.float32 else 8e-3, rtol=0)


@pytest.mark.parametrize("mask,window", [("full", None), ("sliding", 5), ("sliding_causal", 20)])
def test_unwritten_cache_rows_are_never_read(mask, window):
    """NaN everywhere the context does not reach (rest of the last page, unused pages, rows past
    P_b, unused slots): the output must not change."""
    g = Geometry(8, 2, 64, 16, mask, window, dtype="float32")
    lens, ps = [0, 5, 16, 45], 16
    gen = make_generator(1)
    paged, arena, k_ctx, v_ctx = _same_context_both_layouts(g, lens, ps, gen)
    q, k_blk, v_blk = random_block(g, len(lens), "cpu", gen)
    want = reference.paged_attention(q, k_blk, v_blk, *paged, mask=mask, window=window)

    k_pages, v_pages, table, ctx_lens = paged
    poisoned = [torch.full_like(k_pages, float("nan")), torch.full_like(v_pages, float("nan"))]
    for b, P in enumerate(lens):
        for t in range(P):
            page = int(table[b, t // ps])
            for src, dst in zip((k_pages, v_pages), poisoned):
                dst[page, :, t % ps] = src[page, :, t % ps]
    out = reference.paged_attention(q, k_blk, v_blk, *poisoned, table, ctx_lens, mask=mask, window=window)
    torch.testing.assert_close(out, want, atol=0, rtol=0)

    k_arena, v_arena, slots, _ = arena
    k_arena.fill_(float("nan"))
    v_arena.fill_(float("nan"))
    dense_into_arena(k_arena, v_arena, slots, k_ctx, v_ctx)
    out = reference.arena_attention(q, k_blk, v_blk, *arena, mask=mask, window=window)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_window_larger_than_context_equals_full():
    g = Geometry(4, 2, 64, 8, dtype="float32")
    gen = make_generator(2)
    paged = random_paged_context(g, [3, 40], 16, "cpu", gen)
    q, k_blk, v_blk = random_block(g, 2, "cpu", gen)
    full = reference.paged_attention(q, k_blk, v_blk, *paged)
    wide = reference.paged_attention(q, k_blk, v_blk, *paged, mask="sliding", window=10_000)
    torch.testing.assert_close(wide, full, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Context store.

STORE_LENS = [0, 7, 8, 9, 37]  # with page size 8 and T=16: every write crosses a page boundary


def _num_new(scenario: str, T: int, room: list[int]) -> torch.Tensor:
    values = {
        "none": [0] * len(room),
        "all": [T] * len(room),
        "mixed": [(0, T, 3, 9, 1)[b % 5] for b in range(len(room))],
        # Fill each request up to its capacity exactly: rows past it (invalid) point beyond the
        # allocated pages, at garbage table entries or past the table.
        "tight": [min(T, r) for r in room],
    }[scenario]
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("scenario", ["none", "all", "mixed", "tight"])
def test_store_paged_writes_exactly_the_valid_rows(scenario, dtype):
    g = Geometry(4, 2, 64, 16, dtype=dtype)
    ps, T = 8, 16
    gen = make_generator(3)
    extra = 0 if scenario == "tight" else math.ceil(T / ps)
    k_pages, v_pages, table, ctx_lens = random_paged_context(g, STORE_LENS, ps, "cpu", gen, extra_pages=extra)
    room = [(math.ceil(P / ps) + extra) * ps - P for P in STORE_LENS]
    num_new = _num_new(scenario, T, room)
    _, k_new, v_new = random_block(g, len(STORE_LENS), "cpu", gen)

    def dest(b, pos):
        return int(table[b, pos // ps]), slice(None), pos % ps

    want_k = expected_store(k_new, num_new, k_pages, ctx_lens, dest)
    want_v = expected_store(v_new, num_new, v_pages, ctx_lens, dest)
    want_lens = ctx_lens + num_new
    reference.store_paged(k_new, v_new, num_new, k_pages, v_pages, table, ctx_lens)
    assert torch.equal(k_pages, want_k) and torch.equal(v_pages, want_v)
    assert torch.equal(ctx_lens, want_lens) and ctx_lens.dtype == torch.int32


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("scenario", ["none", "all", "mixed", "tight"])
def test_store_arena_writes_exactly_the_valid_rows(scenario, dtype):
    g = Geometry(4, 2, 64, 16, dtype=dtype)
    T = 16
    gen = make_generator(4)
    max_ctx = max(STORE_LENS) + (3 if scenario == "tight" else T)
    k_arena, v_arena, slots, ctx_lens = random_arena_context(g, STORE_LENS, max_ctx, "cpu", gen)
    num_new = _num_new(scenario, T, [max_ctx - P for P in STORE_LENS])
    _, k_new, v_new = random_block(g, len(STORE_LENS), "cpu", gen)

    def dest(b, pos):
        return int(slots[b]), pos

    want_k = expected_store(k_new, num_new, k_arena, ctx_lens, dest)
    want_v = expected_store(v_new, num_new, v_arena, ctx_lens, dest)
    want_lens = ctx_lens + num_new
    reference.store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens)
    assert torch.equal(k_arena, want_k) and torch.equal(v_arena, want_v)
    assert torch.equal(ctx_lens, want_lens)


def test_store_then_attend_paged_and_arena_agree():
    """A decode step on both layouts: store accepted rows, then attend with the next block."""
    g = Geometry(16, 2, 64, 16, "sliding_causal", 24, dtype="float32")
    lens, ps = [0, 13, 70], 16
    gen = make_generator(5)
    paged = random_paged_context(g, lens, ps, "cpu", gen, extra_pages=1)
    k_ctx, v_ctx = paged_to_dense(*paged)
    arena = random_arena_context(g, lens, 100, "cpu", gen)
    dense_into_arena(arena[0], arena[1], arena[2], k_ctx, v_ctx)
    num_new = torch.tensor([16, 1, 5], dtype=torch.int32)
    _, k_new, v_new = random_block(g, 3, "cpu", gen)
    reference.store_paged(k_new, v_new, num_new, *paged)
    reference.store_arena(k_new, v_new, num_new, *arena)
    assert paged[3].tolist() == arena[3].tolist() == [16, 14, 75]

    q, k_blk, v_blk = random_block(g, 3, "cpu", gen)
    k_ctx, v_ctx = paged_to_dense(*paged)
    want = naive_attention_f64(q, k_blk, v_blk, k_ctx, v_ctx, g.mask, g.window)
    for layout, out in (("paged", reference.paged_attention(q, k_blk, v_blk, *paged, mask=g.mask, window=g.window)),
                        ("arena", reference.arena_attention(q, k_blk, v_blk, *arena, mask=g.mask, window=g.window))):
        torch.testing.assert_close(out.double(), want, **TOL[torch.float32], msg=layout)
