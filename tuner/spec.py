"""Sweep specs: a TOML file naming what to measure, validated, expanded into candidates.

    [sweep]
    name = "default"
    backends = ["cupy"]                     # registry names
    presets = ["qwen3-8b-dflash-b16"]       # kernels.presets names, and/or [[sweep.geometries]]
    page_sizes = [16, 64, 128]              # paged layouts (powers of two)
    arena = true                            # also the arena layout
    batches = [1, 8, 32]
    ctx_lens = [2048, 8192]
    max_tokens = 2097152                    # leave out problems of batch x ctx_len above this
                                            # (their K/V would not fit the GPU; default: none)
    dtypes = ["bfloat16"]                   # default: each geometry's own dtype
    masks = ["preset"]                      # "preset", "full", "sliding:W", "sliding_causal:W"
    accepted = 16                           # mean rows stored per request (default: block size;
                                            # fewer is another workload: its rows are recorded
                                            # but never decide a tuned table's key)
    timeout_s = 600                         # per candidate, in its worker
    reps = 0                                # timed replays; 0 = chosen from the step's length
    nsys = false                            # also run Nsight Systems per candidate (tuner.nsys finds it)
    targets = ["sm90", "B200"]              # only on these GPUs (SM target or part of the GPU name),
                                            # each candidate once per target; default: any GPU.
                                            # An SM target's candidates start from that SM's
                                            # default params, others from SM 90's

    [[sweep.geometries]]                    # optional custom geometries
    name = "wide"
    num_q_heads = 64
    num_kv_heads = 4
    head_dim = 128
    block_size = 16
    mask = "full"                           # window = ... for sliding masks
    num_layers = 4

    [params.cupy]                           # parameter sets per backend, over its defaults
    variants = [{}, {num_splits = 1}]       # explicit sets ({} = the backend's defaults)
    grid = {stages = [2, 3]}                # and/or a cartesian product

Every error names the key it is about, e.g. "sweep.batches[2]: expected a positive int, got 0".
Specs that ship with the package (`tuner/specs/NAME.toml`) load by name: `load_spec("default")`,
`tuner sweep default`, `tuner sweep sm90`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import MASKS, REFERENCE_DTYPES, Geometry, Problem, is_power_of_two
from drafter_attn.tuner.db import candidate_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

DEFAULT_SPEC = "default"
SWEEP_KEYS = ("name", "backends", "presets", "geometries", "page_sizes", "arena", "batches",
              "ctx_lens", "max_tokens", "dtypes", "masks", "accepted", "timeout_s", "reps", "nsys",
              "targets")
GEOMETRY_KEYS = ("name", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "mask", "window",
                 "num_layers", "dtype")
PARAM_KEYS = ("variants", "grid")


class SpecError(ValueError):
    """A sweep spec that cannot be used; the message names the key."""


@dataclass(frozen=True)
class Candidate:
    """One thing to measure: a problem, an implementation and its full (resolved) parameters."""

    problem: Problem
    impl: str
    params: tuple  # sorted (name, value) pairs
    accepted: float | None = None  # mean rows stored per request; None = block size
    preset: str | None = None  # the spec's name of the geometry
    target: str | None = None  # the GPUs it is for: "sm90", a GPU class ("H200"); None: any
    # the regime it is timed in: seconds of its own back-to-back load before each timing (0: a
    # burst on a cool GPU; tuner.timing.sustain)
    sustain_s: float = 0.0
    # what holds that state (kernels.tuned_table.SUSTAIN_LOADS): "" or "self" its own load, "gemm" a
    # co-runner's matmuls before and between its timed replays (a target model's load)
    sustain_load: str = ""

    @property
    def params_dict(self) -> dict:
        return dict(self.params)

    def key(self) -> str:
        return candidate_key(self.problem.key(), self.accepted, self.impl, self.params_dict, self.sustain_s,
                             self.sustain_load)

    def label(self) -> str:
        p = self.problem
        layout = f"page{p.page_size}" if p.layout == "paged" else "arena"
        params = ",".join(f"{k}={v}" for k, v in self.params) or "-"
        where = f" @{self.target}" if self.target else ""
        regime = f" sustained {self.sustain_s:g} s" if self.sustain_s else ""
        if self.sustain_s and self.sustain_load not in ("", "self"):
            regime += f" under {self.sustain_load}"
        return (f"{self.preset or 'custom'} {layout} B={p.batch} ctx={p.ctx_len} {self.impl}[{params}]"
                f"{where}{regime}")

    def to_wire(self) -> dict:
        """Plain data (JSON-able) for a worker process."""
        return dict(problem=self.problem.key(), impl=self.impl, params=self.params_dict,
                    accepted=self.accepted, preset=self.preset, target=self.target,
                    sustain_s=self.sustain_s, sustain_load=self.sustain_load)

    @staticmethod
    def from_wire(d: dict) -> Candidate:
        return Candidate(problem_from_key(d["problem"]), d["impl"], tuple(sorted(d["params"].items())),
                         d.get("accepted"), d.get("preset"), d.get("target"), d.get("sustain_s") or 0.0,
                         d.get("sustain_load") or "")

    def sustained(self, seconds: float, load: str = "") -> Candidate:
        """This candidate timed after `seconds` of load (0: in a burst): its own, or `load`'s
        (kernels.tuned_table.SUSTAIN_LOADS; ignored in a burst)."""
        from drafter_attn.kernels.tuned_table import check_sustain_load

        seconds = float(seconds or 0.0)
        load = "" if not seconds or load in ("", "self") else check_sustain_load(load)
        return dataclasses.replace(self, sustain_s=seconds, sustain_load=load)


def target_sm(target: str | None) -> int | None:
    """The SM of an SM target ("sm120" -> 120); None for any GPU or a GPU class ("H200")."""
    t = (target or "").lower()
    return int(t[2:]) if t.startswith("sm") and t[2:].isdigit() else None


def problem_from_key(key: dict) -> Problem:
    """Inverse of Problem.key()."""
    geom_fields = {k: key[k] for k in GEOMETRY_KEYS if k != "name"}
    return Problem(Geometry(**geom_fields), key["layout"], key["page_size"], key["batch"], key["ctx_len"])


@dataclass
class SweepSpec:
    name: str
    backends: list[str]
    geometries: dict[str, Geometry]
    page_sizes: list[int]
    arena: bool
    batches: list[int]
    ctx_lens: list[int]
    dtypes: list[str] | None  # None: each geometry's own
    masks: list[tuple[str, int | None] | None]  # None entry: the geometry's own mask
    params: dict[str, list[dict]]
    accepted: float | None = None
    timeout_s: float = 600.0
    reps: int = 0
    nsys: bool = False
    source: str = "<spec>"
    targets: list = field(default_factory=lambda: [None])
    max_tokens: int | None = None  # batch x ctx_len above this: left out
    _candidates: list | None = field(default=None, repr=False)

    def problems(self) -> list[tuple[str, Problem]]:
        layouts = [("paged", p) for p in self.page_sizes] + ([("arena", None)] if self.arena else [])
        out = []
        for name, geom in self.geometries.items():
            for dtype in self.dtypes or [geom.dtype]:
                for mask in self.masks:
                    g = geom.with_(dtype=dtype)
                    if mask is not None:
                        g = g.with_(mask=mask[0], window=mask[1])
                    for (layout, page), batch, ctx in itertools.product(layouts, self.batches, self.ctx_lens):
                        if self.max_tokens is None or batch * ctx <= self.max_tokens:
                            out.append((name, Problem(g, layout, page, batch, ctx)))
        return out

    def candidates(self) -> list[Candidate]:
        """Every (problem x backend x parameter set), resolved over the backend's defaults, once."""
        if self._candidates is not None:
            return self._candidates
        from drafter_attn.kernels import registry

        out: dict[tuple, Candidate] = {}
        for preset, problem in self.problems():
            if self.accepted is not None and self.accepted > problem.geometry.block_size:
                raise SpecError(f"{self.source}: sweep.accepted: {self.accepted} exceeds block_size "
                                f"{problem.geometry.block_size} of geometry {preset!r}")
            for impl in self.backends:
                backend = registry.get(impl)
                known = set(backend.tunables(problem))
                for i, override in enumerate(self.params.get(impl, [{}])):
                    unknown = set(override) - known
                    if unknown:
                        raise SpecError(f"{self.source}: params.{impl}: unknown parameter(s) "
                                        f"{sorted(unknown)}; {impl} tunes {sorted(known) or 'nothing'}")
                    for target in self.targets:
                        # an SM target's candidates start from that SM's defaults
                        try:
                            full = registry.resolve_params(backend, problem, target_sm(target),
                                                           override)
                        except ValueError as exc:  # a value out of type or range: the spec's
                            raise SpecError(f"{self.source}: params.{impl}.variants[{i}]: {exc}") from None
                        cand = Candidate(problem, impl, tuple(sorted(full.items())), self.accepted,
                                         preset, target)
                        out.setdefault((target, cand.key()), cand)
        self._candidates = list(out.values())
        return self._candidates


