"""Input validation of the four contract functions (docs/design.md, "The functional contract").

Every backend calls these before any work, so a bad input gets a ValueError that names the
argument instead of a wrong answer or an illegal address.

Checks that depend only on shapes, dtypes, devices, strides and Python arguments always run.
Checks that depend on tensor *values* (ctx_lens against the capacity, page ids and slots in range,
num_new in [0, T], no two stored rows landing on one cache row) run only when the tensors are on the
CPU: reading device memory would make the host wait for the GPU, and a decode step must never do
that (nor could it inside a CUDA graph). On the GPU those conditions are the caller's
responsibility; the reference clamps what it can so that a violation gives wrong numbers rather
than an out-of-range access where it cheaply can.

Debug mode: with the environment variable DRAFTER_CHECKS=full the value checks also run on GPU
tensors (outside CUDA graph capture). Each call then reads device memory and waits for the GPU, so
it is for finding a caller's bug, never for serving or timing.

The `max_ctx` hint of the attention calls (a host int: the longest `ctx_lens` of the call, which an
engine knows from its host-side sequence lengths) is checked on every call, from the Python int
alone (`plan_ctx`): a positive integer, at most the capacity. `ctx_lens` above it are the caller's
error, checked like the other values (CPU tensors only); on the GPU the kernels still read every
request's whole context, since only the split count is planned from the hint
(docs/design.md, "The functional contract").
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch

from drafter_attn.kernels.spec import REFERENCE_DTYPES, is_power_of_two, resolve_window

_FLOAT_DTYPES = tuple(getattr(torch, name) for name in REFERENCE_DTYPES)


@dataclass(frozen=True)
class Dims:
    """Sizes of one attention call, resolved from its arguments."""

    batch: int
    block_size: int  # Qb
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    page_size: int | None  # None for the arena layout
    capacity: int  # tokens addressable per request: table columns * page_size, or max_ctx
    mask: str
    window: int | None  # None for mask="full"
    scale: float
    dtype: torch.dtype
    max_ctx: int | None = None  # the caller's bound on ctx_lens (validated), None when not given

    @property
    def plan_ctx(self) -> int:
        """Context tokens the host plans for (split count, dispatch bucket): the capacity, or the
        `max_ctx` hint rounded up to `round_ctx_hint`'s grid (never above the capacity)."""
        return plan_ctx(self.max_ctx, self.capacity)


@dataclass(frozen=True)
class StoreDims:
    """Sizes of one context-store call."""

    batch: int
    rows: int  # T: rows per request in k_new / v_new
    num_kv_heads: int
    head_dim: int
    page_size: int | None
    capacity: int
    dtype: torch.dtype


# ---------------------------------------------------------------------------------------------
# Small checks, each naming the argument it rejects.


def _tensors(**named) -> None:
    for name, (t, ndim) in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _float_dtype(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    if ref.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{ref_name} must be one of {', '.join(REFERENCE_DTYPES)}, got {ref.dtype}")
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; they must match")


def _int32(**named: torch.Tensor) -> None:
    for name, t in named.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")


def _shape(name: str, t: torch.Tensor, **expected: int) -> None:
    if tuple(t.shape) != tuple(expected.values()):
        want = ", ".join(f"{k}={v}" for k, v in expected.items())
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{want}]")


def _contiguous(**named: torch.Tensor) -> None:
    # Kernels address raw pointers with packed strides.
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def _positive_sizes(name: str, t: torch.Tensor, **sizes: int) -> None:
    for what, n in sizes.items():
        if n <= 0:
            raise ValueError(f"{name} has {what}={n}; it must be at least 1 (shape {tuple(t.shape)})")


def _scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim**-0.5
    # numbers.Real admits numpy scalars (np.float32 is not a float subclass); bool is refused.
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def _window(mask, window):
    """The window as a Python int (numpy integers welcome), validated against the mask."""
    if isinstance(window, numbers.Integral) and not isinstance(window, bool):
        window = int(window)
    elif window is not None and mask != "full":
        raise ValueError(f"window must be a positive integer, got {window!r} ({type(window).__name__})")
    return resolve_window(mask, window)


