"""The split combine's two kernels (`combine=1`: a warp a row; `combine=2`: a CTA of 4 warps a
row, the splits dealt over its warps, the default up to COMBINE_CTA_MAX_ROWS packed rows) on the
CPU: what each compiles to, the launch grid, the knob's range, the default rule. The GPU matrix
(tests/test_backends_gpu.py: `cupy`, which merges a CTA a row at its shapes of at most 1024 rows,
and `cupy:combine=1`; forced splits included) checks the merged results against the
reference."""

from __future__ import annotations

import dataclasses
import re

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem

MAIN = PRESETS["qwen3-8b-dflash-b16"]


def _params(spec, batch=8, geometry=MAIN, sm=90):
    return registry.from_spec(spec).params_for(Problem(geometry, "paged", 64, batch, 8192), sm)


def test_combine_knob_is_named_only_when_two():
    assert _params("cupy").combine == 1  # B=8: 4096 rows
    assert "COMBINE_CTA" not in cb.variant_defines("bfloat16", 128, 64, 16, 4, _params("cupy"), 90)
    on = cb.variant_defines("bfloat16", 128, 64, 16, 4, _params("cupy:combine=2"), 90)
    assert on["COMBINE_CTA"] == 1
    with pytest.raises(ValueError, match="combine=3"):
        registry.from_spec("cupy:combine=3")


def test_combine_grid_is_a_cta_a_row_or_a_warp_a_row():
    # B=1, 8 KV heads, 64 rows each: 512 rows
    assert cb.combine_ctas(512, _params("cupy:combine=1")) == 128
    assert cb.combine_ctas(513, _params("cupy:combine=1")) == 129
    assert cb.combine_ctas(512, _params("cupy:combine=2")) == 512
    assert cb.combine_ctas(10, object()) == 3  # a family without the knob: a warp a row


def test_the_cta_combine_is_the_default_up_to_1024_rows_a_call():
    # batch x Qb x query heads: B=1 of the main preset packs 1 x 16 x 32 = 512 rows and B=2 1024
    # (both measured faster a CTA a row), B=4 2048 (level to slower), B=8 4096 (slower)
    assert cb.COMBINE_CTA_MAX_ROWS == 1024
    assert _params("cupy", batch=1).combine == 2
    assert _params("cupy", batch=2).combine == 2
    assert _params("cupy", batch=3).combine == 1
    assert _params("cupy", batch=4).combine == 1
    assert _params("cupy", batch=8).combine == 1
    gpt_oss, laguna = PRESETS["gpt-oss-20b-dflash"], PRESETS["laguna-dflash"]
    assert gpt_oss.block_size * gpt_oss.num_q_heads <= 1024 < laguna.block_size * laguna.num_q_heads
    assert _params("cupy", batch=1, geometry=gpt_oss).combine == 2
    assert _params("cupy", batch=1, geometry=laguna).combine == 1
    # the combine is the same kernel on every SM: the rule holds off SM 90 too
    assert _params("cupy", batch=1, sm=100).combine == 2
    # named parameters win over the rule, both ways
    assert _params("cupy:combine=1", batch=1).combine == 1
    assert _params("cupy:combine=2", batch=8).combine == 2
    # the rule changes only the combine: the attention kernel's parameters are B=1's as before
    rule, warp = _params("cupy", batch=1), _params("cupy:combine=1", batch=1)
    assert dataclasses.replace(rule, combine=1) == warp


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


def test_one_trip_is_named_only_when_on():
    """`one_trip` (opt-in, either combine): the COMBINE_ONE_TRIP define, the other variants
    keeping their defines."""
    for spec in ("cupy:", "cupy:combine=2,", "cupy:ws=3,tile_n=32,early_ids=1,"):
        plain = cb.variant_defines("bfloat16", 128, 64, 16, 4, _params(spec.rstrip(":,")), 90)
        on = cb.variant_defines("bfloat16", 128, 64, 16, 4, _params(f"{spec}one_trip=1"), 90)
        assert "COMBINE_ONE_TRIP" not in plain and on == {**plain, "COMBINE_ONE_TRIP": 1}
    assert cb.tunables()["one_trip"] == [False, True]


def _combine_sass(spec, head_dim, sm):
    from drafter_attn.kernels import static_profile as sp
    from drafter_attn.kernels.nvrtc import compile_cubin

    defines = cb.variant_defines("bfloat16", head_dim, 64, 16, 4, _params(spec, sm=sm), sm)
    res = compile_cubin(cb.SOURCE, defines, f"sm_{sm}a" if sm >= 90 else f"sm_{sm}",
                        extra_options=cb.NVRTC_OPTIONS)
    resources = res.resources["drafter_combine"]
    assert resources.spill_store_bytes == 0 and resources.registers <= 64, resources
    return [ins for _, ins in re.findall(r"/\*([0-9a-f]{4})\*/\s+(.*?);",
                                         sp.sass_text(str(res.cubin_path), "drafter_combine"))]


@pytest.mark.parametrize("combine", [1, 2])
@pytest.mark.parametrize("head_dim,sm", [(128, 90), (64, 90), (128, 100)])
def test_one_trip_asks_for_the_partials_before_the_max(combine, head_dim, sm):
    """With one_trip the lse value and a warp's first 4 partial rows (16 splits a CTA a row) are
    all asked for before the max's first shuffle, and nothing is a call (the plain combine's
    64-bit row divisions are); the plain combine asks for its first partial row only after the
    max. The one-trip combine stays under 64 registers, so that 8 of its CTAs fit an SM: B=8's
    1024 CTAs (a warp a row) in one wave."""
    from drafter_attn.kernels import static_profile as sp

    chunk = 4  # combine_store.cuh's merge_splits<PER, 4>

    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump is not installed")
    width = "128" if head_dim == 128 else "64"  # a lane's PER floats in one load
    for spec in (f"cupy:combine={combine}", f"cupy:combine={combine},one_trip=1"):
        ins = _combine_sass(spec, head_dim, sm)
        first_max = next(i for i, x in enumerate(ins) if x.startswith("SHFL.BFLY") or " SHFL.BFLY" in x)
        parts_before = sum(f"LDG.E.{width}" in x for x in ins[:first_max])
        if "one_trip" in spec:
            assert parts_before == chunk, parts_before
            assert not any("CALL" in x for x in ins)
        else:
            assert parts_before == 0
            assert any("CALL" in x for x in ins)