# ---------------------------------------------------------------------------------------------
# Validation helpers: each names the key it checks.


def _fail(source: str, key: str, message: str):
    raise SpecError(f"{source}: {key}: {message}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(source, key, value, *, minimum=1, power_of_two=False, what="positive int") -> list[int]:
    if not isinstance(value, list) or not value:
        _fail(source, key, f"expected a non-empty list of {what}s, got {value!r}")
    for i, v in enumerate(value):
        if not _is_int(v) or v < minimum or (power_of_two and not is_power_of_two(v)):
            _fail(source, f"{key}[{i}]", f"expected a {what}, got {v!r}")
    return list(dict.fromkeys(value))


def _str_list(source, key, value, choices=None) -> list[str]:
    if not isinstance(value, list) or not value:
        _fail(source, key, f"expected a non-empty list of strings, got {value!r}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            _fail(source, f"{key}[{i}]", f"expected a string, got {v!r}")
        if choices is not None and v not in choices:
            _fail(source, f"{key}[{i}]", f"unknown value {v!r}; known: {', '.join(choices)}")
    return list(dict.fromkeys(value))


def _check_keys(source, prefix, table, known) -> None:
    if not isinstance(table, dict):
        _fail(source, prefix, f"expected a table, got {table!r}")
    for key in table:
        if key not in known:
            _fail(source, f"{prefix}.{key}", f"unknown key; known keys: {', '.join(known)}")


def _parse_mask(source, key, text):
    if text == "preset":
        return None
    mask, _, window = text.partition(":")
    if mask not in MASKS or (mask == "full") != (window == ""):
        _fail(source, key, f"expected 'preset', 'full', 'sliding:W' or 'sliding_causal:W', got {text!r}")
    if mask == "full":
        return ("full", None)
    if not window.isdigit() or int(window) <= 0:
        _fail(source, key, f"window must be a positive int, got {text!r}")
    return (mask, int(window))


def _geometry(source, key, table) -> tuple[str, Geometry]:
    _check_keys(source, key, table, GEOMETRY_KEYS)
    name = table.get("name")
    if not isinstance(name, str) or not name:
        _fail(source, f"{key}.name", f"expected a non-empty string, got {name!r}")
    fields = {k: v for k, v in table.items() if k != "name"}
    try:
        return name, Geometry(**fields)
    except TypeError as exc:  # a required field is missing
        _fail(source, key, str(exc).replace("__init__()", "geometry"))
    except ValueError as exc:
        _fail(source, key, str(exc))


def _param_sets(source, backend, table) -> list[dict]:
    key = f"params.{backend}"
    _check_keys(source, key, table, PARAM_KEYS)
    sets: list[dict] = []
    variants = table.get("variants", [] if "grid" in table else [{}])
    if not isinstance(variants, list):
        _fail(source, f"{key}.variants", f"expected a list of tables, got {variants!r}")
    for i, v in enumerate(variants):
        if not isinstance(v, dict):
            _fail(source, f"{key}.variants[{i}]", f"expected a table of parameters, got {v!r}")
        for name, value in v.items():
            if not isinstance(value, (int, float, bool, str)):
                _fail(source, f"{key}.variants[{i}].{name}", f"expected a scalar, got {value!r}")
        sets.append(dict(v))
    if "grid" in table:
        grid = table["grid"]
        if not isinstance(grid, dict) or not grid:
            _fail(source, f"{key}.grid", f"expected a table of name = [values], got {grid!r}")
        for name, values in grid.items():
            if not isinstance(values, list) or not values or not all(
                    isinstance(x, (int, float, bool, str)) for x in values):
                _fail(source, f"{key}.grid.{name}", f"expected a non-empty list of scalars, got {values!r}")
        names = list(grid)
        sets += [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]
    return sets


def _sweep_table(data: dict, source: str) -> dict:
    """The [sweep] table, with the top level and its own keys checked."""
    _check_keys(source, "<top level>", data, ("sweep", "params"))
    if "sweep" not in data:
        _fail(source, "sweep", "missing table [sweep]")
    sw = data["sweep"]
    _check_keys(source, "sweep", sw, SWEEP_KEYS)
    return sw


def _spec_name(sw: dict, source: str) -> str:
    name = sw.get("name", Path(source).stem)
    if not isinstance(name, str):
        _fail(source, "sweep.name", f"expected a string, got {name!r}")
    return name


def _spec_backends(sw: dict, source: str) -> list[str]:
    from drafter_attn.kernels import registry

    if "backends" not in sw:
        _fail(source, "sweep.backends", "missing; name at least one backend")
    return _str_list(source, "sweep.backends", sw["backends"], registry.names())


def _spec_geometries(sw: dict, source: str) -> dict[str, Geometry]:
    """The presets, then the custom [[sweep.geometries]], by name; at least one."""
    geometries: dict[str, Geometry] = {}
    if "presets" in sw:
        for n in _str_list(source, "sweep.presets", sw["presets"], list(PRESETS)):
            geometries[n] = PRESETS[n]
    if "geometries" in sw:
        if not isinstance(sw["geometries"], list):
            _fail(source, "sweep.geometries", "expected an array of tables ([[sweep.geometries]])")
        for i, table in enumerate(sw["geometries"]):
            gname, geom = _geometry(source, f"sweep.geometries[{i}]", table)
            if gname in geometries:
                _fail(source, f"sweep.geometries[{i}].name", f"{gname!r} is already used")
            geometries[gname] = geom
    if not geometries:
        _fail(source, "sweep.presets", "no geometry: give sweep.presets or [[sweep.geometries]]")
    return geometries


def _spec_layouts(sw: dict, source: str) -> tuple[list[int], bool]:
    """(page sizes, arena); at least one cache layout."""
    page_sizes = []
    if "page_sizes" in sw:
        page_sizes = _int_list(source, "sweep.page_sizes", sw["page_sizes"], power_of_two=True,
                               what="power-of-two int")
    arena = sw.get("arena", False)
    if not isinstance(arena, bool):
        _fail(source, "sweep.arena", f"expected true or false, got {arena!r}")
    if not page_sizes and not arena:
        _fail(source, "sweep.page_sizes", "no cache layout: give page sizes and/or arena = true")
    return page_sizes, arena


def _spec_shapes(sw: dict, source: str) -> tuple[list[int], list[int], int | None, list[str] | None, list]:
    """(batches, ctx_lens, max_tokens, dtypes, masks); max_tokens None: no limit; dtypes None
    and masks [None] mean the geometry's own."""
    for key in ("batches", "ctx_lens"):
        if key not in sw:
            _fail(source, f"sweep.{key}", "missing")
    batches = _int_list(source, "sweep.batches", sw["batches"])
    ctx_lens = _int_list(source, "sweep.ctx_lens", sw["ctx_lens"], minimum=0, what="non-negative int")
    max_tokens = sw.get("max_tokens")
    if max_tokens is not None:
        if not _is_int(max_tokens) or max_tokens <= 0:
            _fail(source, "sweep.max_tokens", f"expected a positive int (tokens, batch x ctx_len), got {max_tokens!r}")
        if not any(b * c <= max_tokens for b in batches for c in ctx_lens):
            _fail(source, "sweep.max_tokens", f"{max_tokens} leaves no (batch, ctx_len) of the spec "
                  f"(the smallest is {min(batches)} x {min(ctx_lens)} = {min(batches) * min(ctx_lens)})")
    dtypes = _str_list(source, "sweep.dtypes", sw["dtypes"], REFERENCE_DTYPES) if "dtypes" in sw else None
    masks = [None]
    if "masks" in sw:
        masks = [_parse_mask(source, f"sweep.masks[{i}]", m)
                 for i, m in enumerate(_str_list(source, "sweep.masks", sw["masks"]))]
    return batches, ctx_lens, max_tokens, dtypes, masks


def _spec_run_options(sw: dict, source: str) -> tuple[float | None, float, int, bool]:
    """(accepted, timeout_s, reps, nsys), with their defaults."""
    accepted = sw.get("accepted")
    if accepted is not None and (isinstance(accepted, bool) or not isinstance(accepted, (int, float))
                                 or not accepted > 0 or not math.isfinite(accepted)):
        _fail(source, "sweep.accepted", f"expected a positive number, got {accepted!r}")
    timeout_s = sw.get("timeout_s", 600)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        _fail(source, "sweep.timeout_s", f"expected a positive number of seconds, got {timeout_s!r}")
    reps = sw.get("reps", 0)
    if not _is_int(reps) or reps < 0:
        _fail(source, "sweep.reps", f"expected a non-negative int (0 = automatic), got {reps!r}")
    nsys = sw.get("nsys", False)
    if not isinstance(nsys, bool):
        _fail(source, "sweep.nsys", f"expected true or false, got {nsys!r}")
    return None if accepted is None else float(accepted), float(timeout_s), reps, nsys


def _spec_params(data: dict, source: str, backends: list[str]) -> dict[str, list[dict]]:
    """The [params.<backend>] tables, each expanded into its parameter sets."""
    params_table = data.get("params", {})
    _check_keys(source, "params", params_table, backends)
    return {b: _param_sets(source, b, t) for b, t in params_table.items()}


def parse_spec(data: dict, source: str = "<spec>") -> SweepSpec:
    """Validate a parsed TOML document into a SweepSpec."""
    sw = _sweep_table(data, source)
    name = _spec_name(sw, source)
    backends = _spec_backends(sw, source)
    geometries = _spec_geometries(sw, source)
    page_sizes, arena = _spec_layouts(sw, source)
    batches, ctx_lens, max_tokens, dtypes, masks = _spec_shapes(sw, source)
    accepted, timeout_s, reps, nsys = _spec_run_options(sw, source)
    targets = _str_list(source, "sweep.targets", sw["targets"]) if "targets" in sw else [None]
    params = _spec_params(data, source, backends)
    spec = SweepSpec(name, backends, geometries, page_sizes, arena, batches, ctx_lens, dtypes, masks,
                     params, accepted, timeout_s, reps, nsys, source, targets, max_tokens)
    spec.candidates()  # parameter names and accepted are checked against each problem
    return spec


def shipped_spec(name: str):
    """The spec file shipped as tuner/specs/NAME.toml (a bare name: no folder, no suffix), or None."""
    if not name or "/" in name or "\\" in name or name.endswith(".toml"):
        return None
    found = resources.files("drafter_attn.tuner").joinpath("specs", f"{name}.toml")
    return found if found.is_file() else None


def default_spec_text() -> str:
    return shipped_spec(DEFAULT_SPEC).read_text()


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a spec file; a bare name ("default", "sm90") names a spec shipped with
    the package (tuner/specs/NAME.toml)."""
    shipped = shipped_spec(str(path))
    if shipped is not None:
        text, source = shipped.read_text(), f"tuner/specs/{path}.toml"
    else:
        try:
            text, source = Path(path).read_text(), str(path)
        except OSError as exc:
            raise SpecError(f"{path}: cannot read the sweep spec: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise SpecError(f"{path}: not a sweep spec (not UTF-8 text; a spec is a TOML file)") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    from drafter_attn.kernels.registry import BackendUnavailable

    try:
        return parse_spec(data, source)
    except BackendUnavailable as exc:  # e.g. cutlass without the nvidia-cutlass wheel
        raise SpecError(f"{source}: {exc}") from None
