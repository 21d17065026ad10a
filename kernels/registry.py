"""Registry of backends: every implementation of the four contract functions, by name.

Tests, the tuner and the bench reach each implementation through `get(name)`, so they can swap one
for another. Backends are built lazily on first `get`: a factory may be an import path
"module:attr", so `names()` works on machines where a backend's dependencies (CuPy, CUTLASS) are
not installed, and only asking for that backend reports what is missing.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable, Protocol, runtime_checkable

from drafter_attn.kernels import reference
from drafter_attn.kernels.spec import Problem


@runtime_checkable
class Backend(Protocol):
    """What every backend offers. The four functions keep the signatures of `kernels.reference`."""

    name: str

    def paged_attention(self, q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *,
                        mask="full", window=None, scale=None): ...

    def arena_attention(self, q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *,
                        mask="full", window=None, scale=None): ...

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> None: ...

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> None: ...

    def supports(self, problem: Problem) -> str | None:
        """None when the backend can run `problem`, else the reason it cannot."""

    def tunables(self, problem: Problem) -> dict[str, list]:
        """The tunable parameter space for `problem`: parameter name -> candidate values."""

    def default_params(self, problem: Problem) -> dict:
        """Parameters to use for `problem` when no tuned value is known."""

    def with_params(self, **params) -> Backend:
        """This backend bound to the given parameters."""


class ReferenceBackend:
    """The torch reference: runs every problem, has nothing to tune."""

    name = "reference"
    paged_attention = staticmethod(reference.paged_attention)
    arena_attention = staticmethod(reference.arena_attention)
    store_paged = staticmethod(reference.store_paged)
    store_arena = staticmethod(reference.store_arena)

    def supports(self, problem: Problem) -> str | None:
        return None

    def tunables(self, problem: Problem) -> dict[str, list]:
        return {}

    def default_params(self, problem: Problem) -> dict:
        return {}

    def with_params(self, **params) -> Backend:
        if params:
            raise ValueError(f"backend 'reference' has no tunable parameters, got {sorted(params)}")
        return self


class BackendUnavailable(RuntimeError):
    """A registered backend could not be built on this machine (e.g. CuPy is not installed)."""


_FACTORIES: dict[str, Callable[[], Backend] | str] = {}
_EXTRAS: dict[str, str] = {}  # name -> install hint for its optional dependencies
_BUILT: dict[str, Backend] = {}


def register(name: str, factory: Callable[[], Backend] | str, *, extra: str | None = None,
             replace: bool = False) -> None:
    """Register a backend. `factory` is a zero-argument callable returning the backend, or an
    import path "module:attr" naming a backend object (or a zero-argument factory), resolved on
    first `get`. `extra` says what to install when importing it fails."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if isinstance(factory, str):
        if factory.count(":") != 1 or not all(factory.split(":")):
            raise ValueError(f"factory={factory!r} must be an import path of the form 'module:attr'")
    elif not callable(factory):
        raise ValueError(f"factory must be a callable or a 'module:attr' string, got {type(factory).__name__}")
    if name in _FACTORIES and not replace:
        raise ValueError(f"backend {name!r} is already registered (pass replace=True to replace it)")
    _FACTORIES[name] = factory
    _BUILT.pop(name, None)
    if extra is None:
        _EXTRAS.pop(name, None)
    else:
        _EXTRAS[name] = extra


def unregister(name: str) -> None:
    for table in (_FACTORIES, _EXTRAS, _BUILT):
        table.pop(name, None)


def names() -> list[str]:
    """Every registered backend, built or not, whether or not it can be built here."""
    return sorted(_FACTORIES)


def _build(name: str, factory) -> Backend:
    if isinstance(factory, str):
        module, attr = factory.split(":")
        obj = getattr(importlib.import_module(module), attr)
        # A backend object is used as is; a class or factory function is called.
        return obj() if inspect.isclass(obj) or not isinstance(obj, Backend) else obj
    return factory()


def get(name: str) -> Backend:
    """The backend registered as `name`, built on first use."""
    if name in _BUILT:
        return _BUILT[name]
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(names())}")
    factory = _FACTORIES[name]
    try:
        backend = _build(name, factory)
    except Exception as exc:  # import failures, missing CUDA libraries, ...: say what to do
        hint = f" It needs optional dependencies: {_EXTRAS[name]}." if name in _EXTRAS else ""
        raise BackendUnavailable(
            f"backend {name!r} is unavailable: building it from {factory!r} failed "
            f"({type(exc).__name__}: {exc}).{hint}"
        ) from exc
    if not isinstance(backend, Backend):
        raise BackendUnavailable(f"backend {name!r}: {factory!r} gave a {type(backend).__name__}, not a Backend")
    _BUILT[name] = backend
    return backend


def _value(text: str):
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """(name, params) of a backend spec: `"cupy"`, `"cupy:tile_n=32,stages=4"`, `"cutlass:wgmma=1"`
    (values: integers, true/false, none)."""
    name, _, params = spec.partition(":")
    kv = {}
    for item in filter(None, (part.strip() for part in params.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"backend spec {spec!r}: {item!r} is not key=value")
        kv[key.strip()] = _value(value)
    return name.strip(), kv


def from_spec(spec: str) -> Backend:
    """A backend from a spec (see parse_spec), bound to its parameters."""
    name, kv = parse_spec(spec)
    backend = get(name)
    return backend.with_params(**kv) if kv else backend


register("reference", ReferenceBackend)
register(
    "cupy",
    "drafter_attn.kernels.cupy_backend:BACKEND",
    extra="install the CUDA extra, pip install -e '.[cu13]' (CUDA 13) or '.[cu12]' (CUDA 12)",
)
register(
    "cutlass",
    "drafter_attn.kernels.cutlass_backend:BACKEND",
    extra="the CUDA and CUTLASS extras, pip install -e '.[cu13,cutlass]' (CuTe headers from "
          "nvidia-cutlass, NVRTC from nvidia-cuda-nvrtc, CuPy to launch)",
)
