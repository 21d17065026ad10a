"""Registry of backends: every implementation of the four contract functions, by name.

Tests, the tuner and the bench reach each implementation through `get(name)`, so they can swap one
for another. Backends are built lazily on first `get`: a factory may be an import path
"module:attr", so `names()` works on machines where a backend's dependencies (CuPy, CUTLASS) are
not installed, and only asking for that backend reports what is missing.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable, Protocol, runtime_checkable

from drafter_attn.kernels import reference
from drafter_attn.kernels.spec import Problem


@runtime_checkable
class Backend(Protocol):
    """What every backend offers. The four functions keep the signatures of `kernels.reference`.

    Example:
        >>> isinstance(get("reference"), Backend)
        True
    """

    name: str
    # Optional: the tensor device types the backend runs on (default: ("cuda",)); the runtime
    # sends tensors elsewhere to the reference.

    def paged_attention(self, q, k_blk, v_blk, k_pages, v_pages, block_table, ctx_lens, *,
                        mask="full", window=None, scale=None):
        """Block attention over a paged context: q [B, Qb, Hq, D], k_blk/v_blk [B, Qb, Hkv, D],
        k_pages/v_pages [num_pages, Hkv, page_size, D], block_table and ctx_lens int32; returns
        [B, Qb, Hq, D] in q's dtype (`kernels.reference.paged_attention`)."""

    def arena_attention(self, q, k_blk, v_blk, k_arena, v_arena, slots, ctx_lens, *,
                        mask="full", window=None, scale=None):
        """Block attention over an arena context: k_arena/v_arena [num_slots, max_ctx, Hkv, D]
        and slots int32 [B] in place of pages and table (`kernels.reference.arena_attention`)."""

    def store_paged(self, k_new, v_new, num_new, k_pages, v_pages, block_table, ctx_lens) -> None:
        """Write rows j < num_new[b] of k_new/v_new [B, T, Hkv, D] into the pages at ctx_lens[b] + j,
        then advance ctx_lens by num_new, all in place (`kernels.reference.store_paged`)."""

    def store_arena(self, k_new, v_new, num_new, k_arena, v_arena, slots, ctx_lens) -> None:
        """As `store_paged`, into the arena row `slots[b]` of each request
        (`kernels.reference.store_arena`)."""

    def supports(self, problem: Problem) -> str | None:
        """None when the backend can run `problem` (a `kernels.spec.Problem`), else the reason
        it cannot, e.g. an unsupported head_dim. A backend whose answer depends on the GPU
        takes an optional keyword `sm` (see the module function `supports`)."""

    def tunables(self, problem: Problem) -> dict[str, list]:
        """The tunable parameter space for `problem` (None: any problem): parameter name ->
        candidate values, e.g. {"tile_n": [16, 32, 64]}; {} when nothing is tuned."""

    def default_params(self, problem: Problem) -> dict:
        """Parameters to use for `problem` (None: any problem) when no tuned value is known,
        as a dict of name -> value. A backend whose defaults differ by GPU takes an optional
        keyword `sm`, the GPU's SM (cupy and cutlass: kernels.cupy_backend.SM_BUDGETS; see
        the module function `default_params`)."""

    def with_params(self, **params) -> Backend:
        """This backend bound to the given parameters (names from `tunables`); ValueError for
        a parameter it does not have. Call it through `bind`, which checks the values first."""


class ReferenceBackend:
    """The torch reference: runs every problem, has nothing to tune."""

    name = "reference"
    device_types = ("cpu", "cuda")
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
_REFERENCE_ONLY: dict[str, str] = {}  # name -> why it is never a tuned pick (a reference to compare with)
_BUILT: dict[str, Backend] = {}


def register(name: str, factory: Callable[[], Backend] | str, *, extra: str | None = None,
             replace: bool = False, reference_only: str | None = None) -> None:
    """Register a backend under `name`, built on its first `get`.

    Args:
        name: the registry name (what `get`, `from_spec` and sweep specs use).
        factory: a zero-argument callable returning the backend, or an import path
            "module:attr" naming a backend object (or a zero-argument factory).
        extra: what to install when building it fails (said in `BackendUnavailable`).
        replace: replace a backend already registered as `name` (else ValueError).
        reference_only: when given, why the backend is a reference to measure against and
            never a pick: tuned tables and the dispatcher leave it out (`reference_only`).

    Example:
        >>> register("mine", ReferenceBackend)
        >>> get("mine").name
        'reference'
        >>> unregister("mine")
    """
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
    if reference_only is None:
        _REFERENCE_ONLY.pop(name, None)
    else:
        _REFERENCE_ONLY[name] = reference_only


def unregister(name: str) -> None:
    for table in (_FACTORIES, _EXTRAS, _REFERENCE_ONLY, _BUILT):
        table.pop(name, None)


