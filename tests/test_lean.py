"""CPU: `cupy:lean=1` (kernels/cuda/drafter_attention.cu LEAN; issue 11), fewer instructions a
tile on the same algorithm. Nsight Compute's per-instruction sampling of the B=1 kernels
(results/perf-notes.md, "Instructions a tile") found a lone warpgroup issue-bound and the
cp.async loads of a 64-key tile costing about 45 instructions for every 2 copies: the page-id
select, cache_offset and the block-or-context choice redone per copy. LEAN
- issues a context tile's copies from one base address where the tile lies in one page (pages
  of a tile or more) or in the arena slot, the per-copy offsets written out as affine in the
  iteration;
- keeps the scores raw until exp2, whose FMA applies the softmax scale (one FMUL a score less).
No GPU needed: the knob is named only when on (every other variant keeps its SASS:
tests/test_page_small.py's digests), lean variants compile without spills on every SM target
and with fewer instructions in the tile loop, and the pipelined path at pages of a tile or
more reads its page ids from the shared-memory ring, not by a load the next wgmma waits for. The GPU matrix (tests/test_backends_gpu.py, "cupy:lean=1"
and "cupy:lean=1,wgmma=0") checks results on an H200.
"""

from __future__ import annotations

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels import static_profile as sp
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS
from drafter_attn.kernels.spec import Problem
from tests.test_page_small import GPT_OSS, _compile, _defines


def test_knob_named_only_when_on():
    off = _defines(MAIN_PRESET, 64, 90, {})
    on = _defines(MAIN_PRESET, 64, 90, {"lean": True})
    assert "LEAN" not in off and on.pop("LEAN") == 1 and on == off
    assert cb.tunables()["lean"] == [False, True]
    problem = Problem(PRESETS[MAIN_PRESET], "paged", 64, 1, 8192)
    assert registry.from_spec("cupy:lean=0").params_for(problem, 90).lean is False
    assert registry.from_spec("cupy").params_for(problem, 90).lean is True  # SM 90's default here
    assert registry.from_spec("cupy").params_for(problem, 100).lean is False


# (preset, page, sm, params): the pipelined wgmma path at pages of a tile or more and the
# arena (where the copies change), page 16 and TMA (only the softmax changes), mma.sync elsewhere
CASES = [
    (MAIN_PRESET, 64, 90, {"overlap": 2}), (MAIN_PRESET, 128, 90, {"overlap": 2}),
    (MAIN_PRESET, None, 90, {"overlap": 2}), (MAIN_PRESET, 16, 90, {"overlap": 2}),
    (MAIN_PRESET, 64, 90, {"overlap": 2, "tma": True}), (GPT_OSS, 64, 90, {"overlap": 2}),
    (MAIN_PRESET, 64, 100, {}), (MAIN_PRESET, None, 120, {}),
]


@pytest.mark.parametrize("preset,page,sm,params", CASES, ids=[
    f"{PRESETS[g].head_dim}-p{p}-sm{sm}-{'.'.join(ps)}" for g, p, sm, ps in CASES])
def test_lean_compiles_without_spills_and_a_shorter_tile_loop(cache_dir, preset, page, sm, params):
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed")
    loops = {}
    for lean in (False, True):
        res = _compile(preset, page, sm, {**params, "lean": lean})
        if lean:
            assert res.spills == 0, f"LEAN spills {res.spills} bytes"
        text = sp.sass_text(str(res.cubin_path), "drafter_attention")
        loops[lean] = sp.main_loop(sp.sass_instructions(text)["drafter_attention"])
    # measured with NVRTC 13.0: 5-18% fewer loop instructions (5% with TMA: only the softmax)
    assert len(loops[True]) < 0.97 * len(loops[False]), (len(loops[True]), len(loops[False]))
    fmul = {k: sum(x["text"].startswith("FMUL") for x in v) for k, v in loops.items()}
    assert fmul[True] < fmul[False]  # the scale is in exp2's FMA


@pytest.mark.parametrize("page", [64, 128, 256])
def test_lean_page_ids_come_through_shared_memory(cache_dir, page):
    """Without the ring, LEAN's base address made ptxas wait for the page-id load at the top of
    every iteration, before S = QK^T (measured: B=1 ctx 8k page 64 3.6% slower)."""
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed")
    for lean, ldg in ((False, 1), (True, 0)):
        res = _compile(MAIN_PRESET, page, 90, {"overlap": 2, "lean": lean})
        loads = sp.loop_global_loads(sp.sass_text(str(res.cubin_path), "drafter_attention"))
        assert loads["ldg"] == ldg and loads["ldgsts"] > 0, loads
    assert cb.id_ring_bytes(64, 3, 128, 4, page, True, lean=True) == 4 * 4 * 4
    assert cb.id_ring_bytes(64, 3, 128, 4, page, True) == 0
    # the ring's 64 bytes keep two main-preset CTAs an SM (228 KB, 1 KB reserved a CTA)
    need = cb.Params(lean=True, overlap=2).smem_bytes(128, 4, True, page)
    assert need == cb.Params(overlap=2).smem_bytes(128, 4, True, page) + 64
    assert 2 * (need + 1024) <= 228 * 1024