def round_ctx_hint(n: int) -> int:
    """`n` rounded up to a grid of eight steps per octave (at most 12.5% more; exact below 16 and
    at 8..15 x a power of two, so 2k, 8k, 128k stay), which bounds how many plans and picks a
    hint that grows token by token makes: at most eight per doubling of the context.

    Example:
        >>> [round_ctx_hint(n) for n in (15, 8192, 8208, 131088)]
        [15, 8192, 9216, 147456]
    """
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def plan_ctx(max_ctx, capacity: int, cap_arg: str = "block_table") -> int:
    """The context a call is planned for, given the caller's `max_ctx` hint (None: the capacity).

    The hint must be a positive integer (numpy integers welcome) and at most `capacity`, the
    tokens the cache tensors address (`cap_arg` names them in the message). Checks the Python
    value only, so it runs on every call, before any kernel, without a device read.

    Example:
        >>> plan_ctx(8208, 131072), plan_ctx(None, 131072), plan_ctx(8256, 8256)
        (9216, 131072, 8256)
    """
    if max_ctx is None:
        return capacity
    if isinstance(max_ctx, bool) or not isinstance(max_ctx, numbers.Integral) or max_ctx <= 0:
        raise ValueError(f"max_ctx must be a positive integer (the longest ctx_lens of this call, "
                         f"known on the host) or None, got {max_ctx!r}")
    if max_ctx > capacity:
        raise ValueError(f"max_ctx={int(max_ctx)} exceeds the capacity of {cap_arg} ({capacity} "
                         f"tokens); it bounds ctx_lens, which cannot exceed the capacity")
    return min(capacity, round_ctx_hint(int(max_ctx)))


def hint_kwargs(max_ctx) -> dict:
    """`{"max_ctx": max_ctx}`, or {} when None: callers pass the hint only when given, so a
    backend written before it (no `max_ctx=` argument) still runs every unhinted call."""
    return {} if max_ctx is None else {"max_ctx": max_ctx}


def _check_values(t: torch.Tensor) -> bool:
    """Whether the value checks run for tensors on t's device (see the module docstring)."""
    if t.device.type == "cpu":
        return True
    return os.environ.get("DRAFTER_CHECKS") == "full" and not torch.cuda.is_current_stream_capturing()


def _pool_views(k_name: str, k: torch.Tensor, v_name: str, v: torch.Tensor) -> None:
    """K and V caches: each page (or arena slot) packed, pages any whole number of page sizes
    apart, the same for K and V. So K and V may be views of one engine pool, as TensorRT-LLM's
    [blocks, 2, Hkv, page, D] (k = pool[:, 0], v = pool[:, 1]), taken without a copy."""
    for name, t in ((k_name, k), (v_name, v)):
        if t.shape[0] == 0:
            continue
        if not t[0].is_contiguous():
            raise ValueError(f"{name} must be contiguous within each page / slot "
                             f"{tuple(t.shape[1:])} (strides {t.stride()}); only the page "
                             f"stride may differ")
        if t.shape[0] > 1 and t.stride(0) < t[0].numel():
            raise ValueError(f"{name}: pages / slots overlap (stride {t.stride(0)} < "
                             f"{t[0].numel()} elements of one page)")
    if k.shape[0] > 1 and k.stride(0) != v.stride(0):
        raise ValueError(f"{k_name} and {v_name} must have one page stride, got {k.stride(0)} "
                         f"and {v.stride(0)}")


