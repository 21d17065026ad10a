"""The torch custom ops (kernels.ops): opcheck, fake implementations, `out=`, and a drafter layer
under torch.compile. The CPU tests run the reference backend; the `gpu` ones run cupy (and the
CUDA-graph mode of torch.compile)."""

from __future__ import annotations

import re

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
    """Projections, the block's attention over the cache, then the block's store into it:
    through the ops (`backend`), or through a `Runtime` when one is given."""

    def __init__(self, hidden=96, backend="", runtime=None):
        super().__init__()
        self.backend = backend
        self.runtime = runtime
        self.q = torch.nn.Linear(hidden, HQ * D, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * HKV * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, hidden, bias=False)

    def forward(self, x, k_pages, v_pages, table, ctx_lens, num_new):
        B, Qb, _ = x.shape
        q = self.q(x).view(B, Qb, HQ, D)
        k, v = self.kv(x).view(B, Qb, 2, HKV, D).unbind(2)
        k, v = k.contiguous(), v.contiguous()
        if self.runtime is not None:
            attn = self.runtime.paged_attention(q, k, v, k_pages, v_pages, table, ctx_lens,
                                                mask="sliding_causal", window=24)
            self.runtime.store_paged(k, v, num_new, k_pages, v_pages, table, ctx_lens)
        else:
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


def check_compiled_layer(device, mode=None, backend="", runtime=None):
    torch.manual_seed(0)
    layer = DrafterLayer(backend=backend, runtime=runtime).to(device=device, dtype=DT)
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


def test_a_compiled_layer_called_with_grad_says_to_run_under_inference_mode():
    """The layer's weights require grad: compiled and called with grad enabled, torch traces a
    backward the kernels do not have. The error says what to do (torch's own said only that no
    autograd formula was registered); under inference_mode the same layer runs."""
    torch._dynamo.reset()
    layer = DrafterLayer().to(dtype=DT)
    compiled = torch.compile(layer, fullgraph=True)
    with pytest.raises(Exception, match=re.escape(ops.NO_BACKWARD)):
        run_layer_steps(layer, compiled, "cpu", steps=1)
    with torch.inference_mode():
        (out,), _ = run_layer_steps(layer, compiled, "cpu", steps=1)
    assert out.isfinite().all()


def test_runtime_compiles_fullgraph_through_the_ops():
    """A layer calling a Runtime compiles with fullgraph=True: while traced, its functions call
    the custom ops, which run the Runtime (its picks: the reference on the CPU) inside."""
    from drafter_attn.kernels.dispatch import Dispatcher, Runtime

    torch._dynamo.reset()
    rt = Runtime(Dispatcher())
    check_compiled_layer("cpu", runtime=rt)
    assert rt.picks and {p.impl for p in rt.picks.values()} == {"reference"}
    assert ops.backend_for(rt.op_backend, torch.device("cpu")) is rt
    gone = Runtime(Dispatcher()).op_backend  # dropped at once: its name no longer resolves
    with pytest.raises(ValueError, match="no longer exists"):
        ops.backend_for(gone, torch.device("cpu"))


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


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_runtime_compiles_on_gpu(mode):
    pytest.importorskip("cupy")
    from drafter_attn.kernels.dispatch import Runtime

    torch._dynamo.reset()
    rt = Runtime()
    check_compiled_layer("cuda", mode=mode, runtime=rt)
    assert rt.picks and all(p.impl != "reference" for p in rt.picks.values())


# ---------------------------------------------------------------------------------------------
# engine pools: K and V as strided views of one [blocks, 2, Hkv, page, D] tensor (TensorRT-LLM)


def trtllm_pool_case(device, batch=2, max_pages=4, num_pages=12, seed=3):
    """The paged case with K and V pages as views `pool[:, 0]`, `pool[:, 1]` of one pool."""
    case = list(paged_case(device, batch, max_pages, num_pages, seed))
    pool = torch.stack([case[3], case[4]], dim=1)  # [blocks, 2, Hkv, page, D]
    case[3], case[4] = pool[:, 0], pool[:, 1]
    return case, pool


