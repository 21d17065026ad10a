"""The TMA variant of the cupy kernel (`cupy:tma=1`) on the CPU: the tensor-map geometry against
the cache layouts, what the backend refuses and why, its shared memory, and its sm_90a build
(bulk tensor copies in the tile loop, no register page-id loads, no spills). The GPU matrix
(tests/test_backends_gpu.py) checks its results."""

from __future__ import annotations

import ctypes

import pytest
import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import registry, tma
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem

MAIN = PRESETS["qwen3-8b-dflash-b16"]


def test_paged_map_walks_pages_heads_and_rows():
    # pages [10, Hkv 8, page 64, D 128], packed: a page is 8 * 64 * 128 elements
    geo = tma.geometry((10, 8, 64, 128), 8 * 64 * 128, 64, 64)
    assert geo.dims == (128, 64, 8, 10)
    assert geo.strides == (256, 64 * 256, 8 * 64 * 256)
    assert geo.box == (64, 64, 1, 1)
    # a page smaller than the tile: one box per page
    assert tma.geometry((10, 8, 16, 128), 8 * 16 * 128, 16, 64).box == (64, 16, 1, 1)
    # TensorRT-LLM's K view of a [blocks, 2, Hkv, page, D] pool: twice the page stride
    assert tma.geometry((10, 8, 64, 128), 2 * 8 * 64 * 128, 64, 64).strides[2] == 2 * 8 * 64 * 256


def test_arena_map_puts_tokens_in_the_box_rows():
    geo = tma.geometry((3, 2100, 8, 128), 2100 * 8 * 128, None, 64)
    assert geo.dims == (128, 8, 2100, 3)
    assert geo.strides == (256, 8 * 256, 2100 * 8 * 256)
    assert geo.box == (64, 1, 64, 1)


def test_map_geometry_matches_torch_strides():
    """The byte strides are the tensors' own: element (d, row, head, page) of the map is at
    the offset torch gives k[page, head, row, d]."""
    k = torch.empty(5, 4, 32, 64, dtype=torch.bfloat16)
    geo = tma.geometry(tuple(k.shape), k.stride(0), 32, 64)
    d, row, head, page = 7, 3, 2, 4
    offset = 2 * d + row * geo.strides[0] + head * geo.strides[1] + page * geo.strides[2]
    assert offset == 2 * (page * k.stride(0) + head * k.stride(1) + row * k.stride(2) + d)
    a = torch.empty(2, 100, 4, 64, dtype=torch.float16)
    geo = tma.geometry(tuple(a.shape), a.stride(0), None, 32)
    slot, tok, head = 1, 50, 3
    offset = 2 * d + head * geo.strides[0] + tok * geo.strides[1] + slot * geo.strides[2]
    assert offset == 2 * (slot * a.stride(0) + tok * a.stride(1) + head * a.stride(2) + d)


def test_map_checks_name_what_the_driver_refuses():
    geo = tma.geometry((10, 8, 64, 128), 8 * 64 * 128, 64, 64)
    assert tma.check(geo, 0x1000) is None
    assert "16-byte aligned" in tma.check(geo, 0x1008)
    bad = tma.geometry((10, 8, 64, 128), 8 * 64 * 128 + 4, 64, 64)  # 8-byte page stride rest
    assert "multiples of 16" in tma.check(bad, 0x1000)
    with pytest.raises(ValueError, match="page_size"):
        tma.geometry((10, 8, 32, 128), 8 * 32 * 128, 64, 64)


def test_params_struct_keeps_the_shared_prefix():
    """The TMA variant's packed arguments start with DrafterParams' fields at the same offsets
    (the per-call pointer packing writes them at offset 0), then the two 128-byte maps."""
    base = {f[0]: getattr(cb.DrafterParams, f[0]).offset for f in cb.DrafterParams._fields_}
    ext = {f[0]: getattr(cb.TmaDrafterParams, f[0]).offset for f in cb.TmaDrafterParams._fields_}
    assert {k: ext[k] for k in base} == base
    assert ctypes.sizeof(tma.TmaMap) == 128
    assert list(ext)[-2:] == ["tma_k", "tma_v"]


def _problem(layout="paged", page=64, geom=MAIN, batch=8, ctx=8192):
    return Problem(geom, layout, page if layout == "paged" else None, batch, ctx)


def test_backend_refuses_what_tma_cannot_feed():
    tma_backend = registry.from_spec("cupy:tma=1")
    assert tma_backend.supports(_problem(), 90) is None
    assert tma_backend.params_for(_problem(), 90).overlap == 2  # the pipelined path it feeds
    assert "sm_90a" in tma_backend.supports(_problem(), 100)
    assert "overlap" in registry.from_spec("cupy:tma=1,overlap=0").supports(_problem(), 90)
    assert "q_smem" in registry.from_spec("cupy:tma=1,q_smem=1").supports(_problem(), 90)
    # laguna's 9-warp CTAs have no pipelined variant, so no TMA one; its rows dealt over
    # one-warpgroup CTAs (SM 90's default) do
    laguna = _problem(geom=PRESETS["laguna-dflash"])
    assert registry.from_spec("cupy:tma=1,row_split=1").supports(laguna, 90) is not None
    assert tma_backend.supports(laguna, 90) is None


