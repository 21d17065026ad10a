"""The split combine's two kernels (`combine=1`: a warp a row, the default; `combine=2`: a CTA
of 4 warps a row, the splits dealt over its warps) on the CPU: what each compiles to, the launch
grid, the knob's range. The GPU matrix (tests/test_backends_gpu.py, `cupy:combine=2`, forced
splits included) checks the merged results against the reference."""

from __future__ import annotations

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem

MAIN = PRESETS["qwen3-8b-dflash-b16"]


def _params(spec, batch=1):
    return registry.from_spec(spec).params_for(Problem(MAIN, "paged", 64, batch, 8192), 90)


def test_combine_knob_is_named_only_when_not_the_default():
    assert _params("cupy").combine == 1
    assert "COMBINE_CTA" not in cb.variant_defines("bfloat16", 128, 64, 16, 4, _params("cupy"), 90)
    on = cb.variant_defines("bfloat16", 128, 64, 16, 4, _params("cupy:combine=2"), 90)
    assert on["COMBINE_CTA"] == 1
    with pytest.raises(ValueError, match="combine=3"):
        registry.from_spec("cupy:combine=3")


def test_combine_grid_is_a_cta_a_row_or_a_warp_a_row():
    # B=1, 8 KV heads, 64 rows each: 512 rows
    assert cb.combine_ctas(512, _params("cupy")) == 128
    assert cb.combine_ctas(513, _params("cupy")) == 129
    assert cb.combine_ctas(512, _params("cupy:combine=2")) == 512
    assert cb.combine_ctas(10, object()) == 3  # a family without the knob: a warp a row


@pytest.mark.parametrize("head_dim", [64, 128])
def test_cta_combine_sums_its_warps_in_shared_memory(head_dim):
    from drafter_attn.kernels import static_profile as sp
    from drafter_attn.kernels.nvrtc import compile_cubin

    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump is not installed")
    texts = {}
    for spec in ("cupy", "cupy:combine=2"):
        defines = cb.variant_defines("bfloat16", head_dim, 64, 16, 4, _params(spec), 90)
        res = compile_cubin(cb.SOURCE, defines, "sm_90a", extra_options=cb.NVRTC_OPTIONS)
        assert res.resources["drafter_combine"].spill_store_bytes == 0
        texts[spec] = sp.sass_text(str(res.cubin_path), "drafter_combine")
    assert "BAR.SYNC" in texts["cupy:combine=2"] and "STS" in texts["cupy:combine=2"]
    assert "BAR.SYNC" not in texts["cupy"] and "STS" not in texts["cupy"]
