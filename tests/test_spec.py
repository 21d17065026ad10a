"""Geometry, Problem and presets: validation and helpers."""

import re

import pytest
import torch

from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS, get_preset
from drafter_attn.kernels.spec import Geometry, Problem


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_q_heads=30, num_kv_heads=8), "num_q_heads=30 is not a multiple of num_kv_heads=8"),
        (dict(num_q_heads=0), "num_q_heads must be a positive integer"),
        (dict(num_kv_heads=-8), "num_kv_heads must be a positive integer"),
        (dict(head_dim=128.0), "head_dim must be a positive integer"),
        (dict(block_size=True), "block_size must be a positive integer"),
        (dict(num_layers=0), "num_layers must be a positive integer"),
        (dict(mask="sliding"), "window is required for mask='sliding'"),
        (dict(mask="sliding_causal", window=0), "window must be positive"),
        (dict(mask="sliding", window=-4), "window must be positive"),
        (dict(mask="sliding", window=2**31), "window=2147483648 is over 2147483647"),
        (dict(mask="causal"), "mask='causal' is unknown; known masks: full, sliding, sliding_causal"),
        (dict(dtype="float8"), "dtype='float8' is unknown"),
    ],
)
def test_geometry_rejects(kwargs, message):
    base = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    with pytest.raises(ValueError, match=re.escape(message)):
        Geometry(**{**base, **kwargs})


def test_geometry_helpers():
    g = Geometry(32, 8, 128, 16)
    assert g.group == 4 and g.torch_dtype == torch.bfloat16 and g.window is None
    h = g.with_(mask="sliding", window=64, dtype="float16")
    assert (h.mask, h.window, h.torch_dtype) == ("sliding", 64, torch.float16) and g.mask == "full"
    with pytest.raises(ValueError, match="window is required"):
        g.with_(mask="sliding")
    # A window with mask="full" is ignored, so equal geometries compare equal.
    assert Geometry(32, 8, 128, 16, "full", 512) == g
    assert Geometry(4, 4, 64, 1, dtype="float32").torch_dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(layout="paged", page_size=None), "page_size is required for layout='paged'"),
        (dict(layout="paged", page_size=48), "page_size must be a power of two, got page_size=48"),
        (dict(layout="paged", page_size=0), "page_size must be a power of two"),
        (dict(layout="arena", page_size=64), "page_size must be None for layout='arena'"),
        (dict(layout="dense", page_size=None), "layout='dense' is unknown; known layouts: paged, arena"),
        (dict(batch=0), "batch must be a positive integer"),
        (dict(ctx_len=-1), "ctx_len must be a non-negative integer"),
        (dict(geometry="qwen"), "geometry must be a Geometry"),
    ],
)
def test_problem_rejects(kwargs, message):
    base = dict(geometry=get_preset(MAIN_PRESET), layout="paged", page_size=64, batch=8, ctx_len=8192)
    with pytest.raises(ValueError, match=re.escape(message)):
        Problem(**{**base, **kwargs})


def test_problem_key_is_flat_and_complete():
    p = Problem(get_preset("mimo-dflash"), "arena", None, 4, 1000)
    assert p.key() == dict(
        num_q_heads=64, num_kv_heads=8, head_dim=128, block_size=8, mask="sliding", window=1024,
        num_layers=5, dtype="bfloat16", layout="arena", page_size=None, batch=4, ctx_len=1000,
    )
    # Any power of two is accepted (the model extrapolates beyond the documented 8..256).
    assert Problem(get_preset(MAIN_PRESET), "paged", 1, 1, 0).page_size == 1
    assert Problem(get_preset(MAIN_PRESET), "paged", 1024, 1, 0).page_size == 1024


def test_presets_match_design_table():
    table = {  # docs/design.md, "The problem": layers, Hq, Hkv, D, Qb, mask, window
        "qwen3-8b-dflash-b16": (5, 32, 8, 128, 16, "full", None),
        "qwen3-coder-30b-dflash": (8, 32, 4, 128, 16, "full", None),
        "gpt-oss-20b-dflash": (8, 64, 8, 64, 8, "full", None),
        "llama3.1-8b-dflash": (5, 32, 8, 128, 10, "full", None),
        "qwen3.5-122b-dflash": (6, 32, 8, 128, 16, "sliding", 4096),
        "dflash2-w2048": (5, 32, 8, 128, 16, "sliding", 2048),
        "mimo-dflash": (5, 64, 8, 128, 8, "sliding", 1024),
        "laguna-dflash": (6, 72, 8, 128, 16, "sliding_causal", 512),
    }
    assert set(PRESETS) == set(table) and MAIN_PRESET in PRESETS
    for name, want in table.items():
        g = get_preset(name)
        assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim, g.block_size, g.mask, g.window) == want
        assert g.dtype == "bfloat16"
    assert get_preset("laguna-dflash").group == 9


def test_unknown_preset_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown preset 'qwen9'; known presets: qwen3-8b-dflash-b16, .*laguna-dflash"):
        get_preset("qwen9")


def test_problem_from_contract_dims():
    from drafter_attn.kernels.cache import random_arena_context, random_paged_context
    from drafter_attn.kernels.contract import check_arena, check_paged

    g = get_preset("mimo-dflash").with_(dtype="float16")  # 64/8 heads, D 128, Qb 8, sliding 1024
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 64, 128, generator=gen).half()
    k_blk = torch.randn(2, 8, 8, 128, generator=gen).half()
    paged = random_paged_context(g, [10, 70], 32, "cpu", gen)
    dims = check_paged(q, k_blk, k_blk, *paged, mask="sliding", window=1024)
    assert Problem.from_dims(dims, dims.capacity) == Problem(g.with_(num_layers=1), "paged", 32, 2, 96)
    arena = random_arena_context(g, [10, 70], 128, "cpu", gen)
    dims = check_arena(q, k_blk, k_blk, *arena, mask="full")
    want = g.with_(num_layers=1, mask="full", window=None)
    assert Problem.from_dims(dims, 0) == Problem(want, "arena", None, 2, 0)