def test_shared_memory_counts_barriers_and_page_ids_not_the_ring():
    p = cb.Params(overlap=2, tma=True)
    plain = cb.Params(overlap=2)
    # page 16: the cp.async path's page-id ring is replaced by the barriers and two id chunks
    # for each issuing warp
    assert (p.smem_bytes(128, 4, True, 16)
            == plain.smem_bytes(128, 4, True, 16)
            - cb.id_ring_bytes(64, 3, 128, 4, 16, True) + cb.tma_bytes(3, 4))
    assert p.smem_bytes(128, 4, True, None) == plain.smem_bytes(128, 4, True, None) + 3 * 8 + 512
    # the main preset's TMA variant keeps two CTAs an SM (228 KB, 1 KB reserved a CTA)
    assert 2 * (p.smem_bytes(128, 4, True, 16) + 1024) <= cb.SMEM_PER_SM


def test_variant_defines_name_tma_only_when_on():
    p = registry.from_spec("cupy:tma=1").params_for(_problem(), 90)
    assert cb.variant_defines("bfloat16", 128, 64, 16, 4, p, 90)["TMA_LOADS"] == 1
    plain = registry.get("cupy").params_for(_problem(batch=1), 90)
    assert "TMA_LOADS" not in cb.variant_defines("bfloat16", 128, 64, 16, 4, plain, 90)


def test_default_takes_tma_from_batch_8_on_the_pipelined_path_only():
    cupy = registry.get("cupy")
    below, at = cb.TMA_MIN_BATCH - 1, cb.TMA_MIN_BATCH
    for layout, page in (("paged", 16), ("paged", 64), ("arena", None)):
        assert not cupy.params_for(_problem(layout, page, batch=below), 90).tma
        assert cupy.params_for(_problem(layout, page, batch=at), 90).tma
    # not where something excludes it or names it, nor off SM 90, nor on laguna's padded path;
    # below batch 8 from a 128k context up
    assert not cupy.params_for(_problem(batch=1, ctx=cb.TMA_MIN_CTX // 2), 90).tma
    assert cupy.params_for(_problem(batch=1, ctx=cb.TMA_MIN_CTX), 90).tma
    assert not cupy.with_params(q_smem=True).params_for(_problem(batch=32), 90).tma
    assert not cupy.with_params(overlap=0).params_for(_problem(batch=32), 90).tma
    assert not cupy.with_params(tma=False).params_for(_problem(batch=32), 90).tma
    assert cupy.with_params(tma=True).params_for(_problem(batch=1), 90).tma
    assert not cupy.params_for(_problem(batch=32), 100).tma
    laguna = _problem(geom=PRESETS["laguna-dflash"], batch=32)
    assert not cupy.with_params(wgmma=True).params_for(laguna, 90).tma
    # laguna's default deals its rows over one-warpgroup CTAs on the pipelined path: TMA there
    assert cupy.params_for(laguna, 90).tma and cupy.params_for(laguna, 90).row_split == 3
    # page 8 keeps cp.async (32 boxes of 1 KB a tile), and head_dim 64 below page 32
    assert not cupy.params_for(_problem(page=8, batch=32), 90).tma
    oss = PRESETS["gpt-oss-20b-dflash"]
    assert oss.head_dim == 64
    assert not cupy.params_for(_problem(page=16, geom=oss, batch=32), 90).tma
    assert cupy.params_for(_problem(page=32, geom=oss, batch=32), 90).tma
    assert cupy.params_for(_problem("arena", geom=oss, batch=32), 90).tma
    for sm in (90, 100, None):  # every default it picks, it runs
        assert cupy.supports(_problem(batch=32), sm) is None


def _sass(defines):
    from drafter_attn.kernels import static_profile as sp
    from drafter_attn.kernels.nvrtc import compile_cubin

    res = compile_cubin(cb.SOURCE, defines, "sm_90a", extra_options=cb.NVRTC_OPTIONS)
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump is not installed")
    return res, sp.sass_text(str(res.cubin_path), "drafter_attention")


@pytest.mark.parametrize("page", [8, 16, 64, 128, None])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm90a_build_loads_tiles_by_tma(page, head_dim):
    """A tile's copies (one per box and half, for K and for V) dealt over the warps: each issue
    site holds one warp's share, not the whole tile's; the page ids by cp.async (no LDG into
    registers in the loop, which a wgmma fence would wait for), no spills."""
    from drafter_attn.kernels import static_profile as sp

    problem = _problem("paged" if page else "arena", page or 64)
    params = registry.from_spec("cupy:tma=1").params_for(problem, 90)
    defines = cb.variant_defines("bfloat16", head_dim, page, 16, 4, params, 90)
    res, text = _sass(defines)
    assert res.spills == 0
    loads = sp.loop_global_loads(text)
    assert loads["ldg"] == 0 and loads["arrive_waits_on_ldg"] == 0
    utma = text.count("UTMALDG")
    boxes = 64 // min(page or 64, 64)
    copies = 2 * boxes * head_dim // 64
    share = copies // min(4, copies)  # 4 warps (64 query rows) issue
    # issue sites: the prologue's STAGES tiles and the loop's one (one warp alone issuing the
    # whole tile had (STAGES + 1) * copies, e.g. 64 at page 16)
    assert utma > 0 and utma % share == 0 and utma <= (params.stages + 1) * share
