"""The torch custom ops (kernels.ops): opcheck, fake implementations, `out=`, and a drafter layer
under torch.compile. The CPU tests run the reference backend; the `gpu` ones run cupy (and the
CUDA-graph mode of torch.compile)."""

from __future__ import annotations

import pytest
import torch

from drafter_attn.kernels import ops, reference
from helpers import make_generator, randn

HQ, HKV, D, QB, PS = 8, 2, 64, 4, 16
DT = torch.bfloat16


def paged_case(device, batch=2, max_pages=4, num_pages=12, seed=0):
    """Random q/k/v block, a paged cache, a table of distinct pages and lengths < capacity - QB."""
    g = make_generator(seed)
    q = randn((batch, QB, HQ, D), DT, device, g)
    k_blk, v_blk = (randn((batch, QB, HKV, D), DT, device, g) for _ in range(2))
    k_pages, v_pages = (randn((num_pages, HKV, PS, D), DT, device, g) for _ in range(2))
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages)
    lens = torch.randint(1, max_pages * PS - QB, (batch,), generator=g)
    return (q, k_blk, v_blk, k_pages, v_pages, table.int().to(device), lens.int().to(device))


def arena_case(device, batch=2, slots=3, max_ctx=40, seed=1):
    g = make_generator(seed)
    q = randn((batch, QB, HQ, D), DT, device, g)
    k_blk, v_blk = (randn((batch, QB, HKV, D), DT, device, g) for _ in range(2))
    k_arena, v_arena = (randn((slots, max_ctx, HKV, D), DT, device, g) for _ in range(2))
    slot_ids = torch.randperm(slots, generator=g)[:batch].int().to(device)
    lens = torch.randint(1, max_ctx - QB, (batch,), generator=g).int().to(device)
    return (q, k_blk, v_blk, k_arena, v_arena, slot_ids, lens)


def store_args(case, num_new):
    _, k_blk, v_blk, k_cache, v_cache, table, lens = case
    return (k_blk, v_blk, num_new, k_cache, v_cache, table, lens)


def _num_new(case):
    return torch.tensor([QB, 1], dtype=torch.int32, device=case[0].device)


# ---------------------------------------------------------------------------------------------
# opcheck (schema, fake tensors, autograd registration, AOT dispatch)


@pytest.mark.parametrize("op, make", [("paged_attention", paged_case),
                                      ("arena_attention", arena_case)])
def test_opcheck_attention(op, make):
    case = make("cpu")
    torch.library.opcheck(getattr(torch.ops.drafter_attn, op), case)
    out = torch.empty_like(case[0])
    torch.library.opcheck(getattr(torch.ops.drafter_attn, op + "_out"), (out, *case))


@pytest.mark.parametrize("op, make", [("store_paged", paged_case), ("store_arena", arena_case)])
def test_opcheck_store(op, make):
    case = make("cpu")
    torch.library.opcheck(getattr(torch.ops.drafter_attn, op), store_args(case, _num_new(case)))


def test_fake_attention_has_the_shape_of_q():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        case = tuple(mode.from_tensor(t) for t in paged_case("cpu"))
        out = torch.ops.drafter_attn.paged_attention(*case)
        assert out.shape == case[0].shape and out.dtype == DT
        bad = torch.empty(2, QB, HQ, D + 1, dtype=DT)
        with pytest.raises(ValueError, match="out has shape"):
            torch.ops.drafter_attn.paged_attention_out(bad, *case)


# ---------------------------------------------------------------------------------------------
# eager results against the reference


def test_ops_match_reference_and_out_is_written():
    case = paged_case("cpu")
    want = reference.paged_attention(*case)
    torch.testing.assert_close(ops.paged_attention(*case), want, rtol=0, atol=0)
    out = torch.full_like(case[0], float("nan"))
    assert ops.paged_attention(*case, out=out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    acase = arena_case("cpu")
    aout = torch.zeros_like(acase[0])
    ops.arena_attention(*acase, mask="sliding", window=5, out=aout)
    torch.testing.assert_close(aout, reference.arena_attention(*acase, mask="sliding", window=5))


def test_store_ops_mutate_caches_and_lengths():
    case = paged_case("cpu")
    num_new = _num_new(case)
    want = [t.clone() for t in case]
    reference.store_paged(*store_args(want, num_new))
    ops.store_paged(*store_args(case, num_new))
    for got, exp in zip(case[3:], want[3:]):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)
    assert not torch.equal(case[6], paged_case("cpu")[6])  # ctx_lens moved


