"""CPU: the warp-specialised kernel, `cupy:ws=2` / `=3` / `=4` (kernels/cuda/warp_specialized.cuh).

Which shapes and knobs it takes (refused before any kernel runs, with the reason), the defines
and shared memory the host plans for it, and that its sm_90a variants compile (the two-consumer
ones and three consumers on 32-key tiles without spills; `lean`'s consumer loop, ws's default,
shorter and with no branch a score). The GPU matrix (tests/test_backends_gpu.py: "cupy:ws=2",
"=3", "=4", "cupy:ws=3,tile_n=32" in 6 and 9 stages, three of them with `lean=0` and three with
`early_ids=1`) checks its results on an H200.
"""

from __future__ import annotations

import re

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry, static_profile
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem


def _problem(preset=MAIN_PRESET, page=64, batch=1, ctx=8192):
    return Problem(get_preset(preset), "paged" if page else "arena", page, batch, ctx)


@pytest.mark.parametrize("ws", [2, 3])
def test_defaults_take_its_own_pipeline(ws):
    p = registry.from_spec(f"cupy:ws={ws}").params_for(_problem(), 90)
    assert (p.ws, p.stages, p.overlap, p.tma, p.lean, p.row_split) == (ws, cb.WS_STAGES, 0, False, True, 1)
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
    ("cupy:ws=2,wgmma=0", "runs on wgmma"),
    ("cupy:ws=2,tile_n=16", "tile_n 32-128"),
    # a consumer's 64 x 128 fp32 O is handed over through two of its 32-key stages
    ("cupy:ws=2,tile_n=32,stages=2", "two stages a consumer"),
    ("cupy:ws=4,stages=4", "two stages a consumer"),
    ("cupy:ws=4,stages=6", "multiple of its 4 consumers"),
    # the registry takes up to 12 stages for ws; the other paths stop at 8
    ("cupy:tile_n=16,stages=12", "2-8 stages"),
    ("cupy:tile_n=16,stages=9,wgmma=0", "2-8 stages"),
    ("cutlass:tile_n=16,stages=9", "stages 9 > 8"),
])
def test_refused_combinations_say_why(spec, words):
    assert words in registry.from_spec(spec).supports(_problem(), 90)


def test_only_sm90_and_only_2_or_3_consumers():
    assert "sm_90a" in registry.from_spec("cupy:ws=2").supports(_problem(), 100)
    for bad in (1, 5):
        with pytest.raises(ValueError, match="ws"):
            registry.from_spec(f"cupy:ws={bad}")
    assert cb.tunables()["ws"] == [0, 2, 3, 4]
    assert registry.from_spec("cupy").params_for(_problem(), 90).ws == 0  # opt-in


@pytest.mark.parametrize("ws", [2, 3])
def test_defines_and_shared_memory(ws):
    p = registry.from_spec(f"cupy:ws={ws}").params_for(_problem(), 90)
    d = cb.variant_defines("bfloat16", 128, 64, 16, 4, p, 90)
    assert (d["WARP_SPEC"], d["TMA_LOADS"], d["WS_CONSUMERS"], d["NUM_WARPS"], d["WGMMA"]) == (1, 1, ws, 4, 1)
    assert "OVERLAP" not in d and d["LEAN"] == 1  # the lean consumer loop, ws's default
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


def test_four_consumers_take_32_key_tiles_in_12_stages(cache_dir):
    """Four consumers hold a 64 x 128 fp32 O at 112 registers only beside 32-key tiles' scores;
    12 stages keep 192 KB of K/V in flight, and each consumer owns three, two of which carry its
    hand-over. ptxas compiles the 640-thread kernel at 96 registers (setmaxnreg gives the
    consumers 112); its lean consumer loop (the default) does not spill, where the loop without
    it spilled 80-116 bytes."""
    backend = registry.from_spec("cupy:ws=4")
    p = backend.params_for(_problem(), 90)
    assert (p.ws, p.tile_n, p.stages) == (4, 32, 12) and backend.supports(_problem(), 90) is None
    assert cb.ws_threads(4) == 640
    need = p.smem_bytes(128, 4, True, 64)
    assert need == 12 * 2 * 32 * 128 * 2 + 64 * 128 * 2 + 12 * 16 + 8 + 3 * 2048
    assert need <= cb.sm_budget(90).smem_block
    d = cb.variant_defines("bfloat16", 128, 64, 16, 4, p, 90)
    assert (d["WS_CONSUMERS"], d["TILE_N"], d["STAGES"]) == (4, 32, 12)
    res = cb.compile_variant(d, 90)
    attn = res.resources["drafter_attention"]
    assert res.arch == "sm_90a" and attn.registers <= 96 and res.spills == 0


