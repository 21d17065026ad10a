"""CPU: every default cupy kernel variant compiles with NVRTC for every SM target the installed
NVRTC supports from SM 90 up (sm_90a, sm_100, sm_103, sm_107, sm_110, sm_120, sm_121 with NVRTC
13.5), without spills, and its SASS holds tensor-core instructions (HGMMA on the sm_90a wgmma
variants, HMMA elsewhere) and no trap (no GPU needed). Cubins are cached under $DRAFTER_CACHE_DIR."""

from __future__ import annotations

import os

import pytest

from drafter_attn.kernels import nvrtc
from drafter_attn.kernels import static_profile as sp

pytest.importorskip("cuda.bindings.nvrtc")

# The default params were chosen on sm_90a/100/103; ptxas of these targets spills a few bytes in
# some default variants (4-warp CTAs at the 255-register cap, 9-warp ones at 168). Strict xfail:
# when per-SM defaults fix them, these marks must go.
KNOWN_SPILLS = {107: "page16/page64/arena", 110: "page128/arena", 120: "page16/page64/arena",
                121: "page16/page64/arena"}


def _sms() -> tuple[int, ...]:
    try:
        return tuple(sm for sm in nvrtc.compile_targets() if sm >= 90)
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


@pytest.mark.parametrize("sm", [
    pytest.param(sm, marks=pytest.mark.xfail(sm in KNOWN_SPILLS, strict=True,
                                             reason=f"spills: {KNOWN_SPILLS.get(sm)}"))
    for sm in SMS])
def test_no_default_variant_spills(rows, sm):
    spilling = [(r["variant"], r["kernel"], r["spill_bytes"]) for r in rows
                if r["sm"] == sm and r["spill_bytes"]]
    assert not spilling, spilling


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