def test_unknown_default_device_type_is_named():
    with pytest.raises(ValueError, match="device type 'meta'"):
        ops.backend_for("", torch.device("meta"))


# ---------------------------------------------------------------------------------------------
# a drafter layer under torch.compile


class DrafterLayer(torch.nn.Module):
    """Projections, the block's attention over the cache, then the block's store into it."""

    def __init__(self, hidden=96, backend=""):
        super().__init__()
        self.backend = backend
        self.q = torch.nn.Linear(hidden, HQ * D, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * HKV * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, hidden, bias=False)

    def forward(self, x, k_pages, v_pages, table, ctx_lens, num_new):
        B, Qb, _ = x.shape
        q = self.q(x).view(B, Qb, HQ, D)
        k, v = self.kv(x).view(B, Qb, 2, HKV, D).unbind(2)
        k, v = k.contiguous(), v.contiguous()
        attn = ops.paged_attention(q, k, v, k_pages, v_pages, table, ctx_lens,
                                   mask="sliding_causal", window=24, backend=self.backend)
        ops.store_paged(k, v, num_new, k_pages, v_pages, table, ctx_lens, backend=self.backend)
        return self.o(attn.view(B, Qb, HQ * D))


def run_layer_steps(layer, fn, device, steps=3):
    """Outputs and final cache state of `steps` decode steps of `fn` on a fresh cache."""
    case = paged_case(device)
    _, _, _, k_pages, v_pages, table, lens = case
    lens.fill_(3)  # room for every step's QB rows
    num_new = torch.tensor([QB, 2], dtype=torch.int32, device=device)
    g = make_generator(7)
    outs = []
    for _ in range(steps):
        x = randn((2, QB, 96), DT, device, g)
        outs.append(fn(x, k_pages, v_pages, table, lens, num_new).clone())
    return outs, (k_pages, v_pages, lens)


def check_compiled_layer(device, mode=None, backend=""):
    torch.manual_seed(0)
    layer = DrafterLayer(backend=backend).to(device=device, dtype=DT)
    compiled = torch.compile(layer, fullgraph=True, mode=mode)
    with torch.no_grad():
        want, want_state = run_layer_steps(layer, layer, device)
        got, got_state = run_layer_steps(layer, compiled, device)
    for g_, w in zip(got + list(got_state), want + list(want_state)):
        torch.testing.assert_close(g_, w, rtol=2e-2, atol=2e-2)
    assert torch.equal(got_state[2].cpu(), torch.tensor([3 + 3 * QB, 3 + 6], dtype=torch.int32))


def test_drafter_layer_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    check_compiled_layer("cpu")


# ---------------------------------------------------------------------------------------------
# GPU: the same through cupy (and cutlass), with out= and CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["", "cutlass"])
def test_opcheck_gpu(backend):
    pytest.importorskip("cupy")
    if backend == "cutlass":
        pytest.importorskip("cutlass_library")
    case = paged_case("cuda")
    kw = {"backend": backend}
    torch.library.opcheck(torch.ops.drafter_attn.paged_attention, case, kw)
    torch.library.opcheck(torch.ops.drafter_attn.paged_attention_out,
                          (torch.empty_like(case[0]), *case), kw)
    acase = arena_case("cuda")
    torch.library.opcheck(torch.ops.drafter_attn.arena_attention, acase, kw)
    torch.library.opcheck(torch.ops.drafter_attn.store_paged, store_args(case, _num_new(case)), kw)
    torch.library.opcheck(torch.ops.drafter_attn.store_arena,
                          store_args(acase, _num_new(acase)), kw)


@pytest.mark.gpu
def test_cupy_ops_match_reference_with_out():
    pytest.importorskip("cupy")
    case = paged_case("cuda")
    want = reference.paged_attention(*case)
    out = torch.full_like(case[0], float("nan"))
    ops.paged_attention(*case, out=out)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    acase = arena_case("cuda")
    aout = torch.full_like(acase[0], float("nan"))
    ops.arena_attention(*acase, out=aout)
    torch.testing.assert_close(aout, reference.arena_attention(*acase), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_drafter_layer_compiles_on_gpu(mode):
    pytest.importorskip("cupy")
    torch._dynamo.reset()
    check_compiled_layer("cuda", mode=mode)