def check_out(out, q: torch.Tensor) -> None:
    """An `out=` buffer of an attention call: q's shape, dtype and device, contiguous."""
    _tensors(out=(out, 4))
    _same_device("q", q, out=out)
    if out.dtype != q.dtype:
        raise ValueError(f"out has dtype {out.dtype} but q has {q.dtype}; they must match")
    _shape("out", out, B=q.shape[0], Qb=q.shape[1], Hq=q.shape[2], D=q.shape[3])
    _contiguous(out=out)


# ---------------------------------------------------------------------------------------------
# Value checks (CPU tensors only; see the module docstring).


def _check_lengths(ctx_lens: torch.Tensor, capacity: int, cap_arg: str, extra=None, extra_name="") -> None:
    lens = ctx_lens.long()
    if (lens < 0).any():
        b = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"ctx_lens[{b}]={int(lens[b])} is negative")
    end = lens if extra is None else lens + extra.long()
    if (end > capacity).any():
        b = int(torch.nonzero(end > capacity)[0])
        what = f"ctx_lens[{b}]={int(lens[b])}"
        if extra is not None:
            what += f" + {extra_name}[{b}]={int(extra[b])}"
        raise ValueError(f"{what} exceeds the capacity of {cap_arg} ({capacity} tokens)")


def _check_hint(ctx_lens: torch.Tensor, max_ctx: int) -> None:
    over = ctx_lens.long() > max_ctx
    if over.any():
        b = int(torch.nonzero(over)[0])
        raise ValueError(f"ctx_lens[{b}]={int(ctx_lens[b])} exceeds max_ctx={max_ctx}, the caller's "
                         f"bound on this call's context lengths")


def _check_pages_in_range(block_table: torch.Tensor, end: torch.Tensor, page_size: int, num_pages: int) -> None:
    # Only the columns that hold tokens [0, end) must be valid page ids; the rest may be garbage.
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    used = (end.long()[:, None] + page_size - 1) // page_size > columns
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bad.any():
        b, c = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_table[{b}, {c}]={int(block_table[b, c])} is not a page id in [0, {num_pages}) "
            f"but request {b} uses that column"
        )


def _check_slots_in_range(slots: torch.Tensor, num_slots: int) -> None:
    bad = (slots < 0) | (slots >= num_slots)
    if bad.any():
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"slots[{b}]={int(slots[b])} is not a slot in [0, {num_slots})")