@pytest.mark.parametrize("ws,regs", [(4, 120), (3, 168)])
def test_consumer_registers_past_what_the_producer_frees_do_not_compile(cache_dir, ws, regs):
    """setmaxnreg.inc waits until the CTA's pool has the registers, and only the producer's
    setmaxnreg.dec refills it: 4 consumers at 120 hung an H200 (640 x 96 at launch, 128 x 72
    given back, 512 x 24 asked for). The kernel refuses such a split at compile time."""
    p = registry.from_spec(f"cupy:ws={ws}").params_for(_problem(), 90)
    d = dict(cb.variant_defines("bfloat16", 128, 64, 16, 4, p, 90), WS_CONSUMER_REGS=regs)
    with pytest.raises(Exception, match="setmaxnreg.inc must fit"):
        cb.compile_variant(d, 90)


@pytest.mark.parametrize("stages", [6, 9])
def test_three_consumers_take_32_key_tiles_without_spills(cache_dir, stages):
    """At 160 registers three consumers spill 64-key tiles' loop, not 32-key tiles' (12 math
    warps an SM; the sm90 profile measures 6 and 9 stages)."""
    backend = registry.from_spec(f"cupy:ws=3,tile_n=32,stages={stages}")
    p = backend.params_for(_problem(), 90)
    assert backend.supports(_problem(), 90) is None
    res = cb.compile_variant(cb.variant_defines("bfloat16", 128, 64, 16, 4, p, 90), 90)
    assert res.spills == 0
    assert registry.from_spec("cupy:ws=4,stages=12").params_for(_problem(), 90).stages == 12


@pytest.mark.parametrize("spec,page", [("ws=3,tile_n=32,stages=9", 64), ("ws=3,tile_n=32", 16),
                                       ("ws=2", None), ("ws=4", 64)])
def test_lean_consumer_loop_is_shorter_and_branches_once_a_tile(cache_dir, spec, page):
    """`lean=1` builds the consumers' wgmma descriptors once (offsets added a stage and a k-step)
    and masks behind one uniform branch: the tile loop (static SASS) loses over 40% of its
    instructions and nearly all of its branches (16 a tile masked score by score before), and
    spills no more than without it (four consumers spill 80-116 bytes without it, none with it)."""
    from drafter_attn.kernels import static_profile as sp

    loops, spills = {}, {}
    for lean in (0, 1):
        p = registry.from_spec(f"cupy:{spec},lean={lean}").params_for(_problem(page=page), 90)
        assert p.lean == bool(lean) and p.ws
        d = cb.variant_defines("bfloat16", 128, page, 16, 4, p, 90)
        assert d.get("LEAN", 0) == lean and d["WARP_SPEC"] == 1
        res = cb.compile_variant(d, 90)
        text = sp.sass_text(res.cubin_path, "drafter_attention")
        if text is None:
            pytest.skip("cuobjdump is not installed")
        # the consumers' tile loop: the innermost loop that holds an HGMMA
        instrs = sp.sass_instructions(text)["drafter_attention"]
        best = []
        for ins in instrs:
            target = re.search(r"\bBRA (0x[0-9a-f]+)", ins["text"])
            if target and int(target[1], 16) < ins["addr"]:
                body = [x for x in instrs if int(target[1], 16) <= x["addr"] <= ins["addr"]]
                if any("HGMMA" in x["text"] for x in body) and (not best or len(body) < len(best)):
                    best = body
        loops[lean] = best
        spills[lean] = res.spills
    assert len(loops[1]) < 0.6 * len(loops[0])
    branches = {k: sum("BRA" in x["text"] for x in v) for k, v in loops.items()}
    assert branches[1] <= 20 < 100 < branches[0]
    assert spills[1] <= spills[0]


def test_early_ids_is_the_producers_and_named_only_when_on():
    """`early_ids` (opt-in): the EARLY_IDS define and 64 page ids (256 bytes) of shared memory on
    a ws variant; refused, with the reason, anywhere else; the ws variants without it keep their
    defines (and so their cubins and the profile's rows)."""
    plain = registry.from_spec("cupy:ws=3,tile_n=32,stages=9").params_for(_problem(), 90)
    early = registry.from_spec("cupy:ws=3,tile_n=32,stages=9,early_ids=1").params_for(_problem(), 90)
    d0 = cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)
    d1 = cb.variant_defines("bfloat16", 128, 64, 16, 4, early, 90)
    assert "EARLY_IDS" not in d0 and d1 == {**d0, "EARLY_IDS": 1}
    assert early.smem_bytes(128, 4, True, 64) == plain.smem_bytes(128, 4, True, 64) + 256
    assert cb.supports(_problem(), early, 90) is None
    assert "ws=2..4" in registry.from_spec("cupy:early_ids=1").supports(_problem(), 90)
    assert cb.tunables()["early_ids"] == [False, True]


