"""The four contract functions as torch custom ops (`torch.ops.drafter_attn.*`).

Registered with `torch.library.custom_op`, each with a fake implementation and its mutated
arguments declared, so `torch.compile(fullgraph=True)` (default and reduce-overhead modes) traces
a drafter layer through them without looking inside the kernels, and functionalization orders a
store before the attention that reads the cache it wrote.

Each op runs on a registry backend: `backend=""` picks the device's default (the torch reference
on the CPU, cupy on CUDA); any `registry.from_spec` string ("cutlass", "cupy:tile_n=32") names
another, and `register_runtime` names a `Runtime` (how a Runtime runs under torch.compile).
`*_out` ops write into a caller's buffer (as vLLM passes a preallocated output).

The Python entry points below (`paged_attention`, ..., `store_arena`) take the op only while
torch.compile traces them (or for fake tensors); an eager call on plain tensors runs the same
backend directly, without the dispatcher's host time (`_eager`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Optional

import torch

from drafter_attn.kernels import registry
from drafter_attn.kernels.contract import check_out, hint_kwargs

DEFAULT_BACKENDS = {"cpu": "reference", "cuda": "cupy"}
_resolved: dict[tuple[str, str], object] = {}


RUNTIME_PREFIX = "runtime:"
_runtimes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_runtime(runtime) -> str:
    """The `backend` string under which the ops run `runtime` (a `kernels.runtime.Runtime`,
    held weakly): what its four functions pass to the ops while torch.compile traces them."""
    spec = f"{RUNTIME_PREFIX}{id(runtime):x}"
    _runtimes[spec] = runtime
    return spec


def backend_for(spec: str, device: torch.device):
    """The registry backend for `spec` (empty: the default of `device`'s type), cached; or the
    Runtime a `register_runtime` string names."""
    if spec.startswith(RUNTIME_PREFIX):
        runtime = _runtimes.get(spec)
        if runtime is None:
            raise ValueError(f"backend {spec!r}: that Runtime no longer exists")
        return runtime
    key = (spec, device.type)
    backend = _resolved.get(key)
    if backend is None:
        name = spec or DEFAULT_BACKENDS.get(device.type)
        if name is None:
            raise ValueError(f"no default drafter backend for device type {device.type!r}; "
                             f"pass backend= one of {registry.names()}")
        backend = _resolved[key] = registry.from_spec(name)
    return backend


def _takes_out(fn) -> bool:
    # keyed by the function, not the bound method: a cached bound method would keep its
    # object (a Runtime) alive for good
    return _function_takes_out(getattr(fn, "__func__", fn))


@functools.lru_cache(maxsize=None)
def _function_takes_out(fn) -> bool:
    return "out" in inspect.signature(fn).parameters


def _attend(name, tensors, mask, window, scale, backend, max_ctx, out=None):
    """Backend `backend`'s `name` (paged_attention / arena_attention) on `tensors`, into `out`
    when given: the body of the attention ops, and what an eager call runs without them."""
    fn = getattr(backend_for(backend, tensors[0].device), name)
    if out is None:
        return fn(*tensors, mask=mask, window=window, scale=scale, **hint_kwargs(max_ctx))
    # Backends without `out=` (the reference) compute a fresh tensor; copy it over, once `out` is
    # checked as a backend that takes it checks it (a copy_ would cast or broadcast silently).
    if _takes_out(fn):
        fn(*tensors, mask=mask, window=window, scale=scale, out=out, **hint_kwargs(max_ctx))
    else:
        check_out(out, tensors[0])
        out.copy_(fn(*tensors, mask=mask, window=window, scale=scale, **hint_kwargs(max_ctx)))
    return out


def _store(name, tensors, backend) -> None:
    """Backend `backend`'s `name` (store_paged / store_arena) on `tensors`, in place: the body of
    the store ops, and what an eager call runs without them."""
    getattr(backend_for(backend, tensors[0].device), name)(*tensors)


def _eager(t) -> bool:
    """Whether a Python entry point runs its backend directly, not through the custom op: for a
    plain tensor outside torch.compile's tracing. Only tracing needs the op (it keeps the kernels
    opaque to the compiler and declares what a store mutates); the dispatcher's way through it
    costs about 20 us of host time a call (H200: 34 against 14 us, results/sm90-2026-12-03/
    session16/host/). Fake and functional tensors, and tracers' proxies, still take the op."""
    return type(t) is torch.Tensor and not torch.compiler.is_compiling()


