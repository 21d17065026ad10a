"""CPU: a (request, KV head)'s packed query rows dealt over several CTAs (`row_split`,
kernels/cuda/drafter_attention.cu ROW_SPLIT; issue 12). laguna-dflash packs 16 x 9 = 144 rows,
which one CTA holds only as 3 warpgroups (the padded path, one CTA an SM); `row_split=3` runs
them as 3 CTAs of 48 rows, each the one-warpgroup pipelined path the main preset takes (two CTAs
an SM), the three reading the same K/V (the second and third from L2). No GPU needed:

- the row shares and the warps they take, and what supports() refuses, with the reason;
- the defaults a row-split variant gets (the 4-warp pipelined path, TMA from batch 8 up);
- the compile-time knob (named only when on, so every other variant keeps its SASS:
  tests/test_page_small.py's sass_unchanged cases);
- sm_90a and sm_100 compiles without spills;
- the planned launch: a split's CTAs adjacent in x, and the split model counting them all.
The GPU matrix (tests/test_backends_gpu.py, `test_row_split_*`) checks results on an H200.
"""

from __future__ import annotations

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc, registry
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Geometry, Problem
from tests.test_ops import HKV, HQ, QB, _plan, planning, trtllm_pool_case  # noqa: F401 (fixture)

LAGUNA = PRESETS["laguna-dflash"]
MAIN = PRESETS["qwen3-8b-dflash-b16"]
QB12_G9 = Geometry(36, 4, 128, 12)  # 108 rows


def _problem(g: Geometry, batch: int = 32, page: int | None = 64) -> Problem:
    return Problem(g, "paged" if page else "arena", page, batch, 8192)


def _defines(g: Geometry, page: int | None, params: cb.Params, sm: int = 90) -> dict:
    return cb.variant_defines(g.dtype, g.head_dim, page, g.block_size, g.group, params, sm)


def test_row_shares_and_warps():
    assert cb.cta_rows(16, 9) == 144 and cb.cta_rows(16, 9, 3) == 48
    assert cb.cta_rows(12, 9, 3) == 36 and cb.cta_rows(16, 4, 3) == 22  # the last CTA: 20
    assert cb.num_warps(16, 9) == 9 and cb.num_warps(16, 9, row_split=3) == 4
    assert cb.num_warps(16, 9, row_split=2) == 5  # 72 rows
    assert cb.num_warps(16, 12, wgmma=True, row_split=3) == 4  # GQA 12: 3 x 64 rows, no padding
    for bs, g in [(16, 9), (16, 4), (12, 9), (8, 8), (2, 1)]:
        assert cb.num_warps(bs, g) == cb.num_warps(bs, g, row_split=1)


def test_refused_shares_say_why():
    assert cb.row_split_reason(16, 9, 3) is None
    assert "at least 1" in cb.row_split_reason(16, 9, 0)
    # 2 rows over 3 CTAs: a share of 1, the third CTA would hold none
    assert "without rows" in cb.row_split_reason(2, 1, 3)
    tiny = Geometry(8, 8, 128, 2)
    backend = registry.from_spec("cupy:row_split=3")
    assert "without rows" in backend.supports(_problem(tiny, 1), 90)
    assert registry.from_spec("cupy:row_split=2").supports(_problem(tiny, 1), 90) is None
    with pytest.raises(ValueError, match="without rows"):
        _defines(tiny, 64, cb.Params(row_split=3))


@pytest.mark.parametrize("page", [16, 64, 128, None])
def test_laguna_row_split_takes_the_pipelined_four_warp_path(page):
    backend = registry.from_spec("cupy:row_split=3")
    p = backend.params_for(_problem(LAGUNA, 32, page), 90)
    assert p == cb.Params(overlap=cb.DEFAULT_OVERLAP, tma=True, row_split=3), p
    d = _defines(LAGUNA, page, p)
    assert (d["NUM_WARPS"], d["WGMMA"], d["TILE_N"], d["ROW_SPLIT"]) == (4, 1, 64, 3)
    assert backend.supports(_problem(LAGUNA, 32, page), 90) is None
    # below TMA_MIN_BATCH the pipelined path loads by cp.async (lean), as the main preset's
    p1 = backend.params_for(_problem(LAGUNA, 1, page), 90)
    assert p1 == cb.Params(overlap=cb.DEFAULT_OVERLAP, row_split=3, combine=p1.combine,
                           lean=True), p1
    # on SMs without wgmma: mma.sync with 4 warps and the SM's own pipeline
    p100 = backend.params_for(_problem(LAGUNA, 32, page), 100)
    d100 = _defines(LAGUNA, page, p100, 100)
    assert (d100["NUM_WARPS"], d100["WGMMA"], d100["ROW_SPLIT"]) == (4, 0, 3)
    assert backend.supports(_problem(LAGUNA, 32, page), 100) is None


def test_the_knob_is_named_only_when_on():
    p = cb.default_params(_problem(MAIN), 90)
    assert p.row_split == 1 and "ROW_SPLIT" not in _defines(MAIN, 64, p)
    assert cb.default_params(_problem(LAGUNA), 100).row_split == 1  # SM 90's default only
    assert "row_split" in cb.tunables() and 3 in cb.tunables()["row_split"]


@pytest.mark.parametrize("geom,page,spec,sm", [
    (LAGUNA, 64, "cupy:row_split=3", 90),
    (LAGUNA, 16, "cupy:row_split=3", 90),
    (LAGUNA, None, "cupy:row_split=3,tma=0", 90),
    (QB12_G9, 64, "cupy:row_split=3", 90),
    (LAGUNA, 64, "cupy:row_split=3", 100),
    (LAGUNA, 64, "cupy:row_split=2", 90),  # 72 rows: 5 mma.sync warps
], ids=["laguna-p64", "laguna-p16", "laguna-arena-cpasync", "qb12g9", "laguna-sm100", "rs2"])
def test_row_split_variants_compile_without_spills(cache_dir, geom, page, spec, sm):
    try:
        nvrtc.supported_sms()
        nvrtc.cuda_include_dir()
    except nvrtc.CompileError as exc:
        pytest.skip(f"no NVRTC toolchain here: {exc}")
    p = registry.from_spec(spec).params_for(_problem(geom, 32, page), sm)
    defines = _defines(geom, page, p, sm)
    res = cb.compile_variant(defines, sm)
    attn = res.resources["drafter_attention"]
    assert attn.spill_store_bytes == attn.spill_load_bytes == attn.stack_bytes == 0, attn


def test_planned_grid_deals_a_splits_rows_over_adjacent_ctas(planning):
    """The launch a planned call makes (tests/test_ops.py's CPU planning: a 132-SM sm_90, stand-in
    modules): x = splits x row_split, and choose_splits sees row_split x the CTAs."""
    cb_, backend = planning
    case, _ = trtllm_pool_case("cpu", batch=1, max_pages=32, num_pages=40)
    rs = backend.with_params(row_split=2)
    _, plan = _plan(cb_, rs, case)
    # QB x G = 4 x 4 = 16 rows, 8 a CTA: still 4 warps of (stand-in) 128 registers
    assert plan.attention.block == (128, 1, 1)
    resident = cb_.Module(0, 0, 0, 60_000, 128, 128).resident_ctas()
    splits = cb_.choose_splits(1 * 2, HKV, 32 * 16, 64, 132, resident)
    assert plan.splits == splits
    assert plan.attention.grid == (2 * splits, HKV, 1)
    # the combine merges the same packed rows either way
    rows = HKV * QB * (HQ // HKV)
    assert plan.part_elems == splits * rows * 64