def reference_only(name: str) -> str | None:
    """Why backend `name` is a reference that is measured but never picked (no tuned table or
    dispatcher may name it), or None for a candidate. Needs no build (no CuPy).

    Example:
        >>> reference_only("reference-syncing").startswith("a reference that stalls the host")
        True
        >>> reference_only("cupy") is None
        True
    """
    return _REFERENCE_ONLY.get(name)


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
    """The backend registered as `name`, built on first use and cached.

    Raises ValueError for an unknown name, `BackendUnavailable` when it cannot be built here
    (the message says what to install).

    Example:
        >>> get("reference").supports(None) is None  # the reference runs every problem
        True
    """
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


def _takes_sm(method) -> bool:
    try:
        return "sm" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def default_params(backend, problem: Problem | None, sm: int | None = None) -> dict:
    """`backend.default_params(problem)` for a GPU of SM `sm`: backends whose defaults differ
    by SM (their `default_params` takes `sm`) get it; None means no GPU in particular.

    Example:
        >>> default_params(get("cupy"), None, sm=120)["tile_n"]  # SM 120's 99 KB a CTA: 32-key tiles
        32
        >>> default_params(get("reference"), None, sm=120)
        {}
    """
    method = backend.default_params
    return method(problem, sm=sm) if sm is not None and _takes_sm(method) else method(problem)


def resolve_params(backend, problem: Problem, sm: int | None = None,
                   overrides: dict | None = None) -> dict:
    """Every parameter `backend` runs `problem` with on SM `sm` when bound to `overrides`. Not
    simply the defaults updated by the overrides: a default may follow from another parameter
    (cupy's software pipelining is on by default only where the wgmma path runs, so
    `wgmma=False` turns it off), and backends with `params_for` resolve that themselves.

    Example:
        >>> from drafter_attn.kernels.presets import PRESETS
        >>> p = Problem(PRESETS["qwen3-8b-dflash-b16"], "paged", 64, 8, 8192)
        >>> [resolve_params(get("cupy"), p, 90, o)["overlap"] for o in ({}, {"wgmma": False})]
        [2, 0]
    """
    overrides = dict(overrides or {})
    bound = backend.with_params(**overrides) if overrides else backend
    if hasattr(bound, "params_for"):
        return dataclasses.asdict(bound.params_for(problem, sm))
    return {**default_params(backend, problem, sm), **overrides}


def supports(backend, problem: Problem, sm: int | None = None) -> str | None:
    """`backend.supports(problem)` on a GPU of SM `sm` (passed to backends that take it: the
    shared memory a CTA gets differs by SM)."""
    method = backend.supports
    return method(problem, sm=sm) if sm is not None and _takes_sm(method) else method(problem)


# ---------------------------------------------------------------------------------------------
# Parameter values: checked here, before any backend binds them. Compiled backends turn them
# into compiler options, so only ints, bools and None (where a field allows it) ever pass.

# Free integer knobs: a sane range (and powers of two where the kernels need them). Integer
# knobs not listed take the values of the backend's `tunables()` (or its default).
PARAM_RANGES = {
    "tile_n": (16, 256, True),  # (low, high, power of two)
    "stages": (2, 12, False),  # 12: ws=4's 32-key stages
    "num_splits": (0, 128, False),
    "min_ctas": (1, 32, False),
    "combine": (1, 2, False),
}
_TYPE_NAMES = {"int": int, "bool": bool, "None": type(None)}


def _field_types(field) -> set:
    text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return {_TYPE_NAMES[t.strip()] for t in text.replace("Optional[", "None|").strip("]").split("|")
            if t.strip() in _TYPE_NAMES}


def param_schema(backend) -> dict[str, tuple[set, object, list]]:
    """name -> (allowed types, default, candidate values) of `backend`'s parameters: from its
    Params dataclass when it has one (`params_for(None)`), else from its `tunables(None)`."""
    tunables = backend.tunables(None) or {}
    params_for = getattr(backend, "params_for", None)
    sample = params_for(None) if params_for is not None else None
    if dataclasses.is_dataclass(sample):
        return {f.name: (_field_types(f), getattr(sample, f.name), list(tunables.get(f.name, [])))
                for f in dataclasses.fields(sample)}
    defaults = backend.default_params(None) or {}
    return {name: ({type(v) for v in values} | {type(defaults.get(name))}, defaults.get(name), list(values))
            for name, values in tunables.items()}