# ---------------------------------------------------------------------------------------------
# attention


@torch.library.custom_op("drafter_attn::paged_attention", mutates_args=())
def _paged_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor,
                     k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                     ctx_lens: torch.Tensor, mask: str = "full", window: Optional[int] = None,
                     scale: Optional[float] = None, backend: str = "",
                     max_ctx: Optional[int] = None) -> torch.Tensor:
    return _attend("paged_attention", (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens),
                   mask, window, scale, backend, max_ctx)


@torch.library.custom_op("drafter_attn::paged_attention_out", mutates_args=("out",))
def _paged_attention_out(out: torch.Tensor, q: torch.Tensor, k_blk: torch.Tensor,
                         v_blk: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                         block_table: torch.Tensor, ctx_lens: torch.Tensor, mask: str = "full",
                         window: Optional[int] = None, scale: Optional[float] = None,
                         backend: str = "", max_ctx: Optional[int] = None) -> None:
    _attend("paged_attention", (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens), mask,
            window, scale, backend, max_ctx, out)


@torch.library.custom_op("drafter_attn::arena_attention", mutates_args=())
def _arena_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor,
                     k_arena: torch.Tensor, v_arena: torch.Tensor, slots: torch.Tensor,
                     ctx_lens: torch.Tensor, mask: str = "full", window: Optional[int] = None,
                     scale: Optional[float] = None, backend: str = "",
                     max_ctx: Optional[int] = None) -> torch.Tensor:
    return _attend("arena_attention", (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens), mask,
                   window, scale, backend, max_ctx)


@torch.library.custom_op("drafter_attn::arena_attention_out", mutates_args=("out",))
def _arena_attention_out(out: torch.Tensor, q: torch.Tensor, k_blk: torch.Tensor,
                         v_blk: torch.Tensor, k_arena: torch.Tensor, v_arena: torch.Tensor,
                         slots: torch.Tensor, ctx_lens: torch.Tensor, mask: str = "full",
                         window: Optional[int] = None, scale: Optional[float] = None,
                         backend: str = "", max_ctx: Optional[int] = None) -> None:
    _attend("arena_attention", (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens), mask, window,
            scale, backend, max_ctx, out)


def _fake_attention(q, *args, **kwargs):
    return torch.empty_like(q)


def _fake_attention_out(out, q, *args, **kwargs):
    check_out(out, q)  # what the eager call checks, traced the same


for _op in (_paged_attention, _arena_attention):
    _op.register_fake(_fake_attention)
for _op in (_paged_attention_out, _arena_attention_out):
    _op.register_fake(_fake_attention_out)


# ---------------------------------------------------------------------------------------------
# context store


@torch.library.custom_op("drafter_attn::store_paged",
                         mutates_args=("k_pages", "v_pages", "ctx_lens"))
def _store_paged(k_new: torch.Tensor, v_new: torch.Tensor, num_new: torch.Tensor,
                 k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor,
                 ctx_lens: torch.Tensor, backend: str = "") -> None:
    _store("store_paged", (k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens),
           backend)


@torch.library.custom_op("drafter_attn::store_arena",
                         mutates_args=("k_arena", "v_arena", "ctx_lens"))
def _store_arena(k_new: torch.Tensor, v_new: torch.Tensor, num_new: torch.Tensor,
                 k_arena: torch.Tensor, v_arena: torch.Tensor, slots: torch.Tensor,
                 ctx_lens: torch.Tensor, backend: str = "") -> None:
    _store("store_arena", (k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens), backend)


@_store_paged.register_fake
def _(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens, backend=""):
    return None


@_store_arena.register_fake
def _(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens, backend=""):
    return None


# A drafter runs inference only: the kernels have no backward. A model whose weights require
# grad, compiled and called with grad enabled, would otherwise fail in torch's own words ("no
# autograd formula was registered"); this says what to do.
NO_BACKWARD = ("drafter_attn's ops have no backward (drafter attention is inference only): run "
               "the model under torch.inference_mode() or torch.no_grad()")


def _no_backward(ctx, *grads):
    raise RuntimeError(NO_BACKWARD)


