"""Every input that breaks the contract gets a ValueError naming the argument, before any work."""

import re

import pytest
import torch

from drafter_attn.kernels import reference
from drafter_attn.kernels.contract import check_arena, check_paged

B, QB, HQ, HKV, D, PS, PAGES, MAX_PAGES, MAX_CTX = 2, 4, 4, 2, 8, 8, 6, 3, 24


def _r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _paged():
    return dict(
        q=_r(B, QB, HQ, D), k_blk=_r(B, QB, HKV, D), v_blk=_r(B, QB, HKV, D),
        k_pages=_r(PAGES, HKV, PS, D), v_pages=_r(PAGES, HKV, PS, D),
        block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32),
        ctx_lens=torch.tensor([5, 20], dtype=torch.int32),
    )


def _arena():
    return dict(
        q=_r(B, QB, HQ, D), k_blk=_r(B, QB, HKV, D), v_blk=_r(B, QB, HKV, D),
        k_arena=_r(3, MAX_CTX, HKV, D), v_arena=_r(3, MAX_CTX, HKV, D),
        slots=torch.tensor([2, 0], dtype=torch.int32), ctx_lens=torch.tensor([5, 20], dtype=torch.int32),
    )


def _store_paged():
    a = _paged()
    del a["q"], a["k_blk"], a["v_blk"]
    return dict(k_new=_r(B, QB, HKV, D), v_new=_r(B, QB, HKV, D), num_new=torch.tensor([4, 2], dtype=torch.int32), **a)


def _store_arena():
    a = _arena()
    del a["q"], a["k_blk"], a["v_blk"]
    return dict(k_new=_r(B, QB, HKV, D), v_new=_r(B, QB, HKV, D), num_new=torch.tensor([4, 2], dtype=torch.int32), **a)


CALLS = {
    "paged": (_paged, reference.paged_attention),
    "arena": (_arena, reference.arena_attention),
    "store_paged": (_store_paged, reference.store_paged),
    "store_arena": (_store_arena, reference.store_arena),
}


def _set(**changes):
    return lambda a: a.update(changes)


BAD = [
    # (call, mutation of the valid arguments, text the message must contain)
    ("paged", _set(q=[[1.0]]), "q must be a torch.Tensor"),
    ("paged", lambda a: a.update(q=a["q"][0]), "q must have 4 dimensions"),
    ("paged", lambda a: a.update(q=a["q"].to(torch.int32)), "q must be one of bfloat16, float16, float32"),
    ("paged", lambda a: a.update(k_blk=a["k_blk"].half()), "k_blk has dtype torch.float16"),
    ("paged", _set(v_blk=_r(B, QB, HKV, D + 1)), "v_blk has shape"),
    ("paged", _set(k_blk=_r(B + 1, QB, HKV, D)), "k_blk has shape"),
    ("paged", _set(q=_r(B, QB, 3, D)), "q has 3 heads, not a multiple of the 2 KV heads of k_blk"),
    ("paged", lambda a: a.update(k_pages=a["k_pages"].bfloat16()), "k_pages has dtype torch.bfloat16"),
    ("paged", _set(v_pages=_r(PAGES + 1, HKV, PS, D)), "v_pages has shape"),
    ("paged", _set(k_pages=_r(PAGES, HKV, 12, D), v_pages=_r(PAGES, HKV, 12, D)), "k_pages has page_size=12"),
    ("paged", lambda a: a.update(block_table=a["block_table"].long()), "block_table must be int32"),
    ("paged", lambda a: a.update(ctx_lens=a["ctx_lens"].long()), "ctx_lens must be int32"),
    ("paged", lambda a: a.update(block_table=a["block_table"][:1]), "block_table has shape (1, 3)"),
    ("paged", _set(ctx_lens=torch.tensor([1, 2, 3], dtype=torch.int32)), "ctx_lens has shape (3,)"),
    ("paged", lambda a: a.update(block_table=a["block_table"].to("meta")), "block_table is on meta but q is on cpu"),
    ("paged", lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), "q must be contiguous"),
    ("paged", lambda a: a.update(k_pages=a["k_pages"].transpose(0, 1).contiguous().transpose(0, 1)),
     "k_pages must be contiguous"),
    ("paged", _set(mask="causal"), "mask='causal' is unknown"),
    ("paged", _set(mask="sliding"), "window is required for mask='sliding'"),
    ("paged", _set(mask="sliding_causal", window=0), "window must be positive"),
    ("paged", _set(mask="sliding", window=2.5), "window must be a positive integer, got 2.5"),
    ("paged", _set(mask="sliding", window=2**32), "window=4294967296 is over 2147483647"),
    ("paged", _set(scale=0.0), "scale must be a positive finite number"),
    ("paged", _set(scale=float("nan")), "scale must be a positive finite number"),
    ("paged", _set(ctx_lens=torch.tensor([5, 25], dtype=torch.int32)),
     "ctx_lens[1]=25 exceeds the capacity of block_table (24 tokens)"),
    ("paged", _set(ctx_lens=torch.tensor([-1, 5], dtype=torch.int32)), "ctx_lens[0]=-1 is negative"),
    ("paged", lambda a: a["block_table"].__setitem__((1, 2), 6), "block_table[1, 2]=6 is not a page id in [0, 6)"),
    ("arena", lambda a: a.update(slots=a["slots"].long()), "slots must be int32"),
    ("arena", _set(slots=torch.tensor([0, 3], dtype=torch.int32)), "slots[1]=3 is not a slot in [0, 3)"),
    ("arena", _set(k_arena=_r(3, MAX_CTX, HKV, D + 1)), "k_arena has shape"),
    ("arena", _set(v_arena=_r(3, MAX_CTX - 1, HKV, D)), "v_arena has shape"),
    ("arena", _set(ctx_lens=torch.tensor([25, 1], dtype=torch.int32)), "exceeds the capacity of k_arena (24 tokens)"),
    ("arena", lambda a: a.update(k_arena=a["k_arena"].to("meta")), "k_arena is on meta"),
    ("store_paged", _set(num_new=torch.tensor([5, 0], dtype=torch.int32)), "num_new[0]=5 is outside [0, T=4]"),
    ("store_paged", _set(num_new=torch.tensor([0, -1], dtype=torch.int32)), "num_new[1]=-1 is outside"),
    ("store_paged", lambda a: a.update(num_new=a["num_new"].long()), "num_new must be int32"),
    ("store_paged", lambda a: a.update(k_new=a["k_new"].half(), v_new=a["v_new"].half()),
     "k_pages has dtype torch.float32 but k_new has torch.float16"),
    ("store_paged", _set(v_new=_r(B, QB + 1, HKV, D)), "v_new has shape"),
    ("store_paged", _set(ctx_lens=torch.tensor([5, 23], dtype=torch.int32)),
     "ctx_lens[1]=23 + num_new[1]=2 exceeds the capacity of block_table"),
    ("store_paged", lambda a: a["block_table"].__setitem__((0, 1), -7), "block_table[0, 1]=-7"),
    ("store_arena", _set(slots=torch.tensor([1, 1], dtype=torch.int32)), "slots must be distinct"),
    ("store_arena", lambda a: a.update(num_new=a["num_new"][:1]), "num_new has shape (1,)"),
    ("store_arena", lambda a: a.update(k_new=a["k_new"].transpose(0, 1).contiguous().transpose(0, 1)),
     "k_new must be contiguous"),
]