def _check_value(backend_name: str, name: str, value, types_, default, values):
    where = f"backend {backend_name!r}: parameter {name}={value!r}"
    if value is None:
        if type(None) in types_:
            return None
        raise ValueError(f"{where} must not be None")
    if bool in types_ and int not in types_:
        if isinstance(value, int) and value in (0, 1):  # bool is an int; 0/1 from specs
            return bool(value)
        raise ValueError(f"{where} must be true or false")
    if int not in types_ or isinstance(value, bool) or not isinstance(value, int):
        kinds = " or ".join(t.__name__ for t in (int, bool, type(None)) if t in types_) or "nothing"
        raise ValueError(f"{where} must be {kinds}")
    if name in PARAM_RANGES:
        low, high, pow2 = PARAM_RANGES[name]
        if not low <= value <= high or (pow2 and value & (value - 1)):
            two = "a power of two " if pow2 else ""
            raise ValueError(f"{where} must be {two}from {low} to {high}")
    elif value not in [*values, default]:
        raise ValueError(f"{where} must be one of {sorted({*values, default}, key=str)}")
    return value


def check_params(backend, params: dict) -> dict:
    """`params` checked against `backend`'s parameters: known names, types (int, bool, None
    where allowed: nothing else ever reaches a compiler) and ranges; returns them normalised
    (0/1 as bools). Raises ValueError naming the parameter.

    Args:
        backend: a Backend (its parameters come from `param_schema`).
        params: name -> value, e.g. from `parse_spec`.

    Example:
        >>> check_params(get("reference"), {})
        {}
        >>> check_params(get("reference"), {"tile_n": 32})
        Traceback (most recent call last):
        ValueError: unknown reference params ['tile_n']; backend 'reference' has no tunable parameters
    """
    name = getattr(backend, "name", type(backend).__name__)
    schema = param_schema(backend)
    unknown = sorted(set(params) - set(schema))
    if unknown:
        known = f"known: {', '.join(schema)}" if schema else f"backend {name!r} has no tunable parameters"
        raise ValueError(f"unknown {name} params {unknown}; {known}")
    return {k: _check_value(name, k, v, *schema[k]) for k, v in params.items()}


def bind(backend, params: dict):
    """`backend` bound to `params`, checked first (ValueError naming a bad parameter)."""
    return backend.with_params(**check_params(backend, params)) if params else backend


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
    (values: integers, true/false, none). Nothing is checked against the backend here
    (`from_spec` does); an item without "=" raises ValueError.

    Example:
        >>> parse_spec("cupy:tile_n=32,stages=4,wgmma=true")
        ('cupy', {'tile_n': 32, 'stages': 4, 'wgmma': True})
    """
    name, _, params = spec.partition(":")
    kv = {}
    for item in filter(None, (part.strip() for part in params.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"backend spec {spec!r}: {item!r} is not key=value")
        kv[key.strip()] = _value(value)
    return name.strip(), kv


def format_spec(name: str, params) -> str:
    """The backend spec parse_spec reads back as (`name`, the same params), leaving out the
    parameters at the backend's default (all are kept when the backend cannot be built here).

    Example:
        >>> format_spec("cupy", {"tile_n": 32, "ws": 3, "wgmma": None, "lean": True, "trim": False})
        'cupy:lean=true,tile_n=32,ws=3'
    """
    try:
        defaults = {k: v[1] for k, v in param_schema(get(name)).items()}
    except Exception:  # unavailable here: every parameter, as given
        defaults = {}
    text = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) or v is None else v}"
                    for k, v in sorted(dict(params).items()) if k not in defaults or v != defaults[k])
    return f"{name}:{text}" if text else name


def from_spec(spec: str) -> Backend:
    """A backend from a spec (see parse_spec), bound to its checked parameters (ValueError
    naming a bad one; `BackendUnavailable` when the backend cannot be built here).

    Example:
        >>> from_spec("reference").name
        'reference'
    """
    name, kv = parse_spec(spec)
    return bind(get(name), kv)


register("reference", ReferenceBackend)
register(
    "cupy",
    "drafter_attn.kernels.cupy_backend:BACKEND",
    extra="install the CUDA extra, pip install -e '.[cu13]' (CUDA 13) or '.[cu12]' (CUDA 12)",
)
register(
    "reference-syncing",
    "drafter_attn.kernels.syncing_store:make_backend",
    extra="the CUDA extra (its attention is the cupy backend's), pip install -e '.[cu13]'",
    reference_only="a reference that stalls the host: its store reads the per-request block counts "
                   "back with .tolist() before writing (TensorRT-LLM's paged context store does); "
                   "measured to show what a host sync costs, never shipped",
)
register(
    "cutlass",
    "drafter_attn.kernels.cutlass_backend:BACKEND",
    extra="the CUDA and CUTLASS extras, pip install -e '.[cu13,cutlass]' (CuTe headers from "
          "nvidia-cutlass, NVRTC from nvidia-cuda-nvrtc, CuPy to launch)",
)