@pytest.mark.parametrize("ws", ["ws=2", "ws=3,tile_n=32,stages=9", "ws=4"])
@pytest.mark.parametrize("page", [16, 64, 128, None])
def test_early_ids_variants_compile_without_spills(cache_dir, ws, page):
    """The producer keeps what the early copies need in its 24 registers (2 consumers) or 32
    (3-4, whose consumers leave it those): no spill at head_dim 128 on any page size. (gpt-oss's
    head_dim 64 at page 128 on 32-key tiles spills 8 bytes in the producer: a chunk address it
    reads back once every 32 pages.)"""
    p = registry.from_spec(f"cupy:{ws},early_ids=1").params_for(_problem(page=page), 90)
    res = cb.compile_variant(cb.variant_defines("bfloat16", 128, page, 16, 4, p, 90), 90)
    assert res.arch == "sm_90a" and res.spills == 0


def test_ws_rows_holds_a_splits_rows_in_one_cta():
    """`ws_rows` (opt-in): laguna's 144 rows in one CTA as 3 consumers of 48, a Q stage each, on
    32-key tiles in 6 stages (no row_split, none of the many-warp CTAs' q_smem); the WS_ROWS
    define only when on, so the other ws variants keep their cubins and profile rows."""
    g = get_preset("laguna-dflash")
    backend = registry.from_spec("cupy:ws=3,ws_rows=1")
    p = backend.params_for(_problem("laguna-dflash", batch=32), 90)
    assert (p.ws, p.ws_rows, p.row_split, p.tile_n, p.stages, p.q_smem, p.lean) == (
        3, True, 1, 32, cb.WS_STAGES, False, True)
    assert backend.supports(_problem("laguna-dflash", batch=32), 90) is None
    d = cb.variant_defines("bfloat16", 128, 64, g.block_size, g.group, p, 90)
    assert (d["WS_ROWS"], d["WS_CONSUMERS"], d["NUM_WARPS"], d["WGMMA"]) == (1, 3, 4, 1)
    assert "ROW_SPLIT" not in d and "Q_SMEM" in d and d["Q_SMEM"] == 0
    # 6 stages of 32-key K and V tiles, three Q stages, barriers, the (unused) row statistics
    assert p.smem_bytes(128, 9, True, 64) == (6 * 2 * 32 * 128 * 2 + 3 * 64 * 128 * 2 + 6 * 16 + 8
                                              + 2 * 2048)
    plain = registry.from_spec("cupy:ws=3,tile_n=32").params_for(_problem(), 90)
    assert "WS_ROWS" not in cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)
    assert cb.tunables()["ws_rows"] == [False, True]


@pytest.mark.parametrize("spec,preset,words", [
    ("cupy:ws_rows=1", "laguna-dflash", "ws=2..4"),
    # two consumers hold at most 128 rows
    ("cupy:ws=2,ws_rows=1", "laguna-dflash", "at most 64 packed query rows"),
    ("cupy:ws=3,ws_rows=1,row_split=3", "laguna-dflash", "row_split=3"),
])
def test_ws_rows_refusals_say_why(spec, preset, words):
    assert words in registry.from_spec(spec).supports(_problem(preset), 90)


@pytest.mark.parametrize("preset", ["laguna-dflash", "qwen3-coder-30b-dflash"])
@pytest.mark.parametrize("stages", [6, 9])
@pytest.mark.parametrize("page", [16, 64, None])
def test_ws_rows_variants_compile_without_spills(cache_dir, preset, stages, page):
    """Three consumers of up to 64 rows (laguna 3 x 48, qwen3-coder 43 + 43 + 42) keep ws=3's 160
    registers on 32-key tiles: no spill, sm_90a, 512 threads at 128 at launch."""
    g = get_preset(preset)
    p = registry.from_spec(f"cupy:ws=3,ws_rows=1,stages={stages}").params_for(
        _problem(preset, page=page), 90)
    res = cb.compile_variant(cb.variant_defines("bfloat16", 128, page, g.block_size, g.group, p, 90),
                             90)
    assert res.arch == "sm_90a" and res.spills == 0
    assert res.resources["drafter_attention"].registers <= 128


