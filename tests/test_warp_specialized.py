"""CPU: the warp-specialised kernel, `cupy:ws=2` / `=3` (kernels/cuda/warp_specialized.cuh).

Which shapes and knobs it takes (refused before any kernel runs, with the reason), the defines
and shared memory the host plans for it, and that its sm_90a variants compile (the two-consumer
ones without spills). The GPU matrix (tests/test_backends_gpu.py, "cupy:ws=2", "cupy:ws=3")
checks its results on an H200.
"""

from __future__ import annotations

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem


def _problem(preset=MAIN_PRESET, page=64, batch=1, ctx=8192):
    return Problem(get_preset(preset), "paged" if page else "arena", page, batch, ctx)


@pytest.mark.parametrize("ws", [2, 3])
def test_defaults_take_its_own_pipeline(ws):
    p = registry.from_spec(f"cupy:ws={ws}").params_for(_problem(), 90)
    assert (p.ws, p.stages, p.overlap, p.tma, p.lean, p.row_split) == (ws, cb.WS_STAGES, 0, False, False, 1)
    assert cb.supports(_problem(), p, 90) is None


@pytest.mark.parametrize("preset,rows_per_cta", [("laguna-dflash", 48), ("qwen3-coder-30b-dflash", 64)])
def test_more_than_64_rows_are_dealt_over_ctas(preset, rows_per_cta):
    backend = registry.from_spec("cupy:ws=2")
    p = backend.params_for(_problem(preset), 90)
    g = get_preset(preset)
    assert cb.cta_rows(g.block_size, g.group, p.row_split) == rows_per_cta
    assert backend.supports(_problem(preset), 90) is None
    # pinned to one CTA the rows do not fit one consumer warpgroup
    reason = registry.from_spec("cupy:ws=2,row_split=1").supports(_problem(preset), 90)
    assert reason and "at most 64 packed query rows" in reason


@pytest.mark.parametrize("spec,words", [
    ("cupy:ws=2,stages=3", "multiple of its 2 consumers"),
    ("cupy:ws=3,stages=4", "multiple of its 3 consumers"),
    ("cupy:ws=2,tma=1", "loads its own tiles"),
    ("cupy:ws=2,overlap=2", "loads its own tiles"),
    ("cupy:ws=2,lean=1", "loads its own tiles"),
    ("cupy:ws=2,wgmma=0", "runs on wgmma"),
    ("cupy:ws=2,tile_n=32", "tile_n 64/128"),  # the hand-over needs a stage of 64 keys
])
def test_refused_combinations_say_why(spec, words):
    assert words in registry.from_spec(spec).supports(_problem(), 90)


def test_only_sm90_and_only_2_or_3_consumers():
    assert "sm_90a" in registry.from_spec("cupy:ws=2").supports(_problem(), 100)
    with pytest.raises(ValueError, match="ws"):
        registry.from_spec("cupy:ws=1")
    assert cb.tunables()["ws"] == [0, 2, 3]
    assert registry.from_spec("cupy").params_for(_problem(), 90).ws == 0  # opt-in


@pytest.mark.parametrize("ws", [2, 3])
def test_defines_and_shared_memory(ws):
    p = registry.from_spec(f"cupy:ws={ws}").params_for(_problem(), 90)
    d = cb.variant_defines("bfloat16", 128, 64, 16, 4, p, 90)
    assert (d["WARP_SPEC"], d["TMA_LOADS"], d["WS_CONSUMERS"], d["NUM_WARPS"], d["WGMMA"]) == (1, 1, ws, 4, 1)
    assert "OVERLAP" not in d and "LEAN" not in d
    # 6 stages of 64-key K and V tiles, the Q stage, barriers and the hand-over's row statistics
    need = p.smem_bytes(128, 4, True, 64)
    assert need == 6 * 2 * 64 * 128 * 2 + 64 * 128 * 2 + 6 * 16 + 8 + (ws - 1) * 2048
    assert need <= cb.sm_budget(90).smem_block
    assert cb.ws_threads(ws) == 128 * (1 + ws)
    assert p.tensor_maps and registry.from_spec("cupy:tma=1").params_for(_problem(), 90).tensor_maps
    assert not registry.from_spec("cupy").params_for(_problem(), 90).tensor_maps


@pytest.mark.parametrize("page,head_dim", [(8, 128), (16, 128), (64, 128), (128, 128), (None, 128),
                                           (16, 64)])
def test_two_consumer_variants_compile_without_spills(cache_dir, page, head_dim):
    preset = "gpt-oss-20b-dflash" if head_dim == 64 else MAIN_PRESET
    g = get_preset(preset)
    p = registry.from_spec("cupy:ws=2").params_for(_problem(preset, page), 90)
    res = cb.compile_variant(cb.variant_defines("bfloat16", head_dim, page, g.block_size, g.group,
                                                p, 90), 90)
    attn = res.resources["drafter_attention"]
    assert res.arch == "sm_90a" and res.spills == 0
    assert attn.registers <= 168  # 384 threads, one CTA an SM (setmaxnreg moves them per warpgroup)