@pytest.mark.parametrize("call,mutate,message", BAD, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_input_names_the_argument(call, mutate, message):
    make, fn = CALLS[call]
    args = make()
    mutate(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(**args)


@pytest.mark.parametrize("call", CALLS)
def test_valid_inputs_pass(call):
    make, fn = CALLS[call]
    fn(**make())


def test_a_capacity_past_a_c_int_is_refused():
    """A table (or arena) addressing 2**31 tokens a request or more would wrap in the kernels'
    int parameters into a capacity of nothing, and one within a tile of keys of 2**31 wraps the
    tile count (`(P + N - 1) / N`): no tile runs, zeros come out. Refused, naming it (meta
    tensors: no memory)."""
    args = {k: v.to("meta") for k, v in _paged().items()}
    for columns in (2**31 // PS, 2**31 // PS - 1, (2**31 - 256) // PS + 1):
        args["block_table"] = torch.empty(B, columns, dtype=torch.int32, device="meta")
        with pytest.raises(ValueError, match=f"block_table addresses {columns * PS} tokens a request, "
                                             f"over 2147483392"):
            check_paged(**args)
    args["block_table"] = torch.empty(B, (2**31 - 256) // PS, dtype=torch.int32, device="meta")
    assert check_paged(**args).capacity == 2**31 - 256
    args = {k: v.to("meta") for k, v in _arena().items()}
    args["k_arena"] = args["v_arena"] = torch.empty(3, 2**31, HKV, D, device="meta")
    with pytest.raises(ValueError, match="k_arena addresses 2147483648 tokens"):
        check_arena(**args)


def test_dims_are_resolved():
    d = check_paged(**_paged(), mask="full", window=99)
    assert (d.batch, d.block_size, d.num_q_heads, d.num_kv_heads, d.head_dim, d.group) == (B, QB, HQ, HKV, D, 2)
    assert (d.page_size, d.capacity, d.mask, d.window, d.dtype) == (PS, MAX_PAGES * PS, "full", None, torch.float32)
    assert d.scale == pytest.approx(D**-0.5)
    d = check_arena(**_arena(), mask="sliding", window=3, scale=0.5)
    assert (d.page_size, d.capacity, d.window, d.scale) == (None, MAX_CTX, 3, 0.5)


def test_requests_that_store_nothing_may_share_a_slot():
    """A padded batch points its dummy requests (num_new 0) at one slot: nothing is written
    there, so nothing races (as the paged store, which checks only the rows it writes)."""
    args = _store_arena()
    args.update(slots=torch.tensor([1, 1], dtype=torch.int32), num_new=torch.tensor([3, 0], dtype=torch.int32))
    before = args["ctx_lens"].clone()
    reference.store_arena(**args)
    assert (args["ctx_lens"] - before).tolist() == [3, 0]


def test_garbage_past_the_length_is_accepted():
    """Only table columns that hold tokens must be valid page ids."""
    args = _paged()
    args["block_table"][0, 1:] = -123  # request 0 has 5 tokens: one page
    reference.paged_attention(**args)
