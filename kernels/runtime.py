"""The serving entry point: the four contract functions, each running the tuned kernel.

`Runtime` computes the problem from tensor shapes only (the context length bucket comes from the
cache capacity: block-table columns x page size, or the arena's max_ctx; or from the caller's
`max_ctx` hint, a host int, when given: contract.plan_ctx), picks once per shape
through a `Dispatcher` (kernels.dispatcher) and calls the picked backend. Nothing a table or a
database holds can make it raise: an unusable file warns once and the default heuristic answers.
"""

from __future__ import annotations

import logging
import math
import threading
import warnings
from dataclasses import dataclass

import torch

from drafter_attn.kernels import ops
from drafter_attn.kernels.contract import hint_kwargs, plan_ctx
from drafter_attn.kernels.cupy_backend import FULL_CHECKS, attention_key
from drafter_attn.kernels.dispatcher import CURRENT, Dispatcher, Pick, fmt_params, reference_pick
from drafter_attn.kernels.guards import RecentPlans
from drafter_attn.kernels.shipped import find_default
from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.kernels.tuned_table import TableError, check_regime, default_regime

log = logging.getLogger("drafter_attn.kernels.runtime")


@dataclass
class _Bound:
    backend: object
    pick: Pick


def _empty_batch() -> _Bound:
    """What runs a call of no requests (B=0: an engine between batches): the torch reference,
    which returns the empty output or stores nothing, launching nothing a kernel would fault on."""
    from drafter_attn.kernels import registry

    return _Bound(registry.get("reference"),
                  reference_pick("an empty batch (B=0): the torch reference returns its empty result"))


