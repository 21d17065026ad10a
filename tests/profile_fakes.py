"""Profile databases built in tests (through tuner.db), and a fake backend that records calls."""

from __future__ import annotations

import dataclasses

from drafter_attn.kernels import reference
from drafter_attn.kernels.presets import get_preset
from drafter_attn.tuner.db import ProfileDB, candidate_key

H200 = dict(gpu_name="NVIDIA H200", sm=90, sm_count=132, driver="580.95.05", cuda="13.0",
            torch="2.11.0", cupy="14.2.0", cutlass=None, nvrtc="13.0", sources_hash="src-a")
B200 = dict(H200, gpu_name="NVIDIA B200", sm=100, sm_count=148)
MAIN = get_preset("qwen3-8b-dflash-b16")  # 32/8 x 128, Qb 16, full, 5 layers


def row(env_id, *, geometry=MAIN, layout="paged", page=64, batch=8, ctx=2048, impl="cupy",
        params=None, median_us=100.0, provenance="measured", status="ok", **metrics) -> dict:
    g = geometry
    problem = dict(num_q_heads=g.num_q_heads, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                   block_size=g.block_size, mask=g.mask, window=g.window, num_layers=g.num_layers,
                   dtype=g.dtype, layout=layout, page_size=page if layout == "paged" else None,
                   batch=batch, ctx_len=ctx)
    params = dict(params or {})
    key = candidate_key(problem, metrics.get("accepted"), impl, params, metrics.get("sustain_s"),
                        metrics.get("sustain_load"))
    out = dict(env_id=env_id, candidate_key=key, problem_key=problem, preset="test", **problem, impl=impl, params=params,
               status=status, provenance=provenance, median_us=median_us, sweep_id="sweep-1")
    out.update(metrics)
    return out


def build_db(path, rows_by_env: dict) -> None:
    """rows_by_env: {fingerprint name: (fingerprint, [row kwargs, ...])}."""
    with ProfileDB(path) as db:
        for fp, rows in rows_by_env.values():
            env = db.add_environment(fp)
            for kw in rows:
                db.add_result(row(env, **kw))


class FakeBackend:
    """A registry backend that runs the reference and records what it was asked."""

    def __init__(self, name, unsupported_head_dims=(), params=(), log=None):
        self.name = name
        self.unsupported = tuple(unsupported_head_dims)
        self.params = dict(params)
        self.log = log if log is not None else []

    def supports(self, problem):
        if problem.geometry.head_dim in self.unsupported:
            return f"{self.name} does not do head_dim {problem.geometry.head_dim}"
        if self.params.get("broken"):
            return "broken=True"
        return None

    def tunables(self, problem):
        return {"tile": [1, 2], "broken": [False, True]}

    def default_params(self, problem):
        return {"tile": 1}

    def with_params(self, **params):
        unknown = set(params) - {"tile", "broken"}
        if unknown:
            raise ValueError(f"unknown params {sorted(unknown)}")
        self.log.append(("with_params", params))
        return type(self)(self.name, self.unsupported, {**self.params, **params}, self.log)

    def _rec(self, fn):
        self.log.append((fn, dict(self.params)))

    def paged_attention(self, *args, **kw):
        self._rec("paged_attention")
        return reference.paged_attention(*args, **kw)

    def arena_attention(self, *args, **kw):
        self._rec("arena_attention")
        return reference.arena_attention(*args, **kw)

    def store_paged(self, *args):
        self._rec("store_paged")
        return reference.store_paged(*args)

    def store_arena(self, *args):
        self._rec("store_arena")
        return reference.store_arena(*args)


def small_geometry(**changes):
    """A small geometry for CPU calls (kept at head_dim 64/128 so cupy's supports() says yes)."""
    return dataclasses.replace(MAIN.with_(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4,
                                          num_layers=1), **changes)
