"""Problem description: drafter attention geometry, mask modes and one benchmark problem.

Everything here is plain data validated on construction, so a bad geometry fails where it is
written rather than deep inside a kernel launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

MASKS = ("full", "sliding", "sliding_causal")
# Kernel dtypes. float32 is accepted for the reference only (tests compare against it).
DTYPES = ("bfloat16", "float16")
REFERENCE_DTYPES = DTYPES + ("float32",)
LAYOUTS = ("paged", "arena")


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def check_positive_int(name: str, value) -> None:
    # bool is an int subclass; True as a head count is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


MAX_WINDOW = 2**31 - 1


def resolve_window(mask: str, window) -> int | None:
    """Validate a mask mode and its window; the window of `full` is ignored (returns None)."""
    if mask not in MASKS:
        raise ValueError(f"mask={mask!r} is unknown; known masks: {', '.join(MASKS)}")
    if mask == "full":
        return None
    if window is None:
        raise ValueError(f"window is required for mask={mask!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"window must be positive, got window={window!r}")
    if window > MAX_WINDOW:  # a C int in every kernel's parameters: a larger one would wrap
        raise ValueError(f"window={window} is over {MAX_WINDOW}, the largest the kernels take "
                         f"(a C int); any window of at least the longest context plus the block "
                         f"attends the same keys")
    return window


@dataclass(frozen=True)
class Geometry:
    """Attention geometry of one drafter layer stack (docs/design.md, "The problem").

    `window` given with mask="full" is accepted and normalised to None, so two geometries that
    attend identically compare (and hash, and key a database) equal.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask: str = "full"
    window: int | None = None
    num_layers: int = 1
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "num_layers"):
            check_positive_int(name, getattr(self, name))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        object.__setattr__(self, "window", resolve_window(self.mask, self.window))
        if self.dtype not in REFERENCE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is unknown; known dtypes: {', '.join(REFERENCE_DTYPES)}")

    @property
    def group(self) -> int:
        """GQA group: query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def with_(self, **changes) -> Geometry:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Problem:
    """One measured configuration: a geometry on a cache layout at a batch and context length.

    `page_size` is required for layout="paged" (a power of two; 8..256 is the documented range,
    but any power of two is accepted so models can extrapolate) and must be None for "arena".
    """

    geometry: Geometry
    layout: str
    page_size: int | None
    batch: int
    ctx_len: int

    def __post_init__(self):
        if not isinstance(self.geometry, Geometry):
            raise ValueError(f"geometry must be a Geometry, got {type(self.geometry).__name__}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is unknown; known layouts: {', '.join(LAYOUTS)}")
        if self.layout == "paged":
            if self.page_size is None:
                raise ValueError("page_size is required for layout='paged'")
            if not is_power_of_two(self.page_size) or isinstance(self.page_size, bool):
                raise ValueError(f"page_size must be a power of two, got page_size={self.page_size!r}")
        elif self.page_size is not None:
            raise ValueError(f"page_size must be None for layout='arena', got page_size={self.page_size!r}")
        check_positive_int("batch", self.batch)
        if not isinstance(self.ctx_len, int) or isinstance(self.ctx_len, bool) or self.ctx_len < 0:
            raise ValueError(f"ctx_len must be a non-negative integer, got {self.ctx_len!r}")

    @classmethod
    def from_dims(cls, dims, ctx_len: int) -> Problem:
        """The one-layer problem of a validated attention call (`kernels.contract.Dims`, as
        `check_paged` / `check_arena` return it) at context length `ctx_len`; the layout is paged
        when the call has a page size."""
        geometry = Geometry(dims.num_q_heads, dims.num_kv_heads, dims.head_dim, dims.block_size,
                            dims.mask, dims.window, 1, str(dims.dtype).removeprefix("torch."))
        layout = "arena" if dims.page_size is None else "paged"
        return cls(geometry, layout, dims.page_size, dims.batch, ctx_len)

    def key(self) -> dict:
        """All fields as one flat dict (geometry fields inlined), e.g. for database rows."""
        flat = dataclasses.asdict(self.geometry)
        flat.update(layout=self.layout, page_size=self.page_size, batch=self.batch, ctx_len=self.ctx_len)
        return flat