class Runtime:
    """The four contract functions, each running the tuned kernel for its shapes.

        rt = Runtime()        # the shipped table of this GPU's SM; or a path, or a Dispatcher
        out = rt.paged_attention(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens,
                                 mask="full")

    `table`: a tuned table / profile database path, a Dispatcher, or None: $DRAFTER_TUNED_TABLE,
    else $DRAFTER_DB, else the table (else the database) shipped for the GPU's SM
    (kernels.shipped.find_default), else the default heuristic. An unusable table warns once and
    falls back to the default heuristic; entries measured on another GPU, other kernel sources
    or other library versions are misses (one warning). `sm`: the GPU's SM (default: read from
    the tensors' CUDA device once; CPU tensors without `sm` run the reference; tensors on a
    device the picked backend does not run on run the reference, with a warning). `geometry`: the drafter geometry, when known, lets
    the context stores use the tuned pick from the first step; otherwise a store uses the
    backend of the last attention picked for the same cache (the default heuristic before one).

    Per call: a key from tensor shapes, dtypes and the device (and the planned context of a
    `max_ctx` hint; no device reads), a dict lookup, then the backend's own function (which
    validates its inputs). Once the picked backend (cupy, cutlass) has planned a call key, later
    attention calls of that key run its plan in one lookup of the backend's own key, and a
    call of the same form (layout, mask, window, scale, max_ctx) whose tensors match the last
    one's metadata runs it after one C++ check of them (kernels.guards).
    """

    def __init__(self, table=None, *, sm: int | None = None, include_predicted: bool = False,
                 geometry: Geometry | None = None, regime: str | None = None):
        """Load the tuned picks once; no kernel is built until a shape is first called.

        Args:
            table: where the picks come from: a path (str or Path) to a tuned table (JSON) or a
                profile database; a `Dispatcher`; or None: $DRAFTER_TUNED_TABLE, else
                $DRAFTER_DB, else the table (else the database) shipped for the GPU's SM, else
                the default heuristic. A table that cannot be used warns once (RuntimeWarning)
                and the default heuristic answers; the error stays in `self.table_error`.
                Entries measured on another GPU or with other kernel sources are misses (one
                warning for them all).
            sm: the GPU's SM, e.g. 90 (default: read once per CUDA device from the tensors'
                device; CPU tensors without `sm` run the torch reference).
            include_predicted: also use a table's predicted (not measured) entries.
            geometry: the drafter's `Geometry`, when known: the context stores then use a tuned
                pick from the first step instead of following the last attention's backend.
            regime: the GPU's clock regime the picks are for (kernels.tuned_table.REGIMES):
                "burst" (the default), or "sustained" for a deployment that keeps the GPU at its
                power limit (the H200 then lowers its SM clock, and the picks of its heaviest
                calls differ); None: $DRAFTER_REGIME, else burst. It chooses the shipped table
                (`sm<SM>-sustained.json` where one is shipped) and which rows of a profile
                database decide; a tuned table given by path is read as exported.

        Example (CPU tensors: the torch reference runs them):
            >>> rt = Runtime(Dispatcher())  # the default heuristic, no table
            >>> rt.table_error is None
            True
        """
        self.sm = sm
        self.geometry = geometry
        self.regime = default_regime() if regime is None else check_regime(regime)
        self.table_error: Exception | None = None
        if table is None:
            table = find_default(sm, regime=self.regime)
        if isinstance(table, Dispatcher):
            self.dispatcher = table
        elif table is None:
            self.dispatcher = Dispatcher()
        else:
            self.dispatcher = self._load(table, include_predicted)
        self._bound: dict[tuple, _Bound] = {}
        self._plans: dict[tuple, object] = {}  # attention call key -> the picked backend's plan
        self._recent = RecentPlans()  # each call form's last plan (kernels.guards)
        self._cache_impl: dict[tuple, _Bound] = {}  # cache key -> last attention binding
        self._sm_of: dict[tuple, int | None] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        # Under torch.compile the four functions go through the custom ops (opaque to the
        # compiler), which run this Runtime eagerly inside; `op_backend` names it there.
        self.op_backend = ops.register_runtime(self)

    def _load(self, table, include_predicted: bool) -> Dispatcher:
        try:
            return Dispatcher.load(table, include_predicted=include_predicted, env=CURRENT, regime=self.regime)
        except Exception as exc:  # whatever a file holds, serving goes on with the heuristic
            self.table_error = exc if isinstance(exc, TableError) else TableError(
                f"{table}: {type(exc).__name__}: {exc}")
            msg = f"tuned table unusable, using the default heuristic: {self.table_error}"
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return Dispatcher(source=f"default heuristic ({table} unusable)")

    # -- introspection ---------------------------------------------------------------------
    @property
    def picks(self) -> dict[tuple, Pick]:
        """Every pick made so far, by call key: {key: Pick}, one per attention or store shape.

        A key holds the layout, device, dtype and shapes (the cache's capacity, never its
        contents); a `Pick` says the implementation (`impl`), its `params`, the `tier` that
        chose it (tuned table, database or default) and why (`reason`).

        Example:
            >>> rt = Runtime(Dispatcher())
            >>> _ = rt.arena_attention(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens)
            >>> [pick.impl for pick in rt.picks.values()]
            ['reference']
        """
        return {k: b.pick for k, b in self._bound.items()}

    # -- the contract ----------------------------------------------------------------------
    def paged_attention(self, q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *,
                        mask="full", window=None, scale=None, max_ctx=None):
        """Block attention over a paged context, run by the pick for these shapes.

        Arguments and result as `kernels.reference.paged_attention`: q [B, Qb, Hq, D]; k_blk,
        v_blk [B, Qb, Hkv, D]; k_pages, v_pages [num_pages, Hkv, page_size, D] (one dtype:
        bfloat16, float16 or float32); block_table int32 [B, max_pages]; ctx_lens int32 [B];
        mask "full", "sliding" or "sliding_causal" with `window`; scale (None: D ** -0.5);
        max_ctx: optional host int bounding ctx_lens (at most max_pages * page_size).
        Returns [B, Qb, Hq, D] in q's dtype.

        The pick is made on the first call of a shape key (shapes, dtypes and device only; the
        context bucket is the cache capacity max_pages * page_size, or the `max_ctx` hint when
        given: an engine's table sized for the model's longest context then costs nothing),
        then reused; the host is never synced. Bad arguments raise ValueError naming the
        argument (kernels.contract) before any kernel runs.

        Example:
            >>> rt = Runtime(Dispatcher())
            >>> rt.paged_attention(q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens,
            ...                    mask="sliding", window=64).shape
            torch.Size([2, 16, 32, 128])
        """
        return self._attend("paged", (q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens), mask, window,
                            scale, max_ctx)

    def arena_attention(self, q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *,
                        mask="full", window=None, scale=None, max_ctx=None):
        """Block attention over an arena context, run by the pick for these shapes.

        As `paged_attention`, with k_arena, v_arena [num_slots, max_ctx, Hkv, D] and slots
        int32 [B] (each request's row of the arena) instead of pages and block table; the
        context bucket is the arena's max_ctx dimension, or the `max_ctx` hint (at most that
        dimension) when given. Returns [B, Qb, Hq, D] in q's dtype.

        Example:
            >>> rt = Runtime(Dispatcher())
            >>> rt.arena_attention(q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens).dtype
            torch.bfloat16
        """
        return self._attend("arena", (q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens), mask, window,
                            scale, max_ctx)

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> None:
        """Context store into pages, in place: rows j < num_new[b] go to positions
        ctx_lens[b] + j, then ctx_lens += num_new (on the device; the host reads no count).

        Args as `kernels.reference.store_paged`: k_new, v_new [B, T, Hkv, D]; num_new int32
        [B] in [0, T]; k_pages, v_pages [num_pages, Hkv, page_size, D], same dtype; block_table
        int32 [B, max_pages] covering ctx_lens + num_new; ctx_lens int32 [B]. The backend is
        the tuned pick for the store when the Runtime has a `geometry`, else the one of the last
        attention picked for this cache (before any: the pick for the cache's own shapes).

        Example:
            >>> rt = Runtime(Dispatcher())
            >>> lens = ctx_lens.clone()  # the example's own lengths
            >>> rt.store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, lens)
            >>> (lens - ctx_lens).tolist()
            [3, 16]
        """
        if torch.compiler.is_compiling():
            return ops.store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens,
                                   backend=self.op_backend)
        b = self._store_binding("paged", k_new, k_pages, block_table,
                                (k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens))
        b.backend.store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens)

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> None:
        """Context store into the arena, in place: as `store_paged`, with k_arena, v_arena
        [num_slots, max_ctx, Hkv, D] and slots int32 [B] instead of pages and block table.

        Example:
            >>> Runtime(Dispatcher()).store_arena(k_new, v_new, num_new, k_arena, v_arena, slots,
            ...                                   ctx_lens.clone())  # rows 300..315 of request 1
            >>> torch.equal(k_arena[slots[1], 300:316], k_new[1])
            True
        """
        if torch.compiler.is_compiling():
            return ops.store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens,
                                   backend=self.op_backend)
        b = self._store_binding("arena", k_new, k_arena, slots,
                                (k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens))
        b.backend.store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens)

    # -- internals -------------------------------------------------------------------------
    def _attend(self, layout, args, mask, window, scale, max_ctx):
        """`{layout}_attention` of the pick for these shapes; while torch.compile traces, the
        custom op of the same name running this Runtime (`op_backend`) inside."""
        fn = f"{layout}_attention"
        if torch.compiler.is_compiling():
            return getattr(ops, fn)(*args, mask=mask, window=window, scale=scale,
                                    backend=self.op_backend, max_ctx=max_ctx)
        # The picked backend's plan of the last call of this form, if this call's tensors
        # match that call's (kernels.guards: one C++ check of their metadata).
        form = (layout, mask, window, scale, max_ctx)
        try:
            plan = None if FULL_CHECKS else self._recent.get(form, args)
        except TypeError:  # an unhashable argument: the binding's path names it
            plan = None
        if plan is not None:
            return plan.run(*args, None)
        # A call key the picked backend has planned: its plan, in one lookup. The key is the
        # backend's own (kernels.cupy_backend.attention_key: with checks on, every property its
        # validation reads), and it holds all the pick depends on, so a hit is the call the
        # binding below would make.
        try:
            key = attention_key(layout, (*args, None), (mask, window, scale), max_ctx)
            plan = None if FULL_CHECKS else self._plans.get(key)
        except Exception:  # a bad argument: the binding's path names it
            key = plan = None
        if plan is not None:
            self._recent.put(form, args, plan)
            return plan.run(*args, None)
        b = self._attention_binding(layout, args, mask, window, scale, max_ctx)
        out = getattr(b.backend, fn)(*args, mask=mask, window=window, scale=scale,
                                     **hint_kwargs(max_ctx))
        planned = getattr(b.backend, "planned", None)
        if key is not None and planned is not None:
            plan = planned(key)
            if plan is not None:
                self._plans[key] = plan
                self._recent.put(form, args, plan)
        return out

    def _device_sm(self, device) -> int | None:
        if self.sm is not None:
            return self.sm
        if device.type != "cuda":
            return None
        index = device.index
        k = (device.type, index)
        if k not in self._sm_of:
            import torch

            major, minor = torch.cuda.get_device_capability(index if index is not None
                                                            else torch.cuda.current_device())
            self._sm_of[k] = major * 10 + minor
        return self._sm_of[k]

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning(text)
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def _bind(self, pick: Pick) -> _Bound:
        from drafter_attn.kernels import registry

        try:
            return _Bound(registry.bind(registry.get(pick.impl), dict(pick.params)), pick)
        except Exception as exc:
            self._warn_once(f"drafter_attn.kernels.runtime: cannot build {pick.impl}{fmt_params(pick.params)} "
                            f"({type(exc).__name__}: {exc}); using the torch reference")
            ref = reference_pick(f"{pick.impl} could not be built ({exc}); the torch reference runs it",
                                 pick.source)
            return _Bound(registry.get("reference"), ref)

    def _bind_on(self, pick: Pick, device) -> _Bound:
        """The bound pick, if its backend runs on `device`'s tensors; else the reference."""
        from drafter_attn.kernels import registry

        b = self._bind(pick)
        runs_on = getattr(b.backend, "device_types", ("cuda",))
        if device.type in runs_on:
            return b
        why = f"{pick.impl} runs on {'/'.join(runs_on)} tensors, these are on {device.type}"
        if pick.tier != "default":
            self._warn_once(f"drafter_attn.kernels.runtime: the tuned pick {pick.impl}"
                            f"{fmt_params(pick.params)} ({pick.tier}) is not used: {why}; the torch "
                            f"reference runs them")
        return _Bound(registry.get("reference"),
                      reference_pick(f"{pick.reason}; but {why}: the torch reference runs them", pick.source))

    def _choose(self, problem: Problem, device) -> Pick:
        sm = self._device_sm(device)
        if sm is None and device.type != "cuda":
            return reference_pick(f"default: tensors on {device.type} and no SM given; the torch "
                                  f"reference runs them")
        return self.dispatcher.pick(problem, sm)

    def _attention_binding(self, layout, args, mask, window, scale, max_ctx=None) -> _Bound:
        """The bound pick for these shapes: a dict lookup after the first call. The key holds
        shapes only (the cache's capacity, never its contents) and the context a `max_ctx` hint
        plans for (checked on every call: contract.plan_ctx); bad arguments get no key and reach
        the backend's own checks."""
        q, k_blk, _, k_cache, _, table, _ = args
        try:
            capacity = (k_cache.shape[2], table.shape[1]) if layout == "paged" else (k_cache.shape[1],)
            hint = None if max_ctx is None else plan_ctx(max_ctx, math.prod(capacity))
            key = (layout, q.device, q.dtype, q.shape, k_blk.shape[2], *capacity, mask, window, hint)
            b = self._bound.get(key)  # mask=['full'] (unhashable): no key, as a bad argument
        except Exception:  # the contract check below names the argument
            key = b = None
        return b if b is not None else self._bind_attention(key, layout, args, mask, window, scale,
                                                            max_ctx)

    def _bind_attention(self, key, layout, args, mask, window, scale, max_ctx=None) -> _Bound:
        from drafter_attn.kernels import contract

        check = contract.check_paged if layout == "paged" else contract.check_arena
        dims = check(*args, mask, window, scale, max_ctx)  # a bad input: ValueError naming it
        q = args[0]
        if dims.batch == 0:  # nothing to pick for, nor what this cache's stores should follow
            return self._remember(key, _empty_batch())
        problem = Problem.from_dims(dims, dims.plan_ctx)  # the capacity, or the hint's plan
        b = self._remember(key, self._bind_on(self._choose(problem, q.device), q.device))
        with self._lock:
            self._cache_impl[(layout, q.device, q.dtype, dims.num_kv_heads, dims.head_dim,
                              dims.page_size)] = b
        return b

    def _remember(self, key, b: _Bound) -> _Bound:
        """`b` as the binding of `key` (None: a call without a key, bound every time)."""
        if key is not None:
            with self._lock:
                self._bound[key] = b
        return b

    def _store_binding(self, layout, k_new, cache, table, args) -> _Bound:
        try:
            page = cache.shape[2] if layout == "paged" else None
            ckey = (layout, k_new.device, k_new.dtype, k_new.shape[2], k_new.shape[3], page)
            key = ("store", *ckey, k_new.shape[0],
                   table.shape[1] * page if layout == "paged" else cache.shape[1])
        except Exception:
            ckey = key = None
        if key is not None and self.geometry is None:
            b = self._cache_impl.get(ckey)  # follow the attention picked for this cache
            if b is not None:
                return b
        b = self._bound.get(key) if key is not None else None
        if b is not None:
            return b
        from drafter_attn.kernels import contract

        check = contract.check_store_paged if layout == "paged" else contract.check_store_arena
        dims = check(*args)
        if dims.batch == 0:
            return self._remember(key, _empty_batch())
        g = self.geometry
        if g is not None and (g.num_kv_heads, g.head_dim) == (dims.num_kv_heads, dims.head_dim):
            g = g.with_(num_layers=1, dtype=str(dims.dtype).removeprefix("torch."))
        else:  # the cache's own geometry: one query head per KV head, one-row blocks
            g = Geometry(dims.num_kv_heads, dims.num_kv_heads, dims.head_dim, 1,
                         dtype=str(dims.dtype).removeprefix("torch."))
        problem = Problem(g, layout, dims.page_size, dims.batch, dims.capacity)
        return self._remember(key, self._bind_on(self._choose(problem, k_new.device), k_new.device))