def test_ws_overlap_is_the_lean_loops_and_named_only_when_on():
    """`ws_overlap` (opt-in): the WS_OVERLAP define on a lean ws variant of 2-3 consumers, the
    other ws variants keeping their defines; refused, with the reason, without ws, without lean
    and with four consumers (whose registers hold no second tile)."""
    plain = registry.from_spec("cupy:ws=3,tile_n=32").params_for(_problem(), 90)
    over = registry.from_spec("cupy:ws=3,tile_n=32,ws_overlap=1").params_for(_problem(), 90)
    d0 = cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)
    assert cb.variant_defines("bfloat16", 128, 64, 16, 4, over, 90) == {**d0, "WS_OVERLAP": 1}
    assert over.smem_bytes(128, 4, True, 64) == plain.smem_bytes(128, 4, True, 64)
    for spec, words in (("cupy:ws_overlap=1", "ws=2..4"), ("cupy:ws=2,lean=0,ws_overlap=1", "lean=1"),
                        ("cupy:ws=4,ws_overlap=1", "four consumers")):
        assert words in registry.from_spec(spec).supports(_problem(), 90)
    assert cb.tunables()["ws_overlap"] == [False, True]


def test_q_step_is_wss_and_named_only_when_on():
    """`q_step` (opt-in): the Q_STEP define on a ws variant, the others keeping their defines;
    refused, with the reason, without ws."""
    plain = registry.from_spec("cupy:ws=3,tile_n=32,early_ids=1").params_for(_problem(), 90)
    step = registry.from_spec("cupy:ws=3,tile_n=32,early_ids=1,q_step=1").params_for(_problem(), 90)
    d0 = cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)
    assert cb.variant_defines("bfloat16", 128, 64, 16, 4, step, 90) == {**d0, "Q_STEP": 1}
    assert step.smem_bytes(128, 4, True, 64) == plain.smem_bytes(128, 4, True, 64)
    assert "ws=2..4" in registry.from_spec("cupy:q_step=1").supports(_problem(), 90)
    assert cb.tunables()["q_step"] == [False, True]


@pytest.mark.parametrize("spec,preset,page", [("ws=3,tile_n=32,stages=9,early_ids=1", MAIN_PRESET, 64),
                                              ("ws=3,tile_n=32,stages=9", MAIN_PRESET, None),
                                              ("ws=3,ws_rows=1,early_ids=1,ws_overlap=1", "laguna-dflash", 64),
                                              ("ws=2", "gpt-oss-20b-dflash", 16)])
def test_q_step_compiles_without_spills_and_unrolls_the_copies(cache_dir, spec, preset, page):
    """Q_STEP keeps the variant free of spills; where early_ids issues Q's copies before the
    CTA's first barrier, the code up to that barrier runs straight (every branch forward: the
    copies unrolled, one division in all), where the plain build loops over its rows with a
    division each."""
    g = get_preset(preset)
    loops = {}
    for extra in ("", ",q_step=1"):
        p = registry.from_spec(f"cupy:{spec}{extra}").params_for(_problem(preset, page=page), 90)
        res = cb.compile_variant(cb.variant_defines("bfloat16", 128, page, g.block_size, g.group, p, 90), 90)
        assert res.arch == "sm_90a" and res.spills == 0
        sass = static_profile.sass_text(res.cubin_path, "drafter_attention")
        instrs = re.findall(r"/\*([0-9a-f]{4})\*/\s+(.*?);", sass)
        barrier = next(i for i, (_, ins) in enumerate(instrs) if "BAR.SYNC" in ins)
        loops[extra] = [(a, ins) for a, ins in instrs[:barrier]
                        if (m := re.search(r"BRA (0x[0-9a-f]+)", ins)) and int(m.group(1), 16) <= int(a, 16)]
    if "early_ids" in spec:
        assert loops[""] and not loops[",q_step=1"], loops


@pytest.mark.parametrize("spec,preset", [("ws=2", MAIN_PRESET), ("ws=3,tile_n=32,early_ids=1", MAIN_PRESET),
                                         ("ws=3,ws_rows=1", "laguna-dflash"),
                                         ("ws=3,ws_rows=1,early_ids=1", "laguna-dflash")])
