"""CPU: the opt-in software-pipelined wgmma variant of the cupy kernel (`cupy:overlap=1` and `=2`,
issue 11; kernels/cuda/drafter_attention.cu, OVERLAP). Its knob's wiring (registry, supports,
defines, shared memory), and its sm_90a compiles for the presets whose CTAs are whole warpgroups:
no spills, warpgroup MMAs (HGMMA) in the SASS, no trap, and no note from ptxas that it serialized
the wgmmas or injected a wait (such a build computes the right result but overlaps nothing).
No GPU needed; the GPU matrix (tests/test_backends_gpu.py) runs both variants against the
reference."""

from __future__ import annotations

import re

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc, registry
from drafter_attn.kernels import static_profile as sp
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS
from drafter_attn.kernels.spec import Problem

MAIN = PRESETS[MAIN_PRESET]


def _problem(name: str, page: int | None = 64) -> Problem:
    return Problem(PRESETS[name], "paged" if page else "arena", page, 1, 4096)


def _defines(name: str, page: int | None, sm: int = 90, **params) -> dict:
    g = PRESETS[name]
    p = cb.default_params(_problem(name, page), **params)
    return cb.variant_defines(g.dtype, g.head_dim, page, g.block_size, g.group, p, sm)


# -- the knob -----------------------------------------------------------------------------------


def test_spec_binds_and_the_default_takes_it_where_wgmma_runs():
    backend = registry.from_spec("cupy:overlap=1")
    assert backend.params_for(_problem(MAIN_PRESET)).overlap == 1
    assert registry.from_spec("cupy:overlap=2,skip_loads=1").params_for(None).overlap == 2
    assert registry.get("cupy").default_params(None)["overlap"] == 0  # no shape, no wgmma known
    for name in PRESETS:
        # SM 90 deals 9-12 warps (laguna) over one-warpgroup CTAs, which take the path
        warps = cb.num_warps(PRESETS[name].block_size, PRESETS[name].group)
        warps90 = 4 if 8 < warps <= 12 else warps
        fits = cb.wgmma_fits(PRESETS[name].head_dim, warps90, 64)
        for sm in (*cb.SM_BUDGETS, 999):  # only SM 90 has the wgmma path
            want = cb.DEFAULT_OVERLAP if sm == 90 and fits else 0
            assert cb.default_params(_problem(name), sm).overlap == want, (sm, name)
        assert cb.default_params(_problem(name)).overlap == (cb.DEFAULT_OVERLAP if fits else 0)
        # pinning the mma.sync path or the knob itself takes it out of the defaults
        assert cb.default_params(_problem(name), 90, wgmma=False).overlap == 0
        assert cb.default_params(_problem(name), 90, overlap=0).overlap == 0
    # 9 warps as one CTA (the padded path, or mma.sync): not pipelined
    assert cb.default_params(_problem("laguna-dflash"), 90, wgmma=True).overlap == 0
    assert cb.default_params(_problem("laguna-dflash"), 90, row_split=1).overlap == 0
    assert registry.get("cupy").tunables(None)["overlap"] == [0, 1, 2]
    with pytest.raises(ValueError, match="overlap=3 must be one of"):
        registry.from_spec("cupy:overlap=3")
    # overlap=0 keeps the defines of the variants from before the knob existed (their cubins are
    # byte-identical to those; their static-profile labels are unchanged)
    assert "OVERLAP" not in _defines(MAIN_PRESET, 64, overlap=0)
    assert _defines(MAIN_PRESET, 64)["OVERLAP"] == cb.DEFAULT_OVERLAP
    assert _defines(MAIN_PRESET, 64, overlap=1)["OVERLAP"] == 1
    assert _defines("gpt-oss-20b-dflash", None, overlap=2)["OVERLAP"] == 2


def test_only_the_wgmma_path_takes_it():
    backend = registry.from_spec("cupy:overlap=1")
    for name in ("qwen3-8b-dflash-b16", "gpt-oss-20b-dflash", "mimo-dflash",
                 "qwen3-coder-30b-dflash"):
        assert backend.supports(_problem(name)) is None, name
    # laguna: 144 query rows = 9 warps; SM 90 pads them to 3 warpgroups, which take it; its
    # mma.sync variant (16-key tiles) does not
    assert backend.supports(_problem("laguna-dflash")) is None
    reason = registry.from_spec("cupy:overlap=1,tile_n=16").supports(_problem("laguna-dflash"))
    assert reason and "overlap=1 needs the sm_90a wgmma path" in reason and "9 warps" in reason
    reason = registry.from_spec("cupy:overlap=2,wgmma=0").supports(_problem(MAIN_PRESET))
    assert reason and "wgmma=0 (mma.sync) has no overlap variant" in reason
    # supports() told the GPU's SM refuses it off sm_90 (no wgmma); without an SM only the shape
    # is checked, and off sm_90 the plan's variant refuses it
    assert backend.supports(_problem(MAIN_PRESET), 90) is None
    for sm in (80, 100, 103, 120):
        reason = backend.supports(_problem(MAIN_PRESET), sm)
        assert reason and f"overlap=1 needs the sm_90a wgmma path, which SM {sm}" in reason, sm
        assert registry.supports(backend, _problem(MAIN_PRESET), sm) == reason
    with pytest.raises(ValueError, match="overlap=1 pipelines the sm_90a wgmma path"):
        _defines(MAIN_PRESET, 64, sm=100, overlap=1)
    with pytest.raises(ValueError, match="overlap=1 pipelines the sm_90a wgmma path"):
        _defines(MAIN_PRESET, 64, sm=103, overlap=1)


