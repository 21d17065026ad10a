"""CPU: every default cupy kernel variant compiles with NVRTC for sm_90a, sm_100a and sm_103a
without spills, and its SASS holds tensor-core instructions and no trap (no GPU needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from drafter_attn.kernels import static_profile as sp

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # a private cubin cache, for this module only
        if "DRAFTER_CACHE_DIR" not in os.environ:
            mp.setenv("DRAFTER_CACHE_DIR", str(tmp_path_factory.mktemp("cubins")))
        yield sp.compile_variants(sp.DEFAULT_SMS, sp.cupy_default_variants(), workers=2)


def test_every_default_variant_compiles_for_every_target(rows):
    attn = [r for r in rows if r["kernel"] == "drafter_attention"]
    assert {r["sm"] for r in attn} == set(sp.DEFAULT_SMS)
    # every preset geometry and layout at least once per target
    assert len(attn) >= 3 * 4 * 4
    assert all(r["registers"] > 0 for r in rows)


def test_no_default_variant_spills(rows):
    spilling = [(r["sm"], r["variant"], r["kernel"], r["spill_bytes"]) for r in rows
                if r["spill_bytes"]]
    assert not spilling, spilling


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    wheel = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "cuobjdump"
    return str(wheel) if wheel.exists() else None


def test_sass_uses_tensor_cores_and_never_traps(rows):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    seen_hgmma = False
    for r in rows:
        if r["kernel"] != "drafter_attention":
            continue
        sass = subprocess.run([tool, "-sass", "-fun", "drafter_attention", r["cubin"]],
                              capture_output=True, text=True, env=env)
        if sass.returncode != 0 and "nvdisasm" in sass.stderr:
            pytest.skip("cuobjdump needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
        assert sass.returncode == 0, sass.stderr
        assert "TRAP" not in sass.stdout, r["variant"]
        assert re.search(r"\bH(G)?MMA\b|HGMMA\.|HMMA\.", sass.stdout), r["variant"]
        if "wgmma=1" in r["variant"]:
            assert "HGMMA" in sass.stdout, f"wgmma variant without HGMMA: {r['variant']}"
            seen_hgmma = True
    assert seen_hgmma, "no sm_90a default variant took the wgmma path"
