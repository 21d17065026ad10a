"""CPU: `cupy:trim=1` (kernels/cuda/drafter_attention.cu TRIM), the software-pipelined wgmma
path's tile loop trimmed as the warp-specialised consumers' lean loop (warp_specialized.cuh,
results/perf-notes.md, "The ws consumers' tile loop, trimmed"): descriptors advanced by offsets,
the mask behind one uniform branch a tile instead of a branch a score group, O rescaled only
when a row's running max moves by more than 2^8.

No GPU needed: the knob is named only when on (every other variant keeps its SASS), refused
with a reason where no pipelined wgmma loop runs, and its variants compile without spills, with
a shorter tile loop and fewer than half its branches. The GPU matrix (tests/test_backends_gpu.py,
"cupy:trim=1") checks results on an H200.
"""

from __future__ import annotations

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels import static_profile as sp
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS
from drafter_attn.kernels.spec import Problem
from tests.test_page_small import GPT_OSS, _compile, _defines


def test_knob_named_only_when_on_and_refused_off_the_pipelined_path():
    off = _defines(MAIN_PRESET, 64, 90, {"overlap": 2})
    on = _defines(MAIN_PRESET, 64, 90, {"overlap": 2, "trim": True})
    assert "TRIM" not in off and on.pop("TRIM") == 1 and on == off
    assert cb.tunables()["trim"] == [False, True]
    problem = Problem(PRESETS[MAIN_PRESET], "paged", 64, 32, 8192)
    assert registry.from_spec("cupy").params_for(problem, 90).trim is False  # opt-in
    assert registry.from_spec("cupy:trim=1").supports(problem, 90) is None
    for spec, words in (("cupy:trim=1,overlap=0", "needs overlap=1 or 2"),
                        ("cupy:trim=1,ws=2", "ws trims its consumers' loop with lean"),
                        ("cupy:trim=1,wgmma=0", "needs overlap=1 or 2")):
        assert words in registry.from_spec(spec).supports(problem, 90)
    with pytest.raises(ValueError, match="overlap=1 or 2"):
        _defines(MAIN_PRESET, 64, 90, {"trim": True})


# the pipelined path with cp.async tiles (lean, SM 90's default below batch 8) and with TMA (its
# default from batch 8 up), at page 16, 64, 128 and the arena, head_dim 64 and laguna's 48-row CTAs
CASES = [
    (MAIN_PRESET, 64, {"overlap": 2, "lean": True}), (MAIN_PRESET, 64, {"overlap": 2, "tma": True}),
    (MAIN_PRESET, 16, {"overlap": 2, "tma": True}), (MAIN_PRESET, 128, {"overlap": 2, "tma": True}),
    (MAIN_PRESET, None, {"overlap": 2, "tma": True}), (GPT_OSS, 64, {"overlap": 2, "tma": True}),
    ("laguna-dflash", 64, {"overlap": 2, "tma": True, "row_split": 3}),
]


@pytest.mark.parametrize("preset,page,params", CASES, ids=[
    f"{p[0]}-p{p[1]}-{'.'.join(p[2])}" for p in CASES])
def test_trim_compiles_without_spills_and_a_shorter_loop(cache_dir, preset, page, params):
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed")
    loops = {}
    for trim in (False, True):
        res = _compile(preset, page, 90, {**params, "trim": trim})
        assert res.spills == 0
        text = sp.sass_text(str(res.cubin_path), "drafter_attention")
        loops[trim] = sp.main_loop(sp.sass_instructions(text)["drafter_attention"])
    branches = {k: sum("BRA" in x["text"] for x in v) for k, v in loops.items()}
    assert branches[True] <= 0.6 * branches[False]
    if PRESETS[preset].head_dim == 128:  # at head_dim 64 ptxas, with 40 registers freed, schedules
        assert len(loops[True]) < 0.95 * len(loops[False])  # the loop about as long (+2%)
