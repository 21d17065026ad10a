"""`reference-syncing`: the suite's own attention with a store that stalls the host, kept as a
reference to measure against, never as a candidate.

TensorRT-LLM's paged context store reads the per-request block counts back to the host
(`_ctx_block_counts[:num_contexts].tolist()`) before it writes, which blocks the host until the
device has finished everything queued before it, once per layer. Its users found the stall by
hand in Nsight Systems. This backend makes the same mistake on purpose so that the suite can
show what such a stall looks like and prove that every sync detector layer catches it
(`tuner.syncs`, `bench decode --syncs all --impl reference-syncing`):

- its attention is the wrapped backend's (the cupy kernels in the registry entry), unchanged;
- its stores first compute each request's block count after the store on the device
  (`ceil((ctx_lens + num_new) / page_size)`; for the arena, the rows held), read it back with
  `.tolist()` (one device-to-host copy and one blocking stream synchronise per call), check it
  against the block table on the host, then run the wrapped backend's store.

So a decode step of L layers syncs the host L times. The step cannot be captured into a CUDA
graph (the read-back is not allowed during capture): the tuner times it eagerly. The registry
marks it `reference_only`: tuned tables, `tuner export` and the dispatcher never pick it.
"""

from __future__ import annotations

NAME = "reference-syncing"
# How it stalls, for notes and reasons.
STALL = ("its store reads the per-request block counts back with .tolist() before writing "
         "(one blocking host sync per store call)")


class SyncingStoreBackend:
    """The wrapped backend's attention; stores that first read the block counts to the host.

    Example (on CPU tensors the read-back costs nothing, but it happens all the same):
        >>> import torch
        >>> from drafter_attn.kernels import registry
        >>> from drafter_attn.kernels.cache import random_paged_context
        >>> from drafter_attn.kernels.spec import Geometry
        >>> g = Geometry(4, 2, 16, 4, num_layers=1, dtype="float32")
        >>> gen = torch.Generator().manual_seed(0)
        >>> k, v, table, lens = random_paged_context(g, [5, 9], 8, "cpu", gen, extra_pages=1)
        >>> new = torch.randn(2, 4, 2, 16, generator=gen)
        >>> b = SyncingStoreBackend(registry.get("reference"))
        >>> b.store_paged(new, new.clone(), torch.tensor([4, 2], dtype=torch.int32), k, v, table, lens)
        >>> b.last_block_counts, lens.tolist()
        ([2, 2], [9, 11])
    """

    stalls_host = STALL  # read by tuner.measure: time eagerly, expect the graph capture to fail

    def __init__(self, inner):
        self.inner = inner
        self.name = NAME if inner.name == "cupy" else f"{NAME}({inner.name})"
        self.device_types = getattr(inner, "device_types", ("cuda",))
        self.paged_attention = inner.paged_attention
        self.arena_attention = inner.arena_attention
        self.last_block_counts: list[int] | None = None

    def supports(self, problem) -> str | None:
        return self.inner.supports(problem)

    def tunables(self, problem=None) -> dict[str, list]:
        return {}  # a reference: nothing to sweep

    def default_params(self, problem=None) -> dict:
        return {}

    def with_params(self, **params):
        if params:
            raise ValueError(f"backend {self.name!r} has no tunable parameters (a reference), got {sorted(params)}")
        return self

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> None:
        page = k_pages.shape[2]
        counts = ((ctx_lens + num_new + (page - 1)) // page).tolist()  # the host waits for the device here
        if counts and max(counts) > block_table.shape[1]:
            raise ValueError(f"store_paged: a request needs {max(counts)} blocks after the store, but the "
                             f"block table holds {block_table.shape[1]}")
        self.last_block_counts = counts
        self.inner.store_paged(k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens)

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> None:
        rows = (ctx_lens + num_new).tolist()  # the host waits for the device here
        if rows and max(rows) > k_arena.shape[1]:
            raise ValueError(f"store_arena: a request holds {max(rows)} rows after the store, but an "
                             f"arena slot holds {k_arena.shape[1]}")
        self.last_block_counts = rows
        self.inner.store_arena(k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens)


def make_backend() -> SyncingStoreBackend:
    """The registry's `reference-syncing`: the cupy kernels with the syncing store."""
    from drafter_attn.kernels import registry

    return SyncingStoreBackend(registry.get("cupy"))
