"""Test helpers shared by every test module (CPU and GPU, every backend)."""

from __future__ import annotations

import torch

from drafter_attn.kernels.spec import Geometry


def make_generator(seed: int = 0) -> torch.Generator:
    """A seeded CPU generator (test data is drawn on the host, then moved)."""
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, device, generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def random_block(geometry: Geometry, batch: int, device, generator):
    """Random q [B, Qb, Hq, D] and the block's own k_blk, v_blk [B, Qb, Hkv, D]."""
    g = geometry
    q = randn((batch, g.block_size, g.num_q_heads, g.head_dim), g.torch_dtype, device, generator)
    kv_shape = (batch, g.block_size, g.num_kv_heads, g.head_dim)
    return q, randn(kv_shape, g.torch_dtype, device, generator), randn(kv_shape, g.torch_dtype, device, generator)


def _visible(mask: str, window, qp: int, kp: int) -> bool:
    # The masks of docs/design.md, "The problem", literally, on absolute positions.
    if mask == "full":
        return True
    if mask == "sliding":
        return abs(qp - kp) < window
    if mask == "sliding_causal":
        return kp <= qp and qp - kp < window
    raise ValueError(mask)


def naive_attention_f64(q, k_blk, v_blk, k_ctx: list, v_ctx: list, mask="full", window=None, scale=None):
    """Deliberately naive float64 attention over dense per-request contexts.

    k_ctx[b], v_ctx[b] : [P_b, Hkv, D]. Loops over requests, query rows and heads, and decides
    visibility key by key from absolute positions, sharing no code with the vectorised reference.
    Returns float64 [B, Qb, Hq, D] on the CPU.
    """
    B, Qb, Hq, D = q.shape
    G = Hq // k_blk.shape[2]
    scale = D**-0.5 if scale is None else scale
    q = q.double().cpu()
    out = torch.zeros(B, Qb, Hq, D, dtype=torch.float64)
    for b in range(B):
        P = k_ctx[b].shape[0]
        # Key index == absolute position: context rows 0..P-1, then block row j at P + j.
        keys = torch.cat([k_ctx[b].double().cpu(), k_blk[b].double().cpu()])
        vals = torch.cat([v_ctx[b].double().cpu(), v_blk[b].double().cpu()])
        for i in range(Qb):
            seen = [kp for kp in range(P + Qb) if _visible(mask, window, P + i, kp)]
            for h in range(Hq):
                s = keys[seen, h // G] @ q[b, i, h] * scale
                w = torch.exp(s - s.max())
                out[b, i, h] = (w / w.sum()) @ vals[seen, h // G]
    return out


def dense_into_arena(k_arena, v_arena, slots, k_ctx: list, v_ctx: list) -> None:
    """Write per-request dense contexts into their arena slots (the same logical context)."""
    for s, k, v in zip(slots.tolist(), k_ctx, v_ctx):
        k_arena[s, : k.shape[0]] = k
        v_arena[s, : v.shape[0]] = v


def expected_store(k_new, num_new, cache, ctx_lens, destination):
    """Python-loop store of one of K or V: a copy of `cache` with row j < num_new[b] of request b
    written at destination(b, P_b + j) (an index into `cache`)."""
    out = cache.clone()
    for b, (P, n) in enumerate(zip(ctx_lens.tolist(), num_new.tolist())):
        for j in range(n):
            out[destination(b, P + j)] = k_new[b, j]
    return out
