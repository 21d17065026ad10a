"""Torch reference of the four contract functions: the ground truth of every test.

Written for clarity and for being safe to run inside a decode step on the GPU: fully vectorised
over requests and pages, with no host synchronisation (no .item(), .tolist(), .cpu(), no
data-dependent shapes), so it also runs under `torch.cuda.set_sync_debug_mode("error")` and inside
a captured CUDA graph. It is not fast: it gathers every request's context to the full capacity.
"""

from __future__ import annotations

import torch

from drafter_attn.kernels.contract import Dims, check_arena, check_paged, check_store_arena, check_store_paged


def _visible(written: torch.Tensor, ctx_lens: torch.Tensor, d: Dims) -> torch.Tensor:
    """Boolean mask [B, Qb, capacity + Qb]: may block row i see key k?

    Keys 0..capacity-1 are context positions kp, visible only where `written` (kp < P_b); the last
    Qb keys are the block's own rows j at position P_b + j. Query row i sits at position P_b + i.
    """
    dev = ctx_lens.device
    P = ctx_lens.long()[:, None, None]  # [B, 1, 1]
    i = torch.arange(d.block_size, device=dev)[None, :, None]  # [1, Qb, 1]
    kp = torch.arange(d.capacity, device=dev)[None, None, :]  # [1, 1, cap]
    j = torch.arange(d.block_size, device=dev)[None, None, :]  # [1, 1, Qb]

    ctx = written[:, None, :]
    if d.mask == "full":
        blk = torch.ones(1, d.block_size, d.block_size, dtype=torch.bool, device=dev)
    else:
        # Window over positions: (P + i) - kp < W, and |i - j| < W (or causal i - j in [0, W)).
        ctx = ctx & (kp > P + i - d.window)
        if d.mask == "sliding":
            blk = (i - j).abs() < d.window
        else:
            blk = (j <= i) & (i - j < d.window)
    B = ctx_lens.shape[0]
    return torch.cat([ctx.expand(B, d.block_size, d.capacity), blk.expand(B, -1, -1)], dim=2)


def _attend(q, k_blk, v_blk, k_ctx, v_ctx, ctx_lens, d: Dims) -> torch.Tensor:
    """Attention of the block over [context (gathered to capacity) ; block], in float32."""
    B, Qb, Hkv, G, D = d.batch, d.block_size, d.num_kv_heads, d.group, d.head_dim
    # Rows past P_b are never written in a real pool (uninitialised memory, maybe NaN/Inf), and
    # masking scores alone is not enough: 0 * NaN = NaN in probs @ V. Zero them.
    written = torch.arange(d.capacity, device=q.device)[None, :] < ctx_lens.long()[:, None]  # [B, cap]
    keep = written[:, :, None, None]
    keys = torch.cat([torch.where(keep, k_ctx, 0), k_blk], dim=1).float()  # [B, cap + Qb, Hkv, D]
    vals = torch.cat([torch.where(keep, v_ctx, 0), v_blk], dim=1).float()
    # GQA: query head h = kv * G + g uses KV head h // G = kv.
    qg = q.float().view(B, Qb, Hkv, G, D)
    scores = torch.einsum("bihgd,bkhd->bhgik", qg, keys) * d.scale  # [B, Hkv, G, Qb, cap+Qb]
    visible = _visible(written, ctx_lens, d)[:, None, None]  # [B, 1, 1, Qb, cap+Qb]
    # Every row sees at least its own block key (i == j), so no row is all -inf.
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("bhgik,bkhd->bihgd", probs, vals)
    return out.reshape(B, Qb, Hkv * G, D).to(q.dtype)