def test_trtllm_pool_views_are_taken_without_a_copy():
    case, pool = trtllm_pool_case("cpu")
    k, v = case[3], case[4]
    assert not k.is_contiguous() and k.data_ptr() == pool.data_ptr()
    dense = [t.contiguous() if t.dim() == 4 else t for t in case]
    torch.testing.assert_close(ops.paged_attention(*case), reference.paged_attention(*dense),
                               rtol=0, atol=0)
    num_new = _num_new(case)
    want = [t.clone() for t in dense]
    reference.store_paged(*store_args(want, num_new))
    ops.store_paged(*store_args(case, num_new))  # writes through the views into the pool
    torch.testing.assert_close(pool[:, 0], want[3], rtol=0, atol=0)
    torch.testing.assert_close(pool[:, 1], want[4], rtol=0, atol=0)
    torch.testing.assert_close(case[6], want[6], rtol=0, atol=0)


def test_pool_views_that_cannot_be_addressed_are_rejected():
    case, pool = trtllm_pool_case("cpu")
    bad = list(case)
    bad[4] = case[4].contiguous()  # one stride for K and V
    with pytest.raises(ValueError, match="one page stride"):
        ops.paged_attention(*bad)
    padded = torch.zeros(12, HKV, PS, 2 * D, dtype=DT)[..., :D]  # rows not packed
    bad[3], bad[4] = padded, padded
    with pytest.raises(ValueError, match="k_pages must be contiguous within each page"):
        reference.paged_attention(*bad)
    wide = torch.zeros(12, HKV, PS, D, dtype=DT)
    bad[3], bad[4] = wide.as_strided(wide.shape, (8, PS * D, D, 1)), wide
    with pytest.raises(ValueError, match="overlap"):
        reference.paged_attention(*bad)


def test_out_buffer_is_checked():
    from drafter_attn.kernels import contract

    q = paged_case("cpu")[0]
    contract.check_out(torch.empty_like(q), q)
    with pytest.raises(ValueError, match="out has dtype"):
        contract.check_out(torch.empty_like(q, dtype=torch.float16), q)
    with pytest.raises(ValueError, match="out has shape"):
        contract.check_out(q.new_empty(2, QB, HQ, 2 * D)[..., :D].contiguous()[:1], q)
    with pytest.raises(ValueError, match="out must be contiguous"):
        contract.check_out(q.new_empty(2, QB, HQ, 2 * D)[..., :D], q)


@pytest.mark.parametrize("bad, message", [
    (lambda q: torch.empty_like(q, dtype=torch.float32), "out has dtype"),
    (lambda q: q.new_empty(3, *q.shape), "out must have 4 dimensions"),
    (lambda q: q.new_empty(*q.shape[:3], 2 * q.shape[3])[..., :q.shape[3]], "out must be contiguous"),
])
def test_a_bad_out_is_refused_eager_and_compiled_alike(bad, message):
    """`out=` through the ops with a backend that has no `out=` (the reference, every CPU call):
    refused as cupy refuses it, not cast or broadcast into by a copy; traced, the same check."""
    args = paged_case("cpu")
    out = bad(args[0])
    with pytest.raises(ValueError, match=message):
        ops.paged_attention(*args, out=out, backend="reference")
    compiled = torch.compile(lambda *a: ops.paged_attention(*a, out=out, backend="reference"), fullgraph=True)
    with pytest.raises(Exception, match=message):
        compiled(*args)


# ---------------------------------------------------------------------------------------------
# the cupy backend's plans (CPU: planning only, with a stand-in device and module)


def _header_fields(path) -> list[str]:
    """Field names of `struct DrafterParams` in params.cuh, in order."""
    import re

    body = path.read_text().split("struct DrafterParams {", 1)[1].split("};", 1)[0]
    names = []
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        names += [re.findall(r"(\w+)\s*$", part)[0] for part in decl.split(",") if part.strip()]
    return names


