"""Per-SM default parameters (kernels.cupy_backend.SM_BUDGETS), CPU only and without compiling:
SM 90's defaults are the ones measured on the H200, every other target gets the defaults its
static profile allows (tests/test_static_profile.py compiles them), and every path that runs
defaults uses the GPU's: the backend's planning, the store, the dispatcher's default tier, the
runtime, `bench decode --impl cupy` and a sweep's SM targets. A GPU that runs PTX gets the
defaults of the PTX's compute capability."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc, registry
from drafter_attn.kernels.dispatch import Dispatcher, Runtime
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS
from drafter_attn.kernels.spec import Geometry, Problem

NVRTC_13_5 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121)
NVRTC_13_0 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)
MAIN = Problem(PRESETS[MAIN_PRESET], "paged", 64, 8, 4096)
REAL_SUPPORTED_SMS = nvrtc.supported_sms  # before the autouse fixture below replaces it


@pytest.fixture(autouse=True)
def nvrtc_13_5(monkeypatch):
    """The targets of NVRTC 13.5, whatever is installed here (code_sm asks supported_sms)."""
    monkeypatch.setattr(nvrtc, "supported_sms", lambda: NVRTC_13_5)


def _problems():
    for name, geom in PRESETS.items():
        for page in (16, 64, 128, None):
            yield name, Problem(geom, "paged" if page else "arena", page, 1, 0)


def test_every_target_has_a_budget():
    assert set(cb.SM_BUDGETS) == {sm for sm in NVRTC_13_5 if sm >= nvrtc.MIN_SM}


@pytest.mark.parametrize("sm", [90, None])
def test_sm_90_defaults_are_the_measured_ones(sm):
    """What the H200 measured (and sm_90a compiles): 64-key tiles in 3 stages, software-pipelined
    where the wgmma path runs, with lean cp.async tiles below TMA's batch; above 8 warps the
    rows dealt over one-warpgroup CTAs of that path (`row_split`); cutlass 32 x 3 there. At
    batch 1 the split combine a CTA a row up to 1024 rows."""
    from drafter_attn.kernels import cutlass_backend as kb

    for name, problem in _problems():
        g = problem.geometry
        warps = cb.num_warps(g.block_size, g.group)
        pipelined = cb.DEFAULT_OVERLAP if cb.wgmma_fits(g.head_dim, warps, 64) else 0
        combine = 2 if g.block_size * g.num_q_heads <= cb.COMBINE_CTA_MAX_ROWS else 1
        want = (cb.Params(overlap=cb.DEFAULT_OVERLAP, combine=combine, row_split=3, lean=True)
                if warps > 8 else
                cb.Params(overlap=pipelined, combine=combine, lean=bool(pipelined)))
        assert cb.default_params(problem, sm) == want, name
        kwant = kb.Params(32, 3, q_smem=True) if warps > 8 else kb.Params()
        assert kb.default_params(problem, sm) == kwant, name
    assert cb.default_params(None, sm) == cb.Params()


@pytest.mark.parametrize("sm", [90, None])
def test_lean_is_sm_90s_default_only_on_cp_async_tiles(sm):
    """Lean where the pipelined tiles come by cp.async (batch 1-7 below TMA's context), not
    where TMA loads them (batch 8 up, or ctx 128k up), not off SM 90, and never against an
    override."""
    small, large = (Problem(PRESETS[MAIN_PRESET], "paged", 64, b, 8192) for b in (1, cb.TMA_MIN_BATCH))
    longer = Problem(PRESETS[MAIN_PRESET], "paged", 64, 1, cb.TMA_MIN_CTX)
    assert cb.default_params(small, sm).lean and not cb.default_params(small, sm).tma
    assert not cb.default_params(large, sm).lean and cb.default_params(large, sm).tma
    assert not cb.default_params(longer, sm).lean
    assert not cb.default_params(small, sm, lean=False).lean
    assert not cb.default_params(small, sm, wgmma=False).lean
    assert not cb.default_params(small, 100).lean


@pytest.mark.parametrize("sm", [100, 103, 80, 87])
def test_targets_with_room_keep_64_key_tiles(sm):
    assert cb.default_params(MAIN, sm) == cb.Params()


@pytest.mark.parametrize("sm,tile,stages", [(107, 32, 6), (110, 32, 6), (120, 32, 5),
                                            (121, 32, 5), (86, 32, 5), (89, 32, 5)])
def test_tight_targets_take_32_key_tiles(sm, tile, stages):
    p = cb.default_params(MAIN, sm)
    assert (p.tile_n, p.stages, p.q_smem) == (tile, stages, False)
    laguna = Problem(PRESETS["laguna-dflash"], "arena", None, 1, 0)  # 9 warps: as everywhere
    assert cb.default_params(laguna, sm) == cb.Params(16, 6, q_smem=True)


def test_every_default_fits_its_sms_shared_memory():
    from drafter_attn.kernels import cutlass_backend as kb

    for sm, budget in cb.SM_BUDGETS.items():
        for name, problem in _problems():
            g = problem.geometry
            warps = cb.num_warps(g.block_size, g.group)
            p = cb.default_params(problem, sm)
            assert p.smem_bytes(g.head_dim, warps) <= budget.smem_block, (sm, name, p)
            assert cb.supports(problem, None, sm) is None, (sm, name)
            k = kb.default_params(problem, sm)
            assert k.smem_bytes(g.head_dim, warps) <= budget.smem_block, (sm, name, k)
            assert kb.supports(problem, None, sm) is None, (sm, name)


def test_supports_checks_the_sms_shared_memory():
    big = cb.Params()  # 64 x 3 stages of head_dim 128: 102 KB
    assert cb.supports(MAIN, big) is None and cb.supports(MAIN, big, 90) is None
    reason = cb.supports(MAIN, big, 120)
    assert "104448 bytes of shared memory" in reason and "99 KB a CTA gets on SM 120" in reason
    backend = registry.get("cupy").with_params(tile_n=64, stages=3)
    assert "on SM 89" in registry.supports(backend, MAIN, 89)
    assert registry.supports(backend, MAIN) is None  # no GPU named: SM 90-class limits


def test_a_block_wider_than_the_tile_keeps_64_key_tiles():
    wide = Problem(PRESETS[MAIN_PRESET].with_(num_q_heads=16, num_kv_heads=8, block_size=48),
                   "paged", 64, 1, 0)  # 96 rows, 6 warps
    p = cb.default_params(wide, 120)
    assert p.tile_n == 64 and p.stages == 2  # 3 stages would not fit 99 KB
    assert cb.supports(wide, None, 120) is None


# -- the PTX route and unknown SMs ------------------------------------------------------------


@pytest.mark.parametrize("device_sm,supported,code", [
    (120, NVRTC_13_5, 120), (999, NVRTC_13_5, 121), (125, NVRTC_13_5, 121), (95, NVRTC_13_5, 90),
    (107, NVRTC_13_0, 103), (75, NVRTC_13_5, 75)])
def test_code_sm_follows_the_device_target(monkeypatch, device_sm, supported, code):
    monkeypatch.setattr(nvrtc, "supported_sms", lambda: supported)
    assert nvrtc.code_sm(device_sm) == code


def test_ptx_route_takes_the_defaults_of_its_compute_capability(monkeypatch):
    assert cb.sm_budget(999) == cb.SM_BUDGETS[121]
    assert cb.default_params(MAIN, 999) == cb.default_params(MAIN, 121)
    monkeypatch.setattr(nvrtc, "supported_sms", lambda: NVRTC_13_0)  # predates SM 107
    assert cb.default_params(MAIN, 107) == cb.default_params(MAIN, 103) == cb.Params()


def test_without_nvrtc_an_unknown_sm_gets_the_smallest_budget(monkeypatch):
    def missing():
        raise nvrtc.CompileError("cuda-bindings is not installed")

    monkeypatch.setattr(nvrtc, "supported_sms", missing)
    assert cb.sm_budget(120) == cb.SM_BUDGETS[120]  # the device's own SM still counts
    assert cb.sm_budget(999) == cb.UNKNOWN_SM_BUDGET
    assert min(b.smem_block for b in cb.SM_BUDGETS.values()) == cb.UNKNOWN_SM_BUDGET.smem_block


# -- every path that runs defaults uses the GPU's -----------------------------------------------


@pytest.mark.parametrize("sm,code", [(90, 90), (120, 120), (107, 107), (999, 121)])
def test_dispatcher_default_tier_is_per_sm(sm, code):
    pick = Dispatcher().pick(MAIN, sm)
    assert pick.tier == "default" and pick.impl == "cupy"
    assert dict(pick.params) == dataclasses.asdict(cb.default_params(MAIN, code))
    assert f"its defaults for SM {sm}" in pick.reason


def test_dispatcher_skips_a_tuned_entry_the_sm_cannot_hold(tmp_path):
    """A family-tier entry measured on SM 80 (163 KB a CTA) is not run on SM 86 (99 KB)."""
    from profile_fakes import H200, build_db

    a100 = dict(H200, gpu_name="NVIDIA A100-SXM4-80GB", sm=80, sm_count=108)
    path = tmp_path / "p.db"
    build_db(path, {"a": (a100, [dict(batch=8, ctx=4096, params={"tile_n": 64, "stages": 4})])})
    d = Dispatcher.load(path)
    assert d.pick(MAIN, 80).tier == "exact"
    pick = d.pick(MAIN, 86)
    assert pick.tier == "default" and "99 KB a CTA gets on SM 86" in pick.reason
    assert dict(pick.params)["tile_n"] == 32


def test_runtime_binds_the_sms_defaults(gen):
    from drafter_attn.kernels.cache import random_paged_context
    from helpers import random_block

    g = PRESETS[MAIN_PRESET].with_(num_layers=1)
    rt = Runtime(Dispatcher(), sm=121)
    q, kb, vb = random_block(g, 1, "cpu", gen)
    cache = random_paged_context(g, [40], 16, "cpu", gen)
    rt.paged_attention(q, kb, vb, *cache)  # CPU tensors: the reference runs them
    (pick,) = rt.picks.values()
    assert "its defaults for SM 121" in pick.reason


def test_bench_decode_explicit_cupy_starts_from_the_sms_defaults():
    from drafter_attn.bench import decode

    pick = decode.resolve_impl("cupy", MAIN, sm=120)
    assert (pick.params["tile_n"], pick.params["stages"]) == (32, 5)
    pick = decode.resolve_impl("cupy", MAIN, sm=90)
    assert (pick.params["tile_n"], pick.params["stages"]) == (64, 3)
    # a backend whose defaults take no SM is asked without one
    assert decode.resolve_impl("reference", MAIN, sm=120).params == {}


def test_sweep_sm_targets_start_from_their_defaults(tmp_path):
    from drafter_attn.tuner.spec import load_spec, target_sm

    assert (target_sm("sm120"), target_sm("SM90"), target_sm("H200"), target_sm(None)) == \
        (120, 90, None, None)
    spec = tmp_path / "s.toml"
    spec.write_text('[sweep]\nname = "t"\npresets = ["qwen3-8b-dflash-b16"]\n'
                    'page_sizes = [64]\narena = false\nbatches = [8]\nctx_lens = [4096]\n'
                    'backends = ["cupy"]\ntargets = ["sm90", "sm120", "H200"]\n')
    got = {c.target: (c.params_dict["tile_n"], c.params_dict["stages"])
           for c in load_spec(spec).candidates()}
    assert got == {"sm90": (64, 3), "sm120": (32, 5), "H200": (64, 3)}


def test_the_tie_rule_counts_a_rows_own_sm_defaults():
    """tuner export keeps a key's default parameters within the tie margin: on SM 120 those are
    SM 120's."""
    from profile_fakes import row

    from drafter_attn.kernels import tuned_table

    sm90 = registry.default_params(registry.get("cupy"), MAIN, 90)
    sm120 = registry.default_params(registry.get("cupy"), MAIN, 120)
    assert sm90 != sm120
    for sm, params, want in ((120, sm120, True), (120, sm90, False), (90, sm90, True),
                             (None, sm90, True)):
        r = dict(row("env", batch=MAIN.batch, ctx=MAIN.ctx_len, params=params), sm=sm)
        assert tuned_table.is_default(r) is want, (sm, params)


# -- the backend's planning on a faked device -------------------------------------------------


@pytest.fixture
def planner(monkeypatch):
    """A cupy backend planning on the CPU for a device whose SM the test sets; modules are
    stand-ins that record the defines they were loaded with."""
    loaded = []

    def load(index, items):
        d = dict(items)
        loaded.append(d)
        return cb.Module(1, 2, 3, smem=cb.smem_bytes(d["TILE_N"], d["STAGES"], d["HEAD_DIM"]),
                         regs=230, threads=d["NUM_WARPS"] * 32)

    family = dataclasses.replace(cb.CUPY, module="test-sm-defaults", load_variant=load)

    class Planned(cb.CupyBackend):
        pass

    Planned.family = family
    monkeypatch.setattr(cb, "_index", lambda device: 0)
    monkeypatch.setattr(cb, "_check_kernel_inputs", lambda *a: None)
    monkeypatch.setattr(cb, "_zeros", lambda n, index: torch.zeros(n, dtype=torch.int32))
    monkeypatch.setattr(cb, "_counter_bufs", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cb, "_loaded", {})

    def on(sm, backend=None):
        monkeypatch.setattr(cb, "device_info", lambda index: (170, sm))
        loaded.clear()
        return backend or Planned(), loaded

    return on


def _plan_attention(backend, gen, page=64):
    from drafter_attn.kernels import contract
    from drafter_attn.kernels.cache import random_paged_context
    from helpers import random_block

    g = PRESETS[MAIN_PRESET].with_(num_layers=1)
    q, kb, vb = random_block(g, 2, "cpu", gen)
    cache = random_paged_context(g, [100, 3000], page, "cpu", gen)
    args = (q, kb, vb, *cache, None)
    key = cb.call_key("paged", args, ("full", None, None))
    return backend._plan_attention(key, contract.check_paged(*args[:7], "full", None, None),
                                   "paged", args)


@pytest.mark.parametrize("sm,tile,stages", [(90, 64, 3), (120, 32, 5), (107, 32, 6),
                                            (999, 32, 5)])
def test_planning_compiles_the_devices_defaults(planner, gen, sm, tile, stages):
    backend, loaded = planner(sm)
    _plan_attention(backend, gen)
    (d,) = loaded
    assert (d["TILE_N"], d["STAGES"], d["WGMMA"]) == (tile, stages, int(sm == 90))


def test_pinned_params_that_do_not_fit_the_device_are_refused(planner, gen):
    backend, loaded = planner(120)
    pinned = type(backend)().with_params(tile_n=64, stages=3)
    with pytest.raises(ValueError, match="cannot run this problem: tile_n=64 stages=3 needs "
                                         "104448 bytes.*99 KB a CTA gets on SM 120"):
        _plan_attention(pinned, gen)
    assert loaded == []


def test_the_store_loads_a_module_the_device_can_hold(planner, gen):
    from drafter_attn.kernels import contract
    from drafter_attn.kernels.cache import random_paged_context
    from helpers import random_block

    g = PRESETS[MAIN_PRESET].with_(num_layers=1)
    for sm, tile in ((90, 64), (121, 32)):
        backend, loaded = planner(sm)
        k_new, v_new = random_block(g, 2, "cpu", gen)[1:]
        k_pages, v_pages, table, lens = random_paged_context(g, [10, 20], 64, "cpu", gen,
                                                             extra_pages=1)
        num_new = torch.tensor([3, 16], dtype=torch.int32)
        args = (k_new, v_new, num_new, k_pages, v_pages, table, lens)
        backend._plan_store(cb.call_key("store_paged", args, None),
                            contract.check_store_paged(*args), args)
        (d,) = loaded
        assert d["TILE_N"] == tile and d["NUM_WARPS"] == 4


def test_split_planning_counts_the_sms_shared_memory():
    mod = cb.Module(None, None, None, smem=87040, regs=227, threads=128)
    assert mod.resident_ctas() == 2  # 228 KB an SM: two 86 KB CTAs
    assert mod.resident_ctas(cb.SM_BUDGETS[120].smem_sm) == 1  # 100 KB: one


# -- on the GPU: the other SMs' default pipelines, run on this one ----------------------------


def _pipelines():
    """Each distinct default K/V pipeline of an SM other than 90, as the mma.sync parameters an
    SM without wgmma runs (32 x 5 and 32 x 6 with NVRTC 13.5's targets)."""
    return sorted({(b.tile_n, b.stages) for b in cb.SM_BUDGETS.values()} - {(64, 3)})


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "cutlass"])
@pytest.mark.parametrize("tile,stages", _pipelines())
@pytest.mark.parametrize("layout,page", [("paged", 16), ("paged", 64), ("arena", None)])
def test_other_sms_default_pipelines_match_the_reference(monkeypatch, backend, tile, stages,
                                                         layout, page):
    """The defaults of SM 107/110 (32 x 6) and of the 99 KB targets (32 x 5), on mma.sync as
    those GPUs run them, against the reference on this GPU: every preset for cupy, the main
    preset for cutlass (CuTe compiles are slow)."""
    from drafter_attn.kernels import reference
    from drafter_attn.kernels.cache import random_arena_context, random_paged_context

    monkeypatch.setattr(nvrtc, "supported_sms", REAL_SUPPORTED_SMS)  # the installed NVRTC's list
    presets = PRESETS if backend == "cupy" else {MAIN_PRESET: PRESETS[MAIN_PRESET]}
    for name, g in presets.items():
        problem = Problem(g, layout, page, 4, 4097)
        warps = cb.num_warps(g.block_size, g.group)
        if warps > 8:
            continue  # the many-warp defaults are SM 90's too: the backend tests run them
        impl = registry.get(backend).with_params(tile_n=tile, stages=stages, wgmma=False)
        assert impl.supports(problem) is None, name
        gen = torch.Generator().manual_seed(tile * stages)
        lens = [0, 63, 700, 4097]
        q, kb, vb = (torch.randn(len(lens), g.block_size, h, g.head_dim, generator=gen)
                     .to("cuda", g.torch_dtype) for h in (g.num_q_heads, g.num_kv_heads, g.num_kv_heads))
        if layout == "paged":
            cache = random_paged_context(g, lens, page, "cuda", gen)
            out, ref = impl.paged_attention(q, kb, vb, *cache), reference.paged_attention(q, kb, vb, *cache)
        else:
            cache = random_arena_context(g, lens, max(lens) + 5, "cuda", gen)
            out, ref = impl.arena_attention(q, kb, vb, *cache), reference.arena_attention(q, kb, vb, *cache)
        torch.cuda.synchronize()
        rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert torch.isfinite(out).all() and rel < 1e-2, (name, rel)


