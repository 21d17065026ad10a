"""CPU: the shared memory the planner counts (`Params.smem_bytes`, which `supports` and the
split model use before anything compiles) is what a variant's kernel launches with
(`module_smem`, from its compile-time defines). The two add up the same regions; a region one
of them leaves out shifts another into memory the kernel lays out for something else (a stream_k
experiment's walk state once overlaid the page ids this way: results/perf-notes.md)."""

from __future__ import annotations

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem

SPECS = ["cupy", "cupy:wgmma=0", "cupy:wgmma=0,q_smem=1", "cupy:lean=1", "cupy:overlap=1",
         "cupy:tma=1", "cupy:tma=1,trim=1", "cupy:tma=1,tile_n=32,stages=4", "cupy:lean=1,stages=4",
         "cupy:wgmma=1", "cupy:ws=2", "cupy:ws=3,tile_n=32,early_ids=1", "cupy:ws=4",
         "cupy:ws=3,ws_rows=1", "cupy:ws=2,ws_rows=1,ws_overlap=1,stages=4"]


def _cases():
    for spec in SPECS:
        for name in ("qwen3-8b-dflash-b16", "gpt-oss-20b-dflash", "laguna-dflash", "mimo-dflash"):
            for page in (8, 16, 64, 256, None):
                for batch in (1, 32):
                    yield pytest.param(spec, name, page, batch, id=f"{spec}-{name}-p{page}-b{batch}")


@pytest.mark.parametrize("spec,preset,page,batch", _cases())
def test_planned_shared_memory_is_what_the_kernel_launches_with(spec, preset, page, batch):
    g = PRESETS[preset]
    problem = Problem(g, "paged" if page else "arena", page, batch, 8192)
    backend = registry.from_spec(spec)
    if backend.supports(problem, 90):
        pytest.skip("refused before any kernel runs")
    p = backend.params_for(problem, 90)
    defines = cb.variant_defines(g.dtype, g.head_dim, page, g.block_size, g.group, p, 90)
    warps = cb.num_warps(g.block_size, g.group, row_split=p.row_split)
    wgmma = bool(defines["WGMMA"])
    assert p.smem_bytes(g.head_dim, warps, wgmma, page) == cb.module_smem(defines)