def _gather_pages(pages: torch.Tensor, table: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """[num_pages, Hkv, ps, D] pages by table [B, max_pages] -> [B, max_pages * ps, Hkv, D].

    Columns not `live` (past the context length) may hold garbage page ids; they are replaced by
    page 0 so that nothing is dereferenced out of range. Their tokens are masked anyway.
    """
    B, max_pages = table.shape
    _, Hkv, ps, D = pages.shape
    ids = torch.where(live, table.long(), 0)
    return pages[ids].permute(0, 1, 3, 2, 4).reshape(B, max_pages * ps, Hkv, D)


def paged_attention(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *, mask="full", window=None, scale=None,
                    max_ctx=None):
    """Drafter block attention over a paged context: the block attends to [context ; block].

    docs/design.md, "The problem" (math, masks) and "The functional contract".

    Args:
        q: [B, Qb, Hq, D] block queries at positions ctx_lens[b] + i; bfloat16, float16 or float32.
        k_blk, v_blk: [B, Qb, Hkv, D] the block's own keys/values, same dtype; Hq % Hkv == 0.
        k_pages, v_pages: [num_pages, Hkv, page_size, D] HND pages, same dtype; page_size a
            power of two.
        block_table: int32 [B, max_pages]; column c of request b is the page of positions
            c * page_size ...; columns past the context are never read.
        ctx_lens: int32 [B] committed context length P_b (the block not included).
        mask: "full", "sliding" or "sliding_causal".
        window: W for the sliding masks (required there, ignored for "full").
        scale: score scale; None means D ** -0.5.
        max_ctx: optional host-side bound on ctx_lens (a positive int, at most max_pages *
            page_size): the kernels plan their work split from it instead of the table's width.
            ctx_lens above it break the contract (checked for CPU tensors). The reference
            validates it and computes the same result with or without it.

    Returns:
        [B, Qb, Hq, D] in q's dtype (computed in float32).

    Raises:
        ValueError naming the argument when an input breaks the contract (kernels.contract).

    Example:
        >>> g = get_preset("qwen3-8b-dflash-b16")  # Hq 32, Hkv 8, D 128, Qb 16
        >>> gen = torch.Generator().manual_seed(0)
        >>> k_pages, v_pages, table, lens = random_paged_context(g, [100, 300], 64, "cpu", gen)
        >>> q = torch.randn(2, 16, 32, 128).bfloat16()
        >>> k_blk = torch.randn(2, 16, 8, 128).bfloat16()
        >>> paged_attention(q, k_blk, k_blk, k_pages, v_pages, table, lens).shape
        torch.Size([2, 16, 32, 128])
    """
    d = check_paged(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, mask, window, scale, max_ctx)
    ps = d.page_size
    columns = torch.arange(block_table.shape[1], device=q.device)
    live = columns[None, :] * ps < ctx_lens.long()[:, None]  # column holds some token < P_b
    k_ctx = _gather_pages(k_pages, block_table, live)
    v_ctx = _gather_pages(v_pages, block_table, live)
    return _attend(q, k_blk, v_blk, k_ctx, v_ctx, ctx_lens, d)


def arena_attention(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *, mask="full", window=None, scale=None,
                    max_ctx=None):
    """Drafter block attention over an arena context; as `paged_attention` but for a dense cache.

    docs/design.md, "The two layouts" and "The functional contract".

    Args:
        q: [B, Qb, Hq, D]; k_blk, v_blk: [B, Qb, Hkv, D] (as for `paged_attention`).
        k_arena, v_arena: [num_slots, max_ctx, Hkv, D], same dtype as q.
        slots: int32 [B], the arena slot of each request (may repeat: reading is shared).
        ctx_lens: int32 [B] committed context length P_b <= max_ctx.
        mask, window, scale: as for `paged_attention`.
        max_ctx: the hint of `paged_attention`, here at most k_arena.shape[1].

    Returns:
        [B, Qb, Hq, D] in q's dtype.

    Example:
        >>> g = get_preset("dflash2-w2048")  # sliding window 2048
        >>> gen = torch.Generator().manual_seed(0)
        >>> k_arena, v_arena, slots, lens = random_arena_context(g, [100, 300], 512, "cpu", gen)
        >>> q = torch.randn(2, 16, 32, 128).bfloat16()
        >>> k_blk = torch.randn(2, 16, 8, 128).bfloat16()
        >>> arena_attention(q, k_blk, k_blk, k_arena, v_arena, slots, lens,
        ...                 mask="sliding", window=2048).shape
        torch.Size([2, 16, 32, 128])
    """
    d = check_arena(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, mask, window, scale, max_ctx)
    ids = slots.long()
    return _attend(q, k_blk, v_blk, k_arena[ids], v_arena[ids], ctx_lens, d)


# ---------------------------------------------------------------------------------------------
# Context store.
#
# Rows j < num_new[b] of request b go to position P_b + j. The store keeps one shape for every
# step, so invalid rows (j >= num_new[b]) still take part in the scatter; they must not change
# anything. Sending them to their own position is unsafe (it can lie past the capacity, or on a
# page id that is garbage or belongs to another request), and sending them to a clamped position
# can collide with a valid write (index_put with duplicate indices keeps an arbitrary one).
# So every invalid row is redirected to one "sink" row: the first valid row of the whole batch,
# whose destination and value it duplicates (same value written twice: deterministic). When no
# row is valid, the sink is row 0 and all rows write back the value its destination already holds.


def _scatter_rows(view: torch.Tensor, index: tuple, k_rows: torch.Tensor, valid: torch.Tensor) -> None:
    """view[index[0][r], index[1][r]] = k_rows[r] for valid rows r; invalid rows change nothing.

    `view` is indexed by two per-row index tensors and gives [M, Hkv, D] rows.
    """
    sink = torch.argmax(valid.int())  # first valid row, or 0 when there is none
    rows = torch.arange(valid.shape[0], device=valid.device)
    src = torch.where(valid, rows, sink)
    dst = tuple(ix[src] for ix in index)
    current = view[dst]  # gathered before the write, so write-backs are exact
    new = torch.where(valid[src][:, None, None], k_rows[src], current)
    view.index_put_(dst, new)


def _store(k_new, v_new, num_new, ctx_lens, k_view, v_view, locate) -> None:
    B, T = k_new.shape[:2]
    if B and T:
        j = torch.arange(T, device=k_new.device)
        valid = (j[None, :] < num_new.long()[:, None]).reshape(-1)
        pos = (ctx_lens.long()[:, None] + j[None, :]).reshape(-1)
        index = locate(pos, valid)
        _scatter_rows(k_view, index, k_new.reshape(B * T, *k_new.shape[2:]), valid)
        _scatter_rows(v_view, index, v_new.reshape(B * T, *v_new.shape[2:]), valid)
    ctx_lens.add_(num_new)


def store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> None:
    """Context store: write rows j < num_new[b] at positions P_b + j of the pages, in place,
    then ctx_lens += num_new (on the tensors' device; the host never reads the counts).

    docs/design.md, "The problem" (the store) and "The functional contract".

    Args:
        k_new, v_new: [B, T, Hkv, D] candidate rows (T = Qb in a decode step, a prompt chunk
            when a context is first stored); bfloat16, float16 or float32.
        num_new: int32 [B] how many leading rows of each request are valid, in [0, T].
        k_pages, v_pages: [num_pages, Hkv, page_size, D], same dtype; written in place.
        block_table: int32 [B, max_pages]; must cover positions up to ctx_lens + num_new.
        ctx_lens: int32 [B] P_b; advanced in place by num_new.

    Rows j >= num_new[b] change nothing, so the call keeps one shape for any acceptance.

    Example:
        >>> g = get_preset("qwen3-8b-dflash-b16")
        >>> gen = torch.Generator().manual_seed(0)
        >>> k_pages, v_pages, table, lens = random_paged_context(g, [100, 300], 64, "cpu", gen)
        >>> k_new = torch.randn(2, 16, 8, 128).bfloat16()
        >>> store_paged(k_new, k_new, torch.tensor([3, 16], dtype=torch.int32),
        ...             k_pages, v_pages, table, lens)
        >>> lens.tolist()
        [103, 316]
    """
    d = check_store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens)
    if d.capacity == 0:  # no table columns: nothing can be written (num_new must be 0)
        ctx_lens.add_(num_new)
        return
    ps, T, num_pages = d.page_size, d.rows, k_pages.shape[0]
    req = torch.arange(d.batch, device=k_new.device).repeat_interleave(T)

    def locate(pos, valid):
        # Invalid rows may point past the table or at garbage ids: keep them in range (they are
        # redirected to the sink before any write; this only keeps the index arithmetic legal).
        pos = torch.where(valid, pos, pos.clamp(max=d.capacity - 1))
        page = block_table[req, pos // ps].long()
        page = torch.where(valid, page, page.clamp(0, num_pages - 1))
        return page, pos % ps

    # [num_pages, ps, Hkv, D] views of the HND pages: (page, offset) indexes one token's rows.
    _store(k_new, v_new, num_new, ctx_lens, k_pages.transpose(1, 2), v_pages.transpose(1, 2), locate)


def store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> None:
    """Context store into the arena: rows j < num_new[b] go to arena[slots[b], P_b + j], in
    place, then ctx_lens += num_new.

    Args:
        k_new, v_new: [B, T, Hkv, D]; num_new: int32 [B] in [0, T] (as for `store_paged`).
        k_arena, v_arena: [num_slots, max_ctx, Hkv, D], same dtype; written in place.
        slots: int32 [B], distinct among requests with num_new > 0 (two requests writing one
            slot would race).
        ctx_lens: int32 [B] P_b; ctx_lens + num_new must stay <= max_ctx.

    Example:
        >>> g = get_preset("qwen3-8b-dflash-b16")
        >>> gen = torch.Generator().manual_seed(0)
        >>> k_arena, v_arena, slots, lens = random_arena_context(g, [100, 300], 512, "cpu", gen)
        >>> k_new = torch.randn(2, 16, 8, 128).bfloat16()
        >>> store_arena(k_new, k_new, torch.tensor([16, 0], dtype=torch.int32),
        ...             k_arena, v_arena, slots, lens)
        >>> lens.tolist()
        [116, 300]
    """
    d = check_store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens)
    if d.capacity == 0:
        ctx_lens.add_(num_new)
        return
    slot = slots.long().repeat_interleave(d.rows)

    def locate(pos, valid):
        return slot, torch.where(valid, pos, pos.clamp(max=d.capacity - 1))

    _store(k_new, v_new, num_new, ctx_lens, k_arena, v_arena, locate)