for _op in (_paged_attention, _arena_attention):  # (torch takes formulas for functional ops only)
    _op.register_autograd(_no_backward, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------------------------------------
# Python entry points (the contract's signatures, plus `out=` and `backend=`)


def paged_attention(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *, mask="full",
                    window=None, scale=None, out=None, backend="", max_ctx=None):
    """`torch.ops.drafter_attn.paged_attention`, or its `_out` form when `out` is given (while
    torch.compile traces; eagerly, the same backend without the op).

    Args (as `kernels.reference.paged_attention`):
        q: [B, Qb, Hq, D]; bfloat16, float16 or float32.
        k_blk, v_blk: [B, Qb, Hkv, D], q's dtype; Hq % Hkv == 0.
        k_pages, v_pages: [num_pages, Hkv, page_size, D], q's dtype.
        block_table: int32 [B, max_pages]; ctx_lens: int32 [B].
        mask, window, scale: "full" / "sliding" / "sliding_causal", its window, None = D ** -0.5.
        out: an optional [B, Qb, Hq, D] buffer in q's dtype, written and returned.
        backend: a `registry.from_spec` string; "" is the device's default (reference on the
            CPU, cupy on CUDA).
        max_ctx: optional host int bounding ctx_lens (e.g. the engine's longest host-side
            length plus Qb), at most max_pages * page_size: the work split is planned from it
            instead of the block table's width. Under torch.compile / CUDA graphs each distinct
            value may trace or capture anew: pass a bucketed bound (the engine's graph bucket).

    Returns:
        [B, Qb, Hq, D] in q's dtype (`out` when given). Bad arguments raise ValueError naming
        the argument.

    Example:
        >>> out = torch.empty_like(q)
        >>> paged_attention(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens,
        ...                 out=out) is out
        True
    """
    if _eager(q):
        return _attend("paged_attention", (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens),
                       mask, window, scale, backend, max_ctx, out)
    args = (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, mask, window, scale, backend,
            max_ctx)
    if out is None:
        return torch.ops.drafter_attn.paged_attention(*args)
    torch.ops.drafter_attn.paged_attention_out(out, *args)
    return out


def arena_attention(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *, mask="full",
                    window=None, scale=None, out=None, backend="", max_ctx=None):
    """`torch.ops.drafter_attn.arena_attention`, or its `_out` form when `out` is given (eagerly,
    the same backend without the op, as `paged_attention`).

    As `paged_attention`, with k_arena, v_arena [num_slots, max_ctx, Hkv, D] and slots int32
    [B] instead of pages and block table (the `max_ctx` hint at most k_arena.shape[1]).
    Returns [B, Qb, Hq, D] in q's dtype.

    Example:
        >>> arena_attention(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens,
        ...                 mask="sliding_causal", window=128, backend="reference").shape
        torch.Size([2, 16, 32, 128])
    """
    if _eager(q):
        return _attend("arena_attention", (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens), mask,
                       window, scale, backend, max_ctx, out)
    args = (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, mask, window, scale, backend,
            max_ctx)
    if out is None:
        return torch.ops.drafter_attn.arena_attention(*args)
    torch.ops.drafter_attn.arena_attention_out(out, *args)
    return out


def store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens, *, backend=""):
    """`torch.ops.drafter_attn.store_paged`: the context store into pages, in place.

    Args (as `kernels.reference.store_paged`):
        k_new, v_new: [B, T, Hkv, D] new rows; num_new: int32 [B], rows j < num_new[b] are kept.
        k_pages, v_pages: [num_pages, Hkv, page_size, D], k_new's dtype; written in place.
        block_table: int32 [B, max_pages]; ctx_lens: int32 [B], advanced by num_new in place.
        backend: as in `paged_attention`.

    Example:
        >>> lens = ctx_lens.clone()  # the example's own lengths
        >>> store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, lens)
        >>> (lens - ctx_lens).tolist()
        [3, 16]
    """
    if _eager(k_new):
        return _store("store_paged", (k_new, v_new, num_new, k_pages, v_pages, block_table,
                                      ctx_lens), backend)
    torch.ops.drafter_attn.store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table,
                                       ctx_lens, backend)


def store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens, *, backend=""):
    """`torch.ops.drafter_attn.store_arena`: as `store_paged`, into k_arena, v_arena
    [num_slots, max_ctx, Hkv, D] at each request's slot (slots int32 [B]).

    Example:
        >>> lens = ctx_lens.clone()  # the example's own lengths
        >>> store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, lens)
        >>> (lens - ctx_lens).tolist()
        [3, 16]
    """
    if _eager(k_new):
        return _store("store_arena", (k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens),
                      backend)
    torch.ops.drafter_attn.store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens,
                                       backend)