def test_a_batch_past_the_grid_limit_is_refused_before_a_launch():
    """The attention grid puts the batch in z and the store grid in y: at most 65535 requests a
    call, refused by supports (and the store's planning) instead of an opaque launch error."""
    from drafter_attn.kernels.spec import Problem

    g = MAIN.geometry
    assert cb.supports(Problem(g, "paged", 64, 65535, 2048), None, 90) is None
    assert "batch 65536 exceeds 65535" in cb.supports(Problem(g, "paged", 64, 65536, 2048), None, 90)
    with pytest.raises(ValueError, match="batch=65536 exceeds 65535 requests a store call"):
        cb._plan_counters(0, 65536)
    # the KV heads are the attention grid's y; the combine counts B*Hq*Qb rows in a C int
    heads = Geometry(65536, 65536, 64, 1)
    assert "65536 KV heads exceed 65535" in cb.supports(Problem(heads, "paged", 16, 1, 4096), None, 90)
    assert cb.supports(Problem(Geometry(65535, 65535, 64, 1), "paged", 16, 1, 4096), None, 90) is None
    wide = Geometry(4096, 4096, 128, 16)
    assert "query rows a call" in cb.supports(Problem(wide, "paged", 64, 65535, 2048), None, 90)
    assert cb.supports(Problem(wide, "paged", 64, 32767, 2048), None, 90) is None


def test_a_min_ctas_the_wgmma_path_cannot_compile_is_refused_before_compiling():
    """`__launch_bounds__(threads, min_ctas)` caps a thread's registers: below 96 ptxas refuses the
    wgmma kernels (C7602), so supports says so first; mma.sync and fitting values pass."""
    import dataclasses

    base = cb.default_params(MAIN, 90)
    assert cb.supports(MAIN, dataclasses.replace(base, min_ctas=5), 90) is None  # 96 registers
    assert "min_ctas=6 leaves each of a 128-thread CTA's threads 80 registers" in \
        cb.supports(MAIN, dataclasses.replace(base, min_ctas=6), 90)
    laguna = Problem(PRESETS["laguna-dflash"], "paged", 64, 8, 8192)
    padded = registry.from_spec("cupy:wgmma=1,row_split=1,min_ctas=2")  # 9 warps padded to 12
    assert "384-thread CTA's threads 80 registers" in padded.supports(laguna, 90)
    sm100 = cb.default_params(MAIN, 100)  # mma.sync: no such floor here
    assert cb.supports(MAIN, dataclasses.replace(sm100, min_ctas=8), 100) is None
