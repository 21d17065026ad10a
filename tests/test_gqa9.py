"""CPU: the sm_90a wgmma path for CTAs that are not whole warpgroups (issue 12, "GQA 9";
results/perf-notes.md, "GQA 9 on the wgmma path"). laguna-dflash packs Qb * G = 16 * 9 = 144
query rows per CTA: 9 warps of 16 rows on mma.sync, or, forced with `cupy:wgmma=1`, 3 warpgroups
(12 warps, 3 x 64 row slots, the last 48 zero rows that are never stored) whose 384 threads
load a tile's chunks with a predicated last iteration. No GPU needed:

- the parameter logic: the default stays mma.sync (opt-in until measured), `wgmma=1` takes
  32-key tiles in 8 stages with Q in registers at 12 warps, supports() refuses what the path
  cannot take, with a reason;
- sm_90a compiles of the forced variants: no spills within the 168 registers a thread of a
  384-thread CTA gets, warpgroup MMAs (HGMMA), no trap, no serialized wgmma, and the tile loop's
  loads (2 LDGSTS per K/V load iteration, one page-id load, also at pages 8 and 16, which no
  wgmma fence waits for);
- the load and row mappings on the host: tests/test_page_small.py's layout cases at 12 warps
  (tests/drafter_layout_check.cu: every chunk once, warp-uniform predicate, every output
  element of the M rows stored once, padding rows never).
The GPU matrix (tests/test_backends_gpu.py, `test_padded_wgmma_*`) checks results on an H200.
"""

from __future__ import annotations

import re

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc, registry
from drafter_attn.kernels import static_profile as sp
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Geometry, Problem

LAGUNA = PRESETS["laguna-dflash"]
GQA12 = Geometry(96, 8, 128, 16, "sliding_causal", 512)  # 192 rows: 12 warps, not padded
GQA9_D64 = Geometry(36, 4, 64, 16, "sliding_causal", 512)
QB12_G9 = Geometry(36, 4, 128, 12)  # 108 rows: 7 warps -> 2 warpgroups
FORCED = registry.from_spec("cupy:wgmma=1")


def _problem(g: Geometry, page: int | None = 64) -> Problem:
    return Problem(g, "paged" if page else "arena", page, 32, 8192)


def _defines(g: Geometry, page: int | None, params: cb.Params, sm: int = 90) -> dict:
    return cb.variant_defines(g.dtype, g.head_dim, page, g.block_size, g.group, params, sm)


# -- parameters ---------------------------------------------------------------------------------


def test_warp_counts():
    assert cb.num_warps(16, 9) == 9 and cb.num_warps(16, 9, wgmma=True) == 12
    assert cb.num_warps(16, 12) == cb.num_warps(16, 12, wgmma=True) == 12
    assert cb.num_warps(12, 9) == 7 and cb.num_warps(12, 9, wgmma=True) == 8
    # whole warpgroups already: the same count (those variants do not change)
    for bs, g in ((16, 4), (16, 8), (8, 8), (10, 4), (1, 1), (4, 16), (16, 16)):
        assert cb.num_warps(bs, g) == cb.num_warps(bs, g, wgmma=True), (bs, g)