def test_host_params_mirror_the_header():
    from drafter_attn.kernels import cupy_backend as cb
    from drafter_attn.kernels.nvrtc import CUDA_SRC_DIR

    assert [f[0] for f in cb.DrafterParams._fields_] == _header_fields(CUDA_SRC_DIR / "params.cuh")
    store_src = (CUDA_SRC_DIR / "combine_store.cuh").read_text()
    for kernel, args in (("drafter_store", cb.StoreArgs), ("drafter_combine", cb.CombineArgs)):
        params = store_src.split(f"{kernel}(", 1)[1].split(")", 1)[0].split(",")
        assert len(params) == len(args._fields_), kernel
        for decl, (name, ctype) in zip(params, args._fields_):
            assert ("*" in decl) == (ctype is cb.ctypes.c_void_p), (kernel, decl, name)
    # the kernels take the struct's fields as parameters, in its order (packed field by field)
    header = (CUDA_SRC_DIR / "params.cuh").read_text()
    macro = header.split("#define DRAFTER_KERNEL_PARAMS", 1)[1].split("\n\n", 1)[0].replace("\\", " ")
    assert [decl.split()[-1] for decl in macro.split(",")] == _header_fields(CUDA_SRC_DIR / "params.cuh")
    for src in ("drafter_attention.cu", "cute_drafter_attention.cu"):
        assert "drafter_attention(DRAFTER_KERNEL_PARAMS)" in (CUDA_SRC_DIR / src).read_text()