@pytest.mark.parametrize("page", [16, 64, None])
def test_ws_overlap_compiles_unserialised_without_spills(cache_dir, spec, preset, page):
    """The pipelined consumer loop keeps its wgmmas asynchronous: ptxas serialises all of a
    function's wgmmas (and says so in its log) where an ordinary instruction writes an accumulator
    while one is in flight or a wgmma sits in a branch, which is why S's accumulator is read once
    into other registers and the first tile's P V runs on a zero P instead of behind a branch."""
    g = get_preset(preset)
    p = registry.from_spec(f"cupy:{spec},ws_overlap=1").params_for(_problem(preset, page=page), 90)
    res = cb.compile_variant(cb.variant_defines("bfloat16", 128, page, g.block_size, g.group, p, 90),
                             90)
    assert res.arch == "sm_90a" and res.spills == 0
    assert "serialized" not in res.log and "ptxas info" in res.log


def test_pair_is_wss_and_named_only_when_on():
    """`pair` (opt-in): the WS_PAIR define on a ws variant, the others keeping their defines, and
    shared memory for the pair's barrier and the 32 rows the peer sends (fp32 O, maxima, sums: a
    float4 a fragment for each of 64 threads); refused, with the reason, without ws, with rows
    dealt over CTAs or consumers, and at an odd forced split count."""
    plain = registry.from_spec("cupy:ws=3,tile_n=32,early_ids=1").params_for(_problem(), 90)
    pair = registry.from_spec("cupy:ws=3,tile_n=32,early_ids=1,pair=1").params_for(_problem(), 90)
    d0 = cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)
    assert cb.variant_defines("bfloat16", 128, 64, 16, 4, pair, 90) == {**d0, "WS_PAIR": 1}
    for head_dim in (64, 128):
        extra = pair.smem_bytes(head_dim, 4, True, 64) - plain.smem_bytes(head_dim, 4, True, 64)
        assert extra == 8 + 64 * 16 * (head_dim // 8 + 1)
    assert cb.module_smem({**d0, "WS_PAIR": 1}) == pair.smem_bytes(128, 4, True, 64)
    for spec, preset, words in (("cupy:pair=1", MAIN_PRESET, "ws=2..4"),
                                ("cupy:ws=3,ws_rows=1,pair=1", "laguna-dflash", "ws_rows"),
                                ("cupy:ws=3,tile_n=32,pair=1", "laguna-dflash", "row_split"),
                                ("cupy:ws=3,tile_n=32,pair=1,num_splits=3", MAIN_PRESET, "odd")):
        assert words in registry.from_spec(spec).supports(_problem(preset), 90), spec
    assert registry.from_spec("cupy:ws=3,tile_n=32,pair=1,num_splits=4").supports(_problem(), 90) is None
    assert cb.tunables()["pair"] == [False, True]


@pytest.mark.parametrize("spec,preset,page", [("ws=3,tile_n=32,stages=6,early_ids=1,one_trip=1", MAIN_PRESET, 64),
                                              ("ws=3,tile_n=32,stages=9,early_ids=1,q_step=1", MAIN_PRESET, None),
                                              ("ws=2,stages=4", "gpt-oss-20b-dflash", 16)])
def test_pair_compiles_without_spills_and_meets_its_peer_in_the_cluster(cache_dir, spec, preset, page):
    """The paired variant compiles for sm_90a without spills (the arena's early ids beside it
    included), with the cluster barrier's arrive and wait, which the unpaired build has none
    of, and sends the peer's rows by st.async (STAS, a fragment and the maxima and sums), with
    no fence at GPU scope; the tile loop is the unpaired one's (as many wgmmas)."""
    g = get_preset(preset)
    counts = {}
    for extra in ("", ",pair=1"):
        p = registry.from_spec(f"cupy:{spec}{extra}").params_for(_problem(preset, page=page), 90)
        res = cb.compile_variant(cb.variant_defines("bfloat16", g.head_dim, page, g.block_size, g.group,
                                                    p, 90), 90)
        assert res.arch == "sm_90a" and res.spills == 0
        sass = static_profile.sass_text(res.cubin_path, "drafter_attention")
        counts[extra] = {op: len(re.findall(op, sass))
                         for op in ("UCGABAR_ARV", "UCGABAR_WAIT", "HGMMA", "MEMBAR.ALL.GPU", "STAS")}
    assert counts[""]["UCGABAR_ARV"] == counts[""]["UCGABAR_WAIT"] == counts[""]["STAS"] == 0
    paired = counts[",pair=1"]
    assert paired["UCGABAR_ARV"] == paired["UCGABAR_WAIT"] == 1
    assert paired["HGMMA"] == counts[""]["HGMMA"]
    assert paired["MEMBAR.ALL.GPU"] == 0 and paired["STAS"] == g.head_dim // 8 + 1