def test_laguna_default_deals_its_rows_over_three_ctas_on_sm90_only():
    """SM 90 runs 9-12 warps as ceil(rows / 64) one-warpgroup CTAs on the pipelined path by
    default (measured faster on the H200 than the padded path, itself faster than mma.sync,
    scripts/gpu_row_split.sh); `wgmma=True` keeps the padded path; other SMs, and
    `wgmma=False`, keep the 9-warp mma.sync variant."""
    for sm in (90, None):  # None: SM 90's defaults
        p = cb.default_params(_problem(LAGUNA), sm)
        assert p == cb.Params(overlap=cb.DEFAULT_OVERLAP, tma=True, row_split=3), p
        d = _defines(LAGUNA, 64, p)
        assert (d["WGMMA"], d["NUM_WARPS"], d["ROW_SPLIT"]) == (1, 4, 3)
        for geom in (GQA12, GQA9_D64):
            assert cb.default_params(_problem(geom), sm).row_split == 3
        assert cb.default_params(_problem(QB12_G9), sm).row_split == 1  # 7 warps: as before
    p = cb.default_params(_problem(LAGUNA), 90, wgmma=True)
    assert p == cb.Params(**cb.PADDED_WGMMA, wgmma=True), p
    assert (_defines(LAGUNA, 64, p)["NUM_WARPS"], p.row_split) == (12, 1)
    for sm in (80, 100, 120):
        p = cb.default_params(_problem(LAGUNA), sm)
        assert p == cb.Params(16, 6, q_smem=True), (sm, p)
        assert _defines(LAGUNA, 64, p, sm)["NUM_WARPS"] == 9
    p = cb.default_params(_problem(LAGUNA), 90, wgmma=False)
    assert p == cb.Params(16, 6, q_smem=True, wgmma=False), p
    # an override the one-warpgroup wgmma path does not take (16-key tiles) keeps 9-warp mma.sync
    p = cb.default_params(_problem(LAGUNA), 90, tile_n=16)
    assert p.wgmma is None and p.row_split == 1 and _defines(LAGUNA, 64, p)["WGMMA"] == 0
    # whole warpgroups are unaffected
    main = Geometry(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    assert cb.default_params(_problem(main), 90).wgmma is None


@pytest.mark.parametrize("geom", [LAGUNA, GQA12, GQA9_D64], ids=["laguna", "gqa12", "gqa9-d64"])
@pytest.mark.parametrize("page", [8, 16, 64, None])
def test_forced_takes_three_warpgroups(geom, page):
    p = FORCED.params_for(_problem(geom, page), 90)
    assert p == cb.Params(**cb.PADDED_WGMMA, wgmma=True), p  # no overlap: it spills here
    assert (p.tile_n, p.stages, p.q_smem, p.overlap) == (32, 8, False, 0)
    d = _defines(geom, page, p)
    assert (d["WGMMA"], d["NUM_WARPS"], d["TILE_N"], d["STAGES"], d["Q_SMEM"]) == (1, 12, 32, 8, 0)
    assert "OVERLAP" not in d
    assert FORCED.supports(_problem(geom, page), 90) is None
    assert FORCED.supports(_problem(geom, page)) is None
    # 8 stages of 32 keys x head_dim, K and V: 128 KB at head_dim 128
    assert p.smem_bytes(geom.head_dim, 9, True) == 2 * 8 * 32 * geom.head_dim * 2


def test_forced_two_warpgroups_keep_the_pipelined_defaults():
    """108 rows: 7 warps padded to 8, whose tile loads divide (the 8-warp code of qwen3-coder)."""
    p = FORCED.params_for(_problem(QB12_G9), 90)
    # (and, at this batch, TMA tile loads: the pipelined defaults' from TMA_MIN_BATCH up)
    assert p == cb.Params(overlap=cb.DEFAULT_OVERLAP, wgmma=True,
                          tma=_problem(QB12_G9).batch >= cb.TMA_MIN_BATCH), p
    d = _defines(QB12_G9, 64, p)
    assert (d["NUM_WARPS"], d["TILE_N"], d["OVERLAP"]) == (8, 64, cb.DEFAULT_OVERLAP)
    # the default of that shape: mma.sync, 7 warps
    assert _defines(QB12_G9, 64, cb.default_params(_problem(QB12_G9), 90))["WGMMA"] == 0


def test_refusals_name_the_reason():
    lag = _problem(LAGUNA)
    for sm in (80, 100, 103, 120):
        reason = FORCED.supports(lag, sm)
        assert reason == f"wgmma=1 needs the sm_90a wgmma path, which SM {sm} does not have"
    reason = registry.from_spec("cupy:wgmma=1,tile_n=16").supports(lag, 90)
    assert reason and "tile_n 32/64/128" in reason
    with pytest.raises(ValueError, match="wgmma=True needs sm_90"):
        _defines(LAGUNA, 64, cb.Params(tile_n=16, wgmma=True))
    with pytest.raises(ValueError, match="wgmma=True needs sm_90"):
        _defines(LAGUNA, 64, cb.Params(tile_n=32, wgmma=True), sm=100)
    # 16 warps whose tile loads do not divide: not offered (128 registers a thread)
    g16 = Geometry(32, 2, 64, 16)  # 256 rows, head_dim 64
    reason = registry.from_spec("cupy:wgmma=1,tile_n=32").supports(_problem(g16), 90)
    assert reason and "at most 12 warps" in reason
    # ... but 16 warps with whole loads stay as before (wgmma_fits)
    assert registry.from_spec("cupy:wgmma=1,tile_n=64").supports(_problem(g16), 90) is None
    # overlap on 9 warps: on SM 90 the padded default path takes it; with mma.sync it is refused
    assert registry.from_spec("cupy:overlap=1").supports(lag, 90) is None
    reason = registry.from_spec("cupy:overlap=1,tile_n=16").supports(lag, 90)
    assert reason and "overlap=1 needs the sm_90a wgmma path" in reason and "9 warps" in reason
    # forced and pipelined: offered (it spills a few bytes: a tuning choice, never a default)
    assert registry.from_spec("cupy:wgmma=1,overlap=2").supports(lag, 90) is None


def test_q_in_shared_memory_holds_the_padded_rows():
    p = cb.Params(tile_n=32, stages=4, q_smem=True, wgmma=True)
    kv = 2 * 4 * 32 * 128 * 2
    assert p.smem_bytes(128, 9, True) == kv + 12 * 16 * 136 * 2  # 192 rows, padded
    assert p.smem_bytes(128, 9, False) == 2 * 4 * 32 * 136 * 2 + 9 * 16 * 136 * 2
    d = _defines(LAGUNA, 64, p)
    assert cb.smem_bytes(d["TILE_N"], d["STAGES"], 128, d["NUM_WARPS"], True) == p.smem_bytes(
        128, 9, True)


# -- sm_90a compiles ----------------------------------------------------------------------------

SERIALIZED = re.compile(r"wgmma[^\n]*(serialized|injected)", re.I)
# (geometry, page or None for the arena, params over the forced defaults, load iterations)
CASES = [
    (LAGUNA, 64, {}, 2), (LAGUNA, 128, {}, 2), (LAGUNA, None, {}, 2), (LAGUNA, 16, {}, 2),
    (LAGUNA, 8, {}, 2), (LAGUNA, 32, {}, 2), (LAGUNA, 64, dict(skip_compute=True), 2),
    (LAGUNA.with_(dtype="float16"), 64, {}, 2), (GQA12, 16, {}, 2), (GQA9_D64, 64, {}, 1),
    (GQA9_D64, 16, dict(tile_n=64, stages=4), 2),
]


def _id(case) -> str:
    g, page, params, _ = case
    return (f"g{g.group}-d{g.head_dim}-{g.dtype[:4]}-{f'page{page}' if page else 'arena'}-"
            + ",".join(f"{k}={int(v)}" for k, v in params.items()))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_forced_variants_compile_without_spills(cache_dir, case):
    geom, page, params, iters = case
    try:
        nvrtc.supported_sms()
        nvrtc.cuda_include_dir()
    except nvrtc.CompileError as exc:
        pytest.skip(f"no NVRTC toolchain here: {exc}")
    p = FORCED.with_params(**params).params_for(_problem(geom, page), 90)
    defines = _defines(geom, page, p)
    assert defines["NUM_WARPS"] == 12 and defines["WGMMA"] == 1
    res = cb.compile_variant(defines, 90)
    attn = res.resources["drafter_attention"]
    assert attn.spill_store_bytes == attn.spill_load_bytes == attn.stack_bytes == 0, attn
    assert attn.registers <= 168, attn  # 384 threads, one CTA per SM: 65536 / 384 -> 168
    assert not SERIALIZED.findall(res.log), [l for l in res.log.splitlines() if "wgmma" in l]
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump "
                    "nvidia-cuda-nvdisasm)")
    text = sp.sass_text(str(res.cubin_path), "drafter_attention")
    summary = sp.parse_sass(text)["drafter_attention"]
    assert summary["traps"] == 0, summary
    loads = sp.loop_global_loads(text)
    assert loads["ldgsts"] == 2 * iters, loads  # K and V per load iteration, the last predicated
    if p.skip_compute:
        return
    assert "HGMMA" in summary["mma"].split("+"), summary
    # one page-id (or slot) load per thread and tile, also at pages smaller than a tile (lane j
    # looks up the page of load iteration j, LANE_IDS), and no wgmma fence waits for it
    assert loads["ldg"] == 1, loads
    assert loads["arrive"] >= 2 and loads["arrive_waits_on_ldg"] == 0, loads
