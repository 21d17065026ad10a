"""The decode step (CPU, reference backend): re-runnable, split halves, accounting, check()."""

from __future__ import annotations

import math

import pytest
import torch

from drafter_attn.kernels import reference
from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.tuner import memory, roofline
from drafter_attn.tuner.step import CorrectnessError, DecodeStep, accepted_rows, decode_bytes

GEOM = Geometry(8, 2, 64, 4, "sliding", 6, num_layers=3, dtype="float32")


def _problem(layout="paged", page=8, batch=3, ctx=21, geom=GEOM):
    return Problem(geom, layout, page if layout == "paged" else None, batch, ctx)


@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_step_is_rerunnable_and_splits(layout):
    step = DecodeStep(_problem(layout), "reference", accepted=2.5, device="cpu")
    start = torch.tensor([21] * 3, dtype=torch.int32)
    first = torch.stack(step.run())
    after = step._lens.clone()
    assert torch.equal(after, (start + step.num_new).expand(3, -1))
    second = torch.stack(step.run())  # lengths reset at the start: the same step again
    assert torch.equal(first, second) and torch.equal(step._lens, after)
    assert torch.equal(torch.stack(step.attention_only()), first)
    step.store_only()
    assert torch.equal(step._lens, after)
    step.reset()
    assert torch.equal(step._lens, start.expand(3, -1))
    assert first.shape == (3, 3, GEOM.block_size, GEOM.num_q_heads, GEOM.head_dim)
    assert torch.isfinite(first).all()


def test_step_layers_hold_distinct_random_data():
    step = DecodeStep(_problem("paged"), "reference", device="cpu")
    assert len(step.k_cache) == GEOM.num_layers
    assert not torch.equal(step.k_cache[0], step.k_cache[1])
    assert not torch.equal(step.q[0], step.q[1])
    for t in step.k_cache + step.q + step.k_new:
        assert (t != 0).all()  # never zeros


def test_stored_rows_are_the_accepted_ones():
    p = _problem("arena", batch=2, ctx=5)
    step = DecodeStep(p, "reference", accepted=2, device="cpu")
    before = [k.clone() for k in step.k_cache]
    step.store_only()
    slots = step.table.tolist()
    for layer in range(GEOM.num_layers):
        for b, s in enumerate(slots):
            n = step.num_new_rows[b]
            assert torch.equal(step.k_cache[layer][s, 5:5 + n], step.k_new[layer][b, :n])
            assert torch.equal(step.k_cache[layer][s, 5 + n:], before[layer][s, 5 + n:])


def test_accepted_rows():
    assert accepted_rows(4, 16) == [16] * 4
    rows = accepted_rows(32, 16, 6.25)
    assert sum(rows) == 200 and set(rows) == {6, 7}
    assert rows == accepted_rows(32, 16, 6.25)  # deterministic
    assert accepted_rows(3, 8, 8) == [8, 8, 8]
    with pytest.raises(ValueError, match="accepted=9"):
        accepted_rows(3, 8, 9)
    with pytest.raises(ValueError, match="accepted=0"):
        accepted_rows(3, 8, 0)


@pytest.mark.parametrize("layout,page", [("paged", 8), ("paged", 16), ("arena", None)])
def test_accounting(layout, page):
    p = _problem(layout, page)
    step = DecodeStep(p, "reference", accepted=3, device="cpu")
    g = p.geometry
    row = 2 * g.num_kv_heads * g.head_dim * 4  # K and V of one token, float32
    if layout == "paged":
        pages = 3 * math.ceil((21 + 4) / page)
        assert step.kv_bytes == g.num_layers * pages * page * row
        allocated = sum(t.numel() * t.element_size() for t in step.k_cache + step.v_cache)
        assert allocated == step.kv_bytes + g.num_layers * page * row  # plus one spare page
    else:
        assert step.kv_bytes == g.num_layers * 3 * (21 + 4) * row
        assert step.kv_bytes == sum(t.numel() * t.element_size() for t in step.k_cache + step.v_cache)
    assert step.kv_bytes == memory.kv_bytes_for(p)
    lens = [21 + n for n in step.num_new_rows]
    assert step.attention_bytes == g.num_layers * roofline.attention_bytes(g, lens, 4, page)
    assert step.store_bytes == g.num_layers * roofline.store_bytes(g, step.num_new_rows, 4)
    assert step.bytes_moved == step.attention_bytes + step.store_bytes
    assert decode_bytes(p, 3) == step.bytes_moved  # what bench decode times the floor of first


def test_arena_max_ctx_override():
    p = _problem("arena")
    assert memory.kv_bytes_for(p, max_ctx=4096) == memory.kv_bytes_for(p) * 4096 // 25


@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_check_passes_for_the_reference(layout):
    step = DecodeStep(_problem(layout, batch=4), "reference", accepted=3, device="cpu")
    assert step.check() == 0.0


class _Broken:
    """The reference with one fault injected."""

    name = "broken"

    def __init__(self, fault):
        self.fault = fault

    def with_params(self, **p):
        return self

    def paged_attention(self, *args, **kw):
        return self._out(reference.paged_attention(*args, **kw))

    def arena_attention(self, *args, **kw):
        return self._out(reference.arena_attention(*args, **kw))

    def _out(self, out):
        if self.fault == "nan":
            out[-1, -1, -1, -1] = float("nan")
        elif self.fault == "noise":
            out = out + 0.05 * torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype)
        elif self.fault == "shape":
            out = out[:, :-1]
        return out

    def store_paged(self, k_new, v_new, num_new, *cache):
        reference.store_paged(k_new, v_new, self._rows(num_new), *cache)

    def store_arena(self, k_new, v_new, num_new, *cache):
        reference.store_arena(k_new, v_new, self._rows(num_new), *cache)

    def _rows(self, num_new):
        return (num_new - 1).clamp_min(0) if self.fault == "store" else num_new


@pytest.mark.parametrize("fault,message", [("nan", "NaN/inf"), ("noise", "relative error"),
                                           ("shape", "shape"), ("store", "store wrote a different ctx_lens")])
@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_check_catches_wrong_backends(fault, message, layout):
    step = DecodeStep(_problem(layout, batch=2), _Broken(fault), device="cpu")
    with pytest.raises(CorrectnessError, match=message):
        step.check()


def test_check_reference_in_chunks(monkeypatch):
    """Large problems run the reference request by request; the result is the same."""
    import drafter_attn.tuner.step as step_mod

    step = DecodeStep(_problem("paged", batch=5), _Broken("noise"), device="cpu")
    with pytest.raises(CorrectnessError) as whole:
        step.check()
    monkeypatch.setattr(step_mod, "_REFERENCE_TOKENS", 1)
    with pytest.raises(CorrectnessError) as chunked:
        step.check()
    assert str(whole.value) == str(chunked.value)