def test_one_more_v_stage_of_shared_memory():
    tile = 64 * 128 * 2  # one 64-key stage of K or V, head_dim 128, swizzled rows
    assert cb.Params(overlap=1).smem_bytes(128, 4, wgmma=True) == 7 * tile  # 3 K + 4 V stages
    assert cb.Params(overlap=2, stages=2).smem_bytes(128, 4, wgmma=True) == 5 * tile
    assert cb.Params().smem_bytes(128, 4, wgmma=True) == 6 * tile
    # 112 KB at the defaults: still two CTAs per SM on the H200 (228 KB)
    assert cb.SMEM_PER_SM // (7 * tile + 1024) == 2
    big = registry.from_spec("cupy:overlap=1,tile_n=128,stages=4")
    assert "more than the 227 KB a CTA gets" in big.supports(_problem(MAIN_PRESET))


# -- sm_90a compiles ----------------------------------------------------------------------------

# (preset, page or None for the arena, params): both overlap variants for the main preset and
# gpt-oss (head_dim 64), plus the cases whose code differs: several page ids per thread (page 16),
# two warpgroups (qwen3-coder, G=8), Qb 10 (llama), a sliding window (mimo), fp16, other stage
# counts and the math-only diagnostic the GPU table times.
CASES = [
    (MAIN_PRESET, 64, dict(overlap=1)),
    (MAIN_PRESET, 64, dict(overlap=2)),
    (MAIN_PRESET, None, dict(overlap=1)),
    (MAIN_PRESET, None, dict(overlap=2)),
    (MAIN_PRESET, 16, dict(overlap=1)),
    (MAIN_PRESET, 128, dict(overlap=2)),
    (MAIN_PRESET, 64, dict(overlap=1, skip_loads=True)),
    (MAIN_PRESET, 64, dict(overlap=1, stages=2)),
    (MAIN_PRESET, 64, dict(overlap=2, stages=4)),
    ("gpt-oss-20b-dflash", 64, dict(overlap=1)),
    ("gpt-oss-20b-dflash", 64, dict(overlap=2)),
    ("gpt-oss-20b-dflash", None, dict(overlap=1)),
    ("qwen3-coder-30b-dflash", 64, dict(overlap=1)),
    ("llama3.1-8b-dflash", None, dict(overlap=2)),
    ("mimo-dflash", 32, dict(overlap=1)),
]
SERIALIZED = re.compile(r"wgmma[^\n]*(serialized|injected)", re.I)


def _case_id(name: str, page: int | None, params: dict) -> str:
    return f"{name}-{page or 'arena'}-" + ",".join(f"{k}={int(v)}" for k, v in params.items())


@pytest.mark.parametrize("name,page,params", [pytest.param(*c, id=_case_id(*c)) for c in CASES])
def test_compiles_for_sm90a_pipelined(cache_dir, name, page, params):
    try:
        nvrtc.supported_sms()
        nvrtc.cuda_include_dir()
    except nvrtc.CompileError as exc:
        pytest.skip(f"no NVRTC toolchain here: {exc}")
    defines = _defines(name, page, **params)
    assert defines["WGMMA"] == 1 and defines["OVERLAP"] == params["overlap"]
    res = cb.compile_variant(defines, 90)
    assert res.arch == "sm_90a"
    attn = res.resources["drafter_attention"]
    assert attn.spill_store_bytes == attn.spill_load_bytes == 0, attn
    assert attn.stack_bytes == 0 and attn.registers <= 255, attn
    assert not SERIALIZED.findall(res.log), [l for l in res.log.splitlines() if "wgmma" in l]
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump "
                    "nvidia-cuda-nvdisasm)")
    sass = sp.sass_summary(str(res.cubin_path))["drafter_attention"]
    assert "HGMMA" in sass["mma"].split("+") and sass["traps"] == 0, sass