def _check_distinct_rows(block_table: torch.Tensor, ctx_lens: torch.Tensor, num_new: torch.Tensor,
                         page_size: int) -> None:
    """No two stored rows may land on one cache row (page, offset): the writes would race and one
    request's rows would be lost. Rows a store writes: positions [ctx_lens[b], ctx_lens[b] + num_new[b])."""
    B = block_table.shape[0]
    T = int(num_new.max()) if B else 0
    if T == 0:
        return
    dev = block_table.device
    pos = ctx_lens.long()[:, None] + torch.arange(T, device=dev)[None, :]
    written = torch.arange(T, device=dev)[None, :] < num_new.long()[:, None]
    cols = (pos // page_size).clamp(max=block_table.shape[1] - 1)
    pages = torch.gather(block_table.long(), 1, cols)
    rows = (pages * page_size + pos % page_size)[written]
    if torch.unique(rows).numel() == rows.numel():
        return
    request = torch.arange(B, device=dev)[:, None].expand(B, T)[written]
    order = torch.argsort(rows, stable=True)
    rows, request = rows[order], request[order]
    i = int(torch.nonzero(rows[1:] == rows[:-1])[0])
    a, b = int(request[i]), int(request[i + 1])
    page, offset = divmod(int(rows[i]), page_size)
    if a == b:
        raise ValueError(f"block_table: request {a} writes row {offset} of page {page} twice (its "
                         f"block_table row names page {page} in two columns)")
    raise ValueError(f"block_table: requests {a} and {b} both write row {offset} of page {page}; a "
                     f"store must not write one cache row twice (their block_table rows share page {page})")


# ---------------------------------------------------------------------------------------------
# The shared halves: the query block, and each cache layout.


def _check_block(q, k_blk, v_blk, mask, window, scale):
    _tensors(q=(q, 4), k_blk=(k_blk, 4), v_blk=(v_blk, 4))
    _same_device("q", q, k_blk=k_blk, v_blk=v_blk)
    _float_dtype("q", q, k_blk=k_blk, v_blk=v_blk)
    B, Qb, Hq, D = q.shape
    _positive_sizes("q", q, block_size=Qb, num_q_heads=Hq, head_dim=D)
    Hkv = k_blk.shape[2]
    _positive_sizes("k_blk", k_blk, num_kv_heads=Hkv)
    _shape("k_blk", k_blk, B=B, Qb=Qb, Hkv=Hkv, D=D)
    _shape("v_blk", v_blk, B=B, Qb=Qb, Hkv=Hkv, D=D)
    if Hq % Hkv:
        raise ValueError(f"q has {Hq} heads, not a multiple of the {Hkv} KV heads of k_blk")
    _contiguous(q=q, k_blk=k_blk, v_blk=v_blk)
    window = _window(mask, window)
    return B, Qb, Hq, Hkv, D, window, _scale(scale, D)


def _check_paged_cache(ref_name, ref, B, Hkv, D, k_pages, v_pages, block_table, ctx_lens):
    """Layout checks of a paged cache; returns (page_size, capacity)."""
    _tensors(k_pages=(k_pages, 4), v_pages=(v_pages, 4), block_table=(block_table, 2), ctx_lens=(ctx_lens, 1))
    _same_device(ref_name, ref, k_pages=k_pages, v_pages=v_pages, block_table=block_table, ctx_lens=ctx_lens)
    _float_dtype(ref_name, ref, k_pages=k_pages, v_pages=v_pages)
    _int32(block_table=block_table, ctx_lens=ctx_lens)
    num_pages, _, page_size, _ = k_pages.shape
    _shape("k_pages", k_pages, num_pages=num_pages, Hkv=Hkv, page_size=page_size, D=D)
    _shape("v_pages", v_pages, num_pages=num_pages, Hkv=Hkv, page_size=page_size, D=D)
    if not is_power_of_two(page_size):
        raise ValueError(f"k_pages has page_size={page_size} (dim 2); it must be a power of two")
    max_pages = block_table.shape[1]
    _shape("block_table", block_table, B=B, max_pages=max_pages)
    _shape("ctx_lens", ctx_lens, B=B)
    if max_pages and not num_pages:
        raise ValueError("k_pages has no pages but block_table has columns")
    _contiguous(block_table=block_table, ctx_lens=ctx_lens)
    _pool_views("k_pages", k_pages, "v_pages", v_pages)
    return page_size, _capacity("block_table", max_pages * page_size)


def _check_arena_cache(ref_name, ref, B, Hkv, D, k_arena, v_arena, slots, ctx_lens):
    """Layout checks of an arena cache; returns its capacity (max_ctx)."""
    _tensors(k_arena=(k_arena, 4), v_arena=(v_arena, 4), slots=(slots, 1), ctx_lens=(ctx_lens, 1))
    _same_device(ref_name, ref, k_arena=k_arena, v_arena=v_arena, slots=slots, ctx_lens=ctx_lens)
    _float_dtype(ref_name, ref, k_arena=k_arena, v_arena=v_arena)
    _int32(slots=slots, ctx_lens=ctx_lens)
    num_slots, max_ctx = k_arena.shape[:2]
    _shape("k_arena", k_arena, num_slots=num_slots, max_ctx=max_ctx, Hkv=Hkv, D=D)
    _shape("v_arena", v_arena, num_slots=num_slots, max_ctx=max_ctx, Hkv=Hkv, D=D)
    _shape("slots", slots, B=B)
    _shape("ctx_lens", ctx_lens, B=B)
    if B and not num_slots:
        raise ValueError("k_arena has no slots")
    _contiguous(slots=slots, ctx_lens=ctx_lens)
    _pool_views("k_arena", k_arena, "v_arena", v_arena)
    return _capacity("k_arena", max_ctx)


# Tokens a request's cache may address. The kernels hold positions in C ints, and a position
# plus a tile (at most 128 keys) or the block stays one: `(P + N - 1) / N` near 2**31 wrapped
# negative, and the call ran no tile at all (zeros out, no error). A multiple of every page size.
MAX_CAPACITY = 2**31 - 256


def _capacity(arg: str, tokens: int) -> int:
    if tokens > MAX_CAPACITY:
        raise ValueError(f"{arg} addresses {tokens} tokens a request, over {MAX_CAPACITY} (the kernels "
                         f"hold positions, plus a tile of keys, in a C int: a larger capacity would wrap)")
    return tokens


# ---------------------------------------------------------------------------------------------
# The four entry points.


def check_paged(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, mask="full", window=None, scale=None,
                max_ctx=None) -> Dims:
    """Validate the arguments of `paged_attention` and resolve their sizes.

    Takes exactly the arguments of `kernels.reference.paged_attention` (shapes there): q
    [B, Qb, Hq, D], k_blk/v_blk [B, Qb, Hkv, D], k_pages/v_pages [num_pages, Hkv, page_size, D]
    (bfloat16, float16 or float32, one dtype, contiguous, one device), block_table int32
    [B, max_pages], ctx_lens int32 [B], mask, window, scale, and the optional `max_ctx` hint (a
    positive int at most max_pages * page_size; see `plan_ctx`). Value checks (ctx_lens within
    max_pages * page_size and within max_ctx, used page ids in [0, num_pages)) run only for CPU
    tensors.

    Returns:
        Dims with page_size set and capacity = max_pages * page_size; window None for "full";
        scale resolved (D ** -0.5 when None); max_ctx as given.

    Raises:
        ValueError whose message names the offending argument.

    Example:
        >>> dims = check_paged(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens)
        >>> dims.group, dims.capacity  # Hq // Hkv, tokens the table can address
        (4, 320)
    """
    B, Qb, Hq, Hkv, D, window, scale = _check_block(q, k_blk, v_blk, mask, window, scale)
    ps, cap = _check_paged_cache("q", q, B, Hkv, D, k_pages, v_pages, block_table, ctx_lens)
    plan_ctx(max_ctx, cap, "block_table")
    if _check_values(q):
        _check_lengths(ctx_lens, cap, "block_table")
        if max_ctx is not None:
            _check_hint(ctx_lens, int(max_ctx))
        _check_pages_in_range(block_table, ctx_lens, ps, k_pages.shape[0])
    hint = None if max_ctx is None else int(max_ctx)
    return Dims(B, Qb, Hq, Hkv, D, Hq // Hkv, ps, cap, mask, window, scale, q.dtype, hint)


def check_arena(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, mask="full", window=None, scale=None,
                max_ctx=None) -> Dims:
    """Validate the arguments of `arena_attention` and resolve their sizes.

    As `check_paged`, with k_arena/v_arena [num_slots, max_ctx, Hkv, D] and slots int32 [B]
    instead of pages and block table; the `max_ctx` hint is at most the arena's dimension 1.
    Value checks (ctx_lens within the arena and the hint, slots in [0, num_slots)) run only for
    CPU tensors.

    Returns:
        Dims with page_size None and capacity = max_ctx.

    Example:
        >>> check_arena(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens,
        ...             mask="sliding", window=2048).window
        2048
    """
    B, Qb, Hq, Hkv, D, window, scale = _check_block(q, k_blk, v_blk, mask, window, scale)
    cap = _check_arena_cache("q", q, B, Hkv, D, k_arena, v_arena, slots, ctx_lens)
    plan_ctx(max_ctx, cap, "k_arena")
    if _check_values(q):
        _check_lengths(ctx_lens, cap, "k_arena")
        if max_ctx is not None:
            _check_hint(ctx_lens, int(max_ctx))
        _check_slots_in_range(slots, k_arena.shape[0])
    hint = None if max_ctx is None else int(max_ctx)
    return Dims(B, Qb, Hq, Hkv, D, Hq // Hkv, None, cap, mask, window, scale, q.dtype, hint)


def _check_new_rows(k_new, v_new, num_new):
    _tensors(k_new=(k_new, 4), v_new=(v_new, 4), num_new=(num_new, 1))
    _same_device("k_new", k_new, v_new=v_new, num_new=num_new)
    _float_dtype("k_new", k_new, v_new=v_new)
    _int32(num_new=num_new)
    B, T, Hkv, D = k_new.shape
    _positive_sizes("k_new", k_new, num_kv_heads=Hkv, head_dim=D)
    _shape("v_new", v_new, B=B, T=T, Hkv=Hkv, D=D)
    _shape("num_new", num_new, B=B)
    _contiguous(k_new=k_new, v_new=v_new, num_new=num_new)
    if _check_values(num_new) and ((num_new < 0) | (num_new > T)).any():
        b = int(torch.nonzero((num_new < 0) | (num_new > T))[0])
        raise ValueError(f"num_new[{b}]={int(num_new[b])} is outside [0, T={T}]")
    return B, T, Hkv, D


def check_store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> StoreDims:
    """Validate the arguments of `store_paged` and resolve their sizes.

    k_new/v_new [B, T, Hkv, D] (float dtype, matching the pages), num_new int32 [B], then the
    paged cache as for `check_paged`. Value checks (num_new in [0, T], ctx_lens + num_new within
    the table's capacity, the page ids those rows land on in range) run only for CPU tensors.

    Returns:
        StoreDims with rows = T and capacity = max_pages * page_size.

    Example:
        >>> check_store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens).rows
        16
    """
    B, T, Hkv, D = _check_new_rows(k_new, v_new, num_new)
    ps, cap = _check_paged_cache("k_new", k_new, B, Hkv, D, k_pages, v_pages, block_table, ctx_lens)
    if _check_values(k_new):
        _check_lengths(ctx_lens, cap, "block_table", num_new, "num_new")
        _check_pages_in_range(block_table, ctx_lens.long() + num_new.long(), ps, k_pages.shape[0])
        _check_distinct_rows(block_table, ctx_lens, num_new, ps)
    return StoreDims(B, T, Hkv, D, ps, cap, k_new.dtype)


def check_store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> StoreDims:
    """Validate the arguments of `store_arena` and resolve their sizes.

    k_new/v_new [B, T, Hkv, D], num_new int32 [B], then the arena as for `check_arena`. Value
    checks (as `check_store_paged`, plus distinct slots: two requests writing one slot would
    race) run only for CPU tensors.

    Returns:
        StoreDims with page_size None and capacity = max_ctx.

    Example:
        >>> check_store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens).capacity
        512
    """
    B, T, Hkv, D = _check_new_rows(k_new, v_new, num_new)
    cap = _check_arena_cache("k_new", k_new, B, Hkv, D, k_arena, v_arena, slots, ctx_lens)
    if _check_values(k_new):
        _check_lengths(ctx_lens, cap, "k_arena", num_new, "num_new")
        _check_slots_in_range(slots, k_arena.shape[0])
        # Two requests writing one slot would race; reading one slot twice (attention) is fine,
        # and so are requests that write nothing (num_new 0: a padded batch's dummy slot).
        writing = slots[num_new > 0]
        if torch.unique(writing).numel() != writing.numel():
            raise ValueError(f"slots must be distinct among the requests a store writes (num_new > 0), "
                             f"got slots {slots.tolist()} with num_new {num_new.tolist()}")
    return StoreDims(B, T, Hkv, D, None, cap, k_new.dtype)
