"""CPU: every default cupy kernel variant compiles with NVRTC for every SM target the installed
NVRTC supports from SM 80 up (sm_80 .. sm_89, sm_90a, sm_100, sm_103, sm_107, sm_110, sm_120,
sm_121 with NVRTC 13.5), each at its SM's defaults (kernels.cupy_backend.SM_BUDGETS), without
spills and within the shared memory a CTA gets there, and its SASS holds tensor-core instructions
(HGMMA on the sm_90a wgmma variants, HMMA elsewhere) and no trap (no GPU needed). Cubins are
cached under $DRAFTER_CACHE_DIR."""

from __future__ import annotations

import os

import pytest

from drafter_attn.kernels import nvrtc
from drafter_attn.kernels import static_profile as sp

pytest.importorskip("cuda.bindings.nvrtc")


def _sms() -> tuple[int, ...]:
    try:
        return nvrtc.compile_targets()
    except nvrtc.CompileError:
        return sp.DEFAULT_SMS


SMS = _sms()


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # a private cubin cache, for this module only
        if "DRAFTER_CACHE_DIR" not in os.environ:
            mp.setenv("DRAFTER_CACHE_DIR", str(tmp_path_factory.mktemp("cubins")))
        yield sp.compile_variants(SMS, sp.cupy_default_variants(sms=SMS), workers=2)


def test_every_default_variant_compiles_for_every_target(rows):
    attn = [r for r in rows if r["kernel"] == "drafter_attention"]
    assert {r["sm"] for r in attn} == set(SMS) >= {90, 100, 103}
    # every preset geometry and layout at least once per target
    assert len(attn) >= 3 * 4 * len(SMS)
    assert all(r["registers"] > 0 for r in rows)
    assert all(r["arch"] == nvrtc.arch_for_sm(r["sm"]) for r in rows)


@pytest.mark.parametrize("sm", SMS)
def test_no_default_variant_spills(rows, sm):
    spilling = [(r["variant"], r["kernel"], r["registers"], r["spill_bytes"]) for r in rows
                if r["sm"] == sm and (r["spill_bytes"] or r["stack_bytes"])]
    assert not spilling, spilling


def test_every_default_variant_fits_its_sms_shared_memory(rows):
    assert sp.smem_problems(rows) == []
    # the check itself: SM 120's 64 x 3 stages of head_dim 128 (the SM 90 default) is flagged
    row = dict(sm=120, variant="v", kernel="drafter_attention", smem_dynamic=104448, smem_static=0)
    assert sp.smem_problems([row]) == ["sm 120 v drafter_attention: 104448 bytes of shared "
                                       "memory, more than the 99 KB a CTA gets"]


def test_sm_90a_keeps_its_measured_variants(rows):
    """SM 90's defaults are the H200's: 64-key tiles in 3 stages on wgmma, also for 9 warps,
    whose rows go to 3 one-warpgroup CTAs (the cubins are the ones the H200 measured)."""
    got = {r["variant"].split(":", 3)[3] for r in rows
           if r["sm"] == 90 and r["kernel"] == "drafter_attention"}
    assert all({"stages=3", "tile_n=64", "wgmma=1"} <= set(v.split(",")) for v in got), got
    assert {"row_split=3" in v for v in got} == {True, False}  # laguna, and the rest


def test_sass_uses_tensor_cores_and_never_traps(rows):
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    assert sp.sass_problems(rows) == []
    attn = [r for r in rows if r["kernel"] == "drafter_attention"]
    for r in attn:
        want = "HGMMA" if "wgmma=1" in r["variant"] else "HMMA"
        assert want in r["mma"].split("+"), (r["sm"], r["variant"], r["mma"])
    assert any("wgmma=1" in r["variant"] for r in attn if r["sm"] == 90), \
        "no sm_90a default variant took the wgmma path"


def test_the_profile_covers_the_defaults_of_every_call_size():
    """The defaults change with the call (TMA copies from a batch of TMA_MIN_BATCH or a context
    of TMA_MIN_CTX on SM 90, lean copies below, the combine's form by rows): the profile holds
    the variants of each side, not only those of one request at no context."""
    from drafter_attn.kernels import cupy_backend as cb

    assert (1, cb.TMA_MIN_CTX) in sp.DEFAULT_CALLS and (cb.TMA_MIN_BATCH, 0) in sp.DEFAULT_CALLS
    defines = [dict(v.defines) for v in sp.cupy_default_variants(sms=(90,))]
    assert {d.get("TMA_LOADS", 0) for d in defines} == {0, 1}  # a define left out is its default
    assert {d.get("LEAN", 0) for d in defines} == {0, 1}
    assert {d.get("COMBINE_CTA", 0) for d in defines} == {0, 1}