def test_three_consumer_variant_compiles(cache_dir):
    p = registry.from_spec("cupy:ws=3").params_for(_problem(), 90)
    res = cb.compile_variant(cb.variant_defines("float16", 128, 16, 16, 4, p, 90), 90)
    assert res.resources["drafter_attention"].registers <= 128  # 512 threads


# ---- ws_rows: the consumers of one CTA split its rows, each reading every tile

GQA12 = "qwen3-coder-30b-dflash"  # 128 rows: two consumers of 64


@pytest.mark.parametrize("spec,preset,rows", [("cupy:ws=3,ws_rows=1", "laguna-dflash", 144),
                                              ("cupy:ws=2,ws_rows=1", GQA12, 128)])
def test_ws_rows_keep_the_rows_in_one_cta(spec, preset, rows):
    backend = registry.from_spec(spec)
    p = backend.params_for(_problem(preset), 90)
    g = get_preset(preset)
    assert g.block_size * g.group == rows
    assert (p.ws_rows, p.row_split, p.tile_n, p.stages, p.q_smem) == (True, 1, 64, cb.WS_ROWS_STAGES, False)
    assert backend.supports(_problem(preset), 90) is None
    assert backend.supports(_problem(preset, None), 90) is None  # the arena too
    d = cb.variant_defines(g.dtype, g.head_dim, 64, g.block_size, g.group, p, 90)
    # a consumer is one warpgroup; its rows come from row_share in the kernel
    assert (d["WS_ROWS"], d["WS_CONSUMERS"], d["NUM_WARPS"], d["TILE_N"]) == (1, p.ws, 4, 64)
    assert "ROW_SPLIT" not in d
    # a Q stage a consumer, no hand-over
    need = p.smem_bytes(g.head_dim, 9, True, 64)
    assert need == cb.ws_bytes(64, cb.WS_ROWS_STAGES, g.head_dim, p.ws, rows=True)
    assert need == 4 * 2 * 64 * 128 * 2 + p.ws * 64 * 128 * 2 + 4 * 16 + 8
    assert need <= cb.sm_budget(90).smem_block
    # the ws variants without ws_rows keep their defines
    plain = registry.from_spec("cupy:ws=2").params_for(_problem(), 90)
    assert "WS_ROWS" not in cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)


@pytest.mark.parametrize("spec,preset,words", [
    ("cupy:ws=3,ws_rows=1", MAIN_PRESET, "129-192 packed query rows"),  # 64 rows: one consumer's
    ("cupy:ws=2,ws_rows=1", "laguna-dflash", "65-128 packed query rows"),  # 144 need three
    ("cupy:ws=3,ws_rows=1", GQA12, "129-192 packed query rows"),  # a consumer would idle
    ("cupy:ws=3,ws_rows=1,row_split=3", "laguna-dflash", "row_split must be 1"),
    ("cupy:ws_rows=1", "laguna-dflash", "ws_rows needs ws"),
])
def test_ws_rows_refusals_say_why(spec, preset, words):
    assert words in registry.from_spec(spec).supports(_problem(preset), 90)


def test_ws_rows_is_a_tunable_and_not_a_default():
    assert cb.tunables()["ws_rows"] == [False, True]
    for preset in ("laguna-dflash", GQA12):
        assert not registry.from_spec("cupy").params_for(_problem(preset), 90).ws_rows


@pytest.mark.parametrize("ws,preset,page,dtype,spill_max", [
    (3, "laguna-dflash", 64, "bfloat16", 128), (3, "laguna-dflash", None, "float16", 128),
    (3, "laguna-dflash", 8, "bfloat16", 128), (2, GQA12, 16, "bfloat16", 0)])
def test_ws_rows_variants_compile(cache_dir, ws, preset, page, dtype, spill_max):
    """Three consumers (ptxas compiles the kernel at 128 registers for 512 threads) spill up to
    120 bytes a thread at head_dim 128 (NVRTC 13.5); two compile without spills."""
    g = get_preset(preset)
    p = registry.from_spec(f"cupy:ws={ws},ws_rows=1").params_for(_problem(preset, page), 90)
    res = cb.compile_variant(cb.variant_defines(dtype, g.head_dim, page, g.block_size, g.group,
                                                p, 90), 90)
    attn = res.resources["drafter_attention"]
    assert res.arch == "sm_90a" and attn.spill_store_bytes <= spill_max
    assert attn.registers <= (128 if ws == 3 else 168)
    if ws == 2:
        assert res.spills == 0