@pytest.fixture
def planning(monkeypatch):
    """A cupy backend that plans on the CPU: device 0 is a 132-SM sm_90, modules are stand-ins
    with the resources of a real variant, and nothing is launched."""
    import dataclasses

    from drafter_attn.kernels import cupy_backend as cb

    def load(index, items):
        d = dict(items)
        return cb.Module(1, 2, 3, smem=60_000, regs=128, threads=d["NUM_WARPS"] * 32)

    family = dataclasses.replace(cb.CUPY, module="test-planning", load_variant=load)

    class Planned(cb.CupyBackend):
        pass

    Planned.family = family
    monkeypatch.setattr(cb, "device_info", lambda index: (132, 90))
    monkeypatch.setattr(cb, "_index", lambda device: 0)
    monkeypatch.setattr(cb, "_check_kernel_inputs", lambda *a: None)
    monkeypatch.setattr(cb, "_zeros", lambda n, index: torch.zeros(n, dtype=torch.int32))
    monkeypatch.setattr(cb, "_counter_bufs", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return cb, Planned()


def _plan(cb, backend, case, layout="paged", **kw):
    from drafter_attn.kernels import contract

    args = (*case, None)
    extra = (kw.get("mask", "full"), kw.get("window"), kw.get("scale"))
    key = cb.call_key(layout, args, extra)
    check = contract.check_paged if layout == "paged" else contract.check_arena
    return key, backend._plan_attention(key, check(*case, *extra), layout, args)


def test_the_page_stride_of_a_pool_of_zero_or_one_pages():
    """A pool of one page has no stride of its own, and one of no pages (every request empty:
    the contract takes it) none at all: both read as packed pages, not an IndexError."""
    from drafter_attn.kernels.cupy_backend import loc_stride

    for n in (0, 1, 5):
        assert loc_stride(torch.empty(n, HKV, PS, D), PS) == 1
        assert loc_stride(torch.empty(n, 40, HKV, D), None) == 40


def test_attention_plan_packs_shapes_once(planning):
    cb, backend = planning
    case, pool = trtllm_pool_case("cpu", batch=1, max_pages=32, num_pages=40)
    key, plan = _plan(cb, backend, case, mask="sliding", window=300)
    assert backend._plans[key] is plan
    p = plan.attention.args
    assert (p.qb, p.hq, p.hkv, p.group, p.table_stride) == (QB, HQ, HKV, HQ // HKV, 32)
    assert (p.capacity, p.mask_mode, p.window) == (32 * PS, 1, 300)
    assert p.loc_stride * HKV * PS * D == pool.stride(0)  # the pool's: 2 packed pages
    assert p.loc_stride == 2
    assert p.scale_log2 == pytest.approx(D**-0.5 * 1.4426950408889634)
    splits = cb.choose_splits(1, HKV, 300, 64, 132, cb.Module(0, 0, 0, 60_000, 128, 128)
                              .resident_ctas())
    assert plan.splits == splits > 1
    assert plan.attention.grid == (splits, HKV, 1) and plan.attention.block == (128, 1, 1)
    rows = 1 * HKV * QB * (HQ // HKV)
    assert (plan.part_elems, plan.lse_elems) == (splits * rows * D, splits * rows)
    # at most 1024 rows (cb.COMBINE_CTA_MAX_ROWS): the combine takes a CTA a row by default
    assert rows <= cb.COMBINE_CTA_MAX_ROWS
    assert plan.combine.grid == (rows, 1, 1) and plan.combine.args.splits == splits
    _, warp_rows = _plan(cb, backend.with_params(combine=1), case, mask="sliding", window=300)
    assert warp_rows.combine.grid == (-(-rows // 4), 1, 1)


def test_arena_plan_and_forced_splits(planning):
    cb, backend = planning
    case = arena_case("cpu")
    _, plan = _plan(cb, backend.with_params(num_splits=1), case, layout="arena")
    assert plan.splits == 1 and plan.combine is None and plan.part_elems == 0
    p = plan.attention.args
    assert (p.table_stride, p.capacity, p.loc_stride) == (1, 40, 40)  # max_ctx rows


def test_plan_keys_follow_shapes_strides_and_checks(planning, monkeypatch):
    cb, _ = planning
    case = (*paged_case("cpu"), None)
    extra = ("full", None, None)
    assert cb.call_key("paged", case, extra) == cb.call_key("paged", (*paged_case("cpu", seed=5), None), extra)
    views, _ = trtllm_pool_case("cpu")
    assert cb.call_key("paged", (*views, None), extra) != cb.call_key("paged", case, extra)
    longer = (*case[:5], torch.zeros(2, 5, dtype=torch.int32), *case[6:])
    assert cb.call_key("paged", longer, extra) != cb.call_key("paged", case, extra)
    transposed = (case[0], case[1], case[2].transpose(1, 2).contiguous().transpose(1, 2), *case[3:])
    assert cb.call_key("paged", transposed, extra) != cb.call_key("paged", case, extra)
    monkeypatch.setattr(cb, "CHECKS", False)  # DRAFTER_CHECKS=0: only what the plan depends on
    assert cb.call_key("paged", transposed, extra) == cb.call_key("paged", case, extra)
    assert cb.call_key("paged", (*views, None), extra) != cb.call_key("paged", case, extra)


def _variants(t):
    """`t` with one property the contract checks changed each: dtype, shape, strides, device."""
    other = {torch.bfloat16: torch.float16, torch.int32: torch.int64}[t.dtype]
    base = torch.empty(t.numel() * 2 + 1, dtype=t.dtype)
    return {"dtype": torch.empty_strided(t.shape, t.stride(), dtype=other),
            "shape": t.new_empty((*t.shape[:-1], t.shape[-1] + 1)),
            "stride": base.as_strided(t.shape, [2 * s for s in t.stride()]),
            "device": torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")}


@pytest.mark.parametrize("kind", ["paged", "store_paged"])
def test_plan_keys_miss_on_every_checked_property(planning, kind):
    """With checks on, a call that differs from a planned one in any tensor's shape, strides,
    dtype or device gets another key (a plan miss, so the contract checks it again); a call
    that differs in none gets the same key."""
    cb, _ = planning
    case = paged_case("cpu")
    if kind == "paged":
        args = (*case, torch.empty_like(case[0]))
    else:
        args = store_args(case, _num_new(case))
    extra = ("full", None, None) if kind == "paged" else None
    key = cb.call_key(kind, args, extra)
    same = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in args)
    assert cb.call_key(kind, same, extra) == key
    for i, t in enumerate(args):
        for what, changed in _variants(t).items():
            call = (*args[:i], changed, *args[i + 1:])
            assert cb.call_key(kind, call, extra) != key, (i, what)
    if kind == "paged":  # out= given or not
        assert cb.call_key(kind, (*args[:7], None), extra) != key


def test_a_call_with_no_tensor_is_named_by_the_contract(planning):
    cb, backend = planning
    case = paged_case("cpu")
    assert cb.call_key("paged", (case[0], 3, *case[2:], None), ("full", None, None)) is None
    with pytest.raises(ValueError, match="k_blk must be a torch.Tensor"):
        backend.paged_attention(case[0], 3, *case[2:])
    with pytest.raises(ValueError, match="k_blk must be a torch.Tensor"):
        backend.paged_attention(case[0], None, *case[2:])
    assert not backend._plans


@pytest.fixture
def launches(planning, monkeypatch):
    """`planning` whose launches are recorded, not run: (plan launch, stream, o_part) a call;
    the current stream is `stream[0]`."""
    cb, backend = planning
    from drafter_attn.kernels import launch

    calls, stream = [], [7]
    monkeypatch.setattr(launch, "graph_api", lambda: None)  # one by one, as inside a capture
    monkeypatch.setattr(cb.Launch, "__call__",
                        lambda self, s: calls.append((self, s, getattr(self.args, "o_part", 0) or 0)))
    monkeypatch.setattr(cb, "_stream", lambda index: stream[0])
    return cb, backend, calls, stream


def test_split_workspace_is_kept_per_stream_outside_a_capture(launches, monkeypatch):
    cb, backend, calls, stream = launches
    case, _ = trtllm_pool_case("cpu", batch=1, max_pages=32, num_pages=40)
    _, plan = _plan(cb, backend, case, mask="sliding", window=300)
    assert plan.combine is not None
    out = torch.empty_like(case[0])

    def run_on(s):
        stream[0] = s
        calls.clear()
        assert plan.run(*case, out) is out
        (a, s_a, part), (c, s_c, _) = calls
        assert (a, c, s_a, s_c) == (plan.attention, plan.combine, s, s)
        p, ca = plan.attention.args, plan.combine.args
        assert [p.q, p.k_blk, p.v_blk, p.k_cache, p.v_cache, p.table, p.ctx_lens, p.out] == \
            [t.data_ptr() for t in (*case, out)]
        lse = part + 4 * plan.part_elems
        assert (p.o_part, p.lse_part) == (ca.o_part, ca.lse_part) == (part, lse)
        assert ca.out == out.data_ptr()
        return part

    first = run_on(1)
    assert plan.workspaces[1].data_ptr() == first and run_on(1) == first  # reused on one stream
    assert run_on(2) != first  # another stream never shares it
    assert run_on(1) == first
    for s in range(3, 3 + cb._WORKSPACE_STREAMS):
        run_on(s)
    assert len(plan.workspaces) == cb._WORKSPACE_STREAMS and 1 not in plan.workspaces  # oldest
    kept = dict(plan.workspaces)
    monkeypatch.setattr(cb, "capturing", lambda: True)
    for s in (3, 99):  # a capture's workspace is its own, also on a stream with a kept one
        assert run_on(s) not in {w.data_ptr() for w in kept.values()}
    assert plan.workspaces == kept


def test_store_counters_are_kept_per_stream_and_a_capture_has_its_own(launches, monkeypatch):
    """Stores on two streams may be in flight together: each stream's stores take their own
    arrival counters (shared, they would mix the two stores' arrivals), every plan on one stream
    the same buffer, and a capture the plan's own (never one that eager stores write)."""
    cb, backend, calls, stream = launches
    case = paged_case("cpu")
    args = store_args(case, _num_new(case))
    wide = paged_case("cpu", batch=3)
    other = store_args(wide, torch.tensor([QB, 1, 0], dtype=torch.int32))

    def store_on(s, a=args):
        stream[0] = s
        calls.clear()
        backend.store_paged(*a)
        ((launch, s_launch, _),) = calls
        assert s_launch == s
        return launch.args.counters

    first = store_on(1)
    assert store_on(1) == first and store_on(2) != first and store_on(1) == first
    assert store_on(1, other) == first  # another plan, the same stream: one buffer
    assert store_on(2, other) == store_on(2)
    assert {k[1] for k in cb._counter_bufs} == {1, 2}
    assert all(b.numel() == cb.MAX_BATCH and not b.any() for b in cb._counter_bufs.values())
    monkeypatch.setattr(cb, "capturing", lambda: True)
    plan = backend._plans[cb.call_key("store_paged", args, None)]
    assert store_on(1) == plan.captured.data_ptr() not in {b.data_ptr() for b in cb._counter_bufs.values()}
    # a graph captured from the plan keeps that address after the plan is gone
    captured = plan.captured
    backend.clear_plans()
    del plan
    assert any(t is captured for t in cb._kept_counters)


def test_unsplit_plan_has_no_workspace(launches):
    cb, backend, calls, _ = launches
    case = paged_case("cpu")
    _, plan = _plan(cb, backend.with_params(num_splits=1), case)
    out = plan.run(*case, None)
    assert out.shape == case[0].shape and calls == [(plan.attention, 7, 0)]
    p = plan.attention.args
    assert (p.out, p.o_part, p.lse_part) == (out.data_ptr(), None, None) and not plan.workspaces


def test_store_plan(planning):
    cb, backend = planning
    case, pool = trtllm_pool_case("cpu")
    args = store_args(case, _num_new(case))
    key = cb.call_key("store_paged", args, None)
    from drafter_attn.kernels import contract

    plan = backend._plan_store(key, contract.check_store_paged(*args), args)
    a = plan.launch.args
    assert plan.launch.grid == (QB, 2, 1)
    assert (a.rows, a.hkv, a.table_stride, a.capacity, a.loc_stride) == (QB, HKV, 4, 4 * PS, 2)
    assert plan.captured.shape == (2,) and not plan.captured.any()  # its captures' counters
    assert backend._plans[key] is plan


def test_cutlass_family_is_its_own():
    pytest.importorskip("cutlass_library")
    from drafter_attn.kernels import cupy_backend as cb
    from drafter_attn.kernels import cutlass_backend as kb

    assert kb.BACKEND.family is kb.CUTLASS and cb.BACKEND.family is cb.CUPY
    assert kb.BACKEND.with_params(tile_n=32).family is kb.CUTLASS
    assert kb.CUTLASS.Params is kb.Params and kb.CUTLASS.supports is kb.supports


def test_kernels_reject_strides_off_their_unit(planning):
    cb, backend = planning
    case = list(paged_case("cpu"))
    def padded():  # pages 8 elements further apart than packed ones
        return torch.randn(12, HKV * PS * D + 8).to(DT)[:, : HKV * PS * D].view(12, HKV, PS, D)

    case[3], case[4] = padded(), padded()
    assert reference.paged_attention(*case).shape == case[0].shape  # fine for the contract
    with pytest.raises(ValueError, match="must be a multiple of one packed page"):
        _plan(cb, backend, tuple(case))


# ---------------------------------------------------------------------------------------------
# eager calls skip the dispatcher


class _Recorder:
    """A backend that answers with the reference and records whether each call ran inside a
    custom op (the op's autograd layer excludes AutogradOther while its kernel runs)."""

    def __init__(self):
        self.inside_op = []

    def _seen(self):
        self.inside_op.append(torch._C._dispatch_tls_is_dispatch_key_excluded(
            torch._C.DispatchKey.AutogradOther))

    def paged_attention(self, *args, **kw):
        self._seen()
        return reference.paged_attention(*args, **kw)

    def store_paged(self, *args):
        self._seen()
        reference.store_paged(*args)


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setitem(ops._resolved, ("recorder", "cpu"), rec)
    return rec


def test_eager_entry_points_run_the_backend_without_the_op(recorder):
    case = paged_case("cpu")
    ref = reference.paged_attention(*case)
    assert torch.equal(ops.paged_attention(*case, backend="recorder"), ref)
    out = torch.full_like(case[0], float("nan"))
    assert ops.paged_attention(*case, backend="recorder", out=out) is out
    assert torch.equal(out, ref)
    lens = case[6].clone()
    ops.store_paged(*store_args(case[:6] + (lens,), _num_new(case)), backend="recorder")
    assert torch.equal(lens, case[6] + _num_new(case))
    # the op itself still runs inside the dispatcher: what the recorder tells apart
    torch.ops.drafter_attn.paged_attention(*case, backend="recorder")
    assert recorder.inside_op == [False, False, False, True]


def test_traced_calls_take_the_op(recorder):
    case = paged_case("cpu")

    @torch.compile(fullgraph=True, backend="eager")
    def layer(*args):
        return ops.paged_attention(*args, backend="recorder") * 2

    torch.testing.assert_close(layer(*case), 2 * reference.paged_attention(*case))
    assert recorder.inside_op and all(recorder.inside_op)
    assert not ops._eager(torch._subclasses.FakeTensorMode().from_tensor(case[0]))


def test_runtime_reaches_the_picked_plan_in_one_lookup(planning, monkeypatch):
    """After a call of a key has planned, Runtime runs that plan without binding again; a call
    whose checked properties differ (here a strided q) binds and plans anew, and a bad max_ctx
    hint is still named."""
    cb, backend = planning
    from drafter_attn.kernels import runtime as rtm
    from drafter_attn.kernels.dispatcher import Dispatcher

    rt = rtm.Runtime(Dispatcher())
    bindings, runs = [], []
    monkeypatch.setattr(rt, "_attention_binding",
                        lambda layout, *a: bindings.append(layout) or rtm._Bound(backend, None))
    monkeypatch.setattr(cb.AttentionPlan, "run",
                        lambda self, *a: runs.append((self, a[0], a[-1])) or a[0])
    case = paged_case("cpu")
    for _ in range(3):
        assert rt.paged_attention(*case) is case[0]
    assert bindings == ["paged"]
    (plan,) = backend._plans.values()
    assert runs == [(plan, case[0], None)] * 3 and list(rt._plans.values()) == [plan]

    wide = torch.empty(case[0].shape[:-1] + (2 * D,), dtype=DT)[..., :D]  # same shape, strided
    wide.copy_(case[0])
    with pytest.raises(ValueError, match="q"):  # the contract refuses it: nothing cached
        rt.paged_attention(wide, *case[1:])
    assert bindings == ["paged"] * 2 and len(rt._plans) == 1
    with pytest.raises(ValueError, match="max_ctx"):
        rt.paged_attention(*case, max_ctx=10**9)


# ---------------------------------------------------------------------------------------------
# the plan lookup's fast path: each call form's last plan behind a C++ check (kernels.guards)


def test_tensor_check_tells_apart_what_a_plan_key_holds():
    from drafter_attn.kernels import guards

    assert guards.available()  # this torch: the fast path is on
    recent = guards.RecentPlans()
    case = paged_case("cpu")
    recent.put("form", case, "plan")
    same = tuple(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in case)
    assert recent.get("form", same) == "plan" and recent.get("other form", same) is None
    for i, t in enumerate(case):
        for what, changed in _variants(t).items():
            assert recent.get("form", (*case[:i], changed, *case[i + 1:])) is None, (i, what)
    assert recent.get("form", (case[0], None, *case[2:])) is None  # not a tensor: a miss


def test_a_call_passing_one_tensor_twice_keeps_no_entry(monkeypatch):
    """k_blk passed as v_blk too: torch's check never passes such a call, so no entry is built
    for it (one would be rebuilt, at several us, on every call); distinct tensors still are."""
    from drafter_attn.kernels import guards

    built = []
    monkeypatch.setattr(guards, "_build", lambda tensors: built.append(len(tensors)) or object())
    recent = guards.RecentPlans()
    q, k_blk, _, *rest = paged_case("cpu")
    recent.put("form", (q, k_blk, k_blk, *rest), "plan")
    assert built == [] and recent.get("form", (q, k_blk, k_blk, *rest)) is None
    recent.put("form", (q, k_blk, k_blk.clone(), *rest), "plan")
    assert built == [7]


@pytest.fixture
def counted_keys(launches, monkeypatch):
    """`launches` with the slow path's key computations and contract checks counted."""
    cb, backend, calls, stream = launches
    from drafter_attn.kernels import contract

    counts = {"key": 0, "check": 0}

    def counting(fn, what):
        def wrapped(*a, **kw):
            counts[what] += 1
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(cb, "call_key", counting(cb.call_key, "key"))
    for name in ("check_paged", "check_store_paged"):
        monkeypatch.setattr(contract, name, counting(getattr(contract, name), "check"))
    return cb, backend, calls, counts


def test_a_call_like_the_last_of_its_form_skips_key_and_checks(counted_keys):
    cb, backend, calls, counts = counted_keys
    case = paged_case("cpu")
    backend.paged_attention(*case)
    assert counts == {"key": 1, "check": 1} and len(backend._plans) == 1
    (plan,) = backend._plans.values()
    fresh = paged_case("cpu", seed=9)  # new tensors, same metadata: new pointers, one plan
    out = backend.paged_attention(*fresh)
    assert counts == {"key": 1, "check": 1}
    assert plan.attention.args.q == fresh[0].data_ptr() and plan.attention.args.out == out.data_ptr()
    backend.paged_attention(*fresh, mask="sliding", window=30)  # another form: the key path
    backend.paged_attention(*fresh, out=torch.empty_like(fresh[0]))  # out= is another form too
    assert counts == {"key": 3, "check": 3} and len(backend._plans) == 3
    bad = (*fresh[:6], fresh[6].long())  # a property the contract checks: a miss, refused
    with pytest.raises(ValueError, match="ctx_lens"):
        backend.paged_attention(*bad)
    assert counts == {"key": 4, "check": 4}
    backend.paged_attention(*case)  # the form's last plan is still the first one
    assert counts == {"key": 4, "check": 4}


def test_stores_take_the_fast_path_too(counted_keys):
    cb, backend, calls, counts = counted_keys
    case = paged_case("cpu")
    backend.store_paged(*store_args(case, _num_new(case)))
    fresh = paged_case("cpu", seed=4)
    backend.store_paged(*store_args(fresh, _num_new(fresh)))
    assert counts == {"key": 1, "check": 1}
    (plan,) = backend._plans.values()
    assert plan.launch.args.k_new == fresh[1].data_ptr()
    assert plan.launch.args.ctx_lens == fresh[6].data_ptr()
    backend.clear_plans()  # plans again (a plan holds its module)
    backend.store_paged(*store_args(fresh, _num_new(fresh)))
    assert counts == {"key": 2, "check": 2}


def test_full_checks_check_every_call(counted_keys, monkeypatch):
    cb, backend, calls, counts = counted_keys
    monkeypatch.setattr(cb, "FULL_CHECKS", True)  # DRAFTER_CHECKS=full
    case = paged_case("cpu")
    for _ in range(3):
        backend.paged_attention(*case)
        backend.store_paged(*store_args(case, _num_new(case)))
    assert counts["check"] == 6 and len(backend._plans) == 2


def test_arguments_are_packed_only_when_pointers_change(launches):
    cb, backend, calls, _ = launches
    case = paged_case("cpu")
    out = torch.empty_like(case[0])
    backend.paged_attention(*case, out=out)
    (plan,) = backend._plans.values()
    version = plan.launches.version
    backend.paged_attention(*case, out=out)
    assert plan.launches.version == version  # same pointers: nothing packed, nothing to set
    other = torch.empty_like(out)
    backend.paged_attention(*case, out=other)
    assert plan.launches.version == version + 1 and plan.attention.args.out == other.data_ptr()
    if plan.combine is not None:
        assert plan.combine.args.out == other.data_ptr()


def test_runtime_runs_the_last_plan_of_a_form_for_matching_tensors():
    from drafter_attn.kernels.dispatcher import Dispatcher
    from drafter_attn.kernels.runtime import Runtime

    rt = Runtime(Dispatcher())
    case = paged_case("cpu")
    ran = []

    class Plan:
        def run(self, *args):
            ran.append(args)
            return "planned"

    rt._recent.put(("paged", "full", None, None, None), case, Plan())
    fresh = paged_case("cpu", seed=5)
    assert rt.paged_attention(*fresh) == "planned" and ran == [(*fresh, None)]
    # another form or other metadata: the binding's path (the reference, on CPU tensors)
    want = reference.paged_attention(*fresh, mask="sliding", window=30)
    assert torch.equal(rt.paged_attention(*fresh, mask="sliding", window=30), want)
    wider = (*fresh[:5], torch.zeros(2, 5, dtype=torch.int32), fresh[6])
    assert torch.is_tensor(rt.paged_attention(*wider)) and len(ran) == 1


def test_two_threads_first_stores_on_one_stream_share_one_counter_buffer(monkeypatch):
    """torch.zeros lets another thread run: two plans' first stores on one stream, from two
    threads, must both get the buffer the stream keeps (the other one would be freed)."""
    import threading
    import time

    from drafter_attn.kernels import cupy_backend as cb

    def slow_zeros(n, index):
        time.sleep(0.05)
        return torch.zeros(n, dtype=torch.int32)

    monkeypatch.setattr(cb, "_zeros", slow_zeros)
    monkeypatch.setattr(cb, "_counter_bufs", {})
    got = []
    threads = [threading.Thread(target=lambda: got.append(cb._stream_counters(0, 7))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and got[0] == cb._counter_bufs[(0, 7)].data_ptr()
