"""CPU: pages smaller than a key tile (8, 16, 32 at 64-key tiles) on the cupy kernel's wgmma path
(issue 12; results/perf-notes.md, "Page 16 on the wgmma path"). No GPU needed.

- The tile-load mapping, checked on the host for every thread (tests/drafter_layout_check.cu,
  built with nvcc): each 16-byte chunk of a tile written once where the swizzled layout wants
  it, from the page the thread's page id names, 4 whole 128-byte row segments per warp
  instruction and no shared-memory bank conflict.
- sm_90a builds of the main preset and gpt-oss (head_dim 64) at pages 8/16/32/64/128 and the
  arena: no spills, HGMMA, no traps; the tile loop holds one page-id load (LDG) per thread
  and no wgmma fence (WARPGROUP.ARRIVE) waits for it. Before the fix pages 8-32 held four
  and the QK^T fence waited for them on every tile.
- The pipelined path (OVERLAP) at pages below a tile reads its page ids from a shared-memory
  ring filled by cp.async: no table load (LDG) is left in its tile loop (a pending one made
  ptxas stall the next iteration's S = QK^T on it).
- Pages >= 64, the arena and the mma.sync path compile to the same SASS as before the change
  (digests in tests/data/sass_unchanged.json, recorded with the NVRTC named there; skipped
  under another NVRTC). After an intended change to that code, rewrite them:
  `python tests/test_page_small.py --update`. The entries after the first nine were added with
  the GQA 9 change (tests/test_gqa9.py) and recorded from the sources before it (commit
  c38ce36): the pipelined SM 90 defaults and laguna's mma.sync default. The four pipelined
  entries at pages 8 and 16 were rewritten with the page-id ring (2026-12-01), which changes
  them on purpose; the others stayed byte-identical through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from drafter_attn.kernels import cupy_backend as cb  # noqa: E402
from drafter_attn.kernels import nvrtc  # noqa: E402
from drafter_attn.kernels import static_profile as sp  # noqa: E402
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset  # noqa: E402

GPT_OSS = "gpt-oss-20b-dflash"
QWEN3_CODER = "qwen3-coder-30b-dflash"  # 128 rows: 8 warps
LAGUNA = "laguna-dflash"  # 144 rows: 9 warps
LAGUNA_DEFAULT = {"tile_n": 16, "stages": 6, "q_smem": True}
PAGES = (8, 16, 32, 64, 128, None)
DIGESTS = Path(__file__).parent / "data" / "sass_unchanged.json"
# (preset, page, sm, params): code the page-16 change must leave byte-identical
UNCHANGED = [
    (MAIN_PRESET, 64, 90, {}), (MAIN_PRESET, 128, 90, {}), (MAIN_PRESET, None, 90, {}),
    (GPT_OSS, 64, 90, {}), (GPT_OSS, 128, 90, {}), (GPT_OSS, None, 90, {}),
    (MAIN_PRESET, 16, 90, {"wgmma": False}), (MAIN_PRESET, 8, 90, {"wgmma": False}),
    (MAIN_PRESET, 16, 100, {}),
    # and the GQA 9 change (issue 12: padded warpgroups, a predicated last load iteration, lane
    # page-id slots on the interleaved mapping) must leave these: the pipelined defaults of SM 90
    # (4 and 8 warps, pages below and above a tile, the arena, head_dim 64) and laguna's
    # many-warp mma.sync default on SM 90 and SM 100
    (MAIN_PRESET, 64, 90, {"overlap": 2}), (MAIN_PRESET, 16, 90, {"overlap": 2}),
    (MAIN_PRESET, 8, 90, {"overlap": 2}), (MAIN_PRESET, None, 90, {"overlap": 2}),
    (GPT_OSS, 16, 90, {"overlap": 2}), (QWEN3_CODER, 64, 90, {"overlap": 2}),
    (QWEN3_CODER, 16, 90, {"overlap": 2}),
    (LAGUNA, 64, 90, LAGUNA_DEFAULT), (LAGUNA, 16, 90, LAGUNA_DEFAULT),
    (LAGUNA, 64, 100, LAGUNA_DEFAULT),
]


def _defines(preset: str, page: int | None, sm: int, params: dict) -> dict:
    g = get_preset(preset)
    return cb.variant_defines(g.dtype, g.head_dim, page, g.block_size, g.group,
                              cb.Params(**params), sm)


def _label(preset: str, page: int | None, sm: int, params: dict) -> str:
    extra = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(params.items()))
    return f"{preset}:{f'page{page}' if page else 'arena'}:sm{sm}" + (f":{extra}" if extra else "")


def _compile(preset, page, sm, params):
    return cb.compile_variant(_defines(preset, page, sm, params), sm)


@pytest.fixture(scope="module")
def builds(cache_dir):
    """sm_90a default builds of the main preset and gpt-oss at every page size and the arena."""
    return {(preset, page): _compile(preset, page, 90, {})
            for preset in (MAIN_PRESET, GPT_OSS) for page in PAGES}


def _sass(res) -> str:
    text = sp.sass_text(str(res.cubin_path), "drafter_attention")
    if text is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return text


# ---- the load mapping, on the host

# (HEAD_DIM, TILE_N, NUM_WARPS, WGMMA, PAGE_SIZE, expected PG, expected PGR)
LAYOUT_CASES = [
    (128, 64, 4, 1, 8, 2, 1), (128, 64, 4, 1, 16, 1, 1), (128, 64, 4, 1, 32, 1, 1),
    (128, 64, 4, 1, 64, 1, 1), (64, 64, 4, 1, 8, 2, 1), (64, 64, 4, 1, 16, 1, 1),
    (128, 128, 4, 1, 8, 4, 1), (128, 128, 4, 1, 32, 1, 1), (128, 32, 4, 1, 8, 1, 1),
    (128, 64, 8, 1, 8, 1, 1), (128, 64, 16, 1, 16, 1, 1),
    (128, 64, 4, 0, 8, 1, 1), (128, 16, 9, 0, 8, 1, 1),  # mma.sync: untouched, checked alike
    # 3 warpgroups (GQA 9 padded, GQA 12; tests/test_gqa9.py): a predicated last load iteration,
    # the interleaved mapping with one page id per lane slot (LANE_IDS)
    (128, 32, 12, 1, 8, 2, 1), (128, 32, 12, 1, 16, 2, 1), (128, 32, 12, 1, 32, 1, 1),
    (128, 32, 12, 1, 64, 1, 1), (128, 32, 12, 1, 0, 1, 1), (128, 64, 12, 1, 16, 3, 1),
    (128, 64, 12, 1, 8, 3, 1), (128, 128, 12, 1, 64, 6, 1), (64, 32, 12, 1, 16, 1, 1),
    (64, 64, 12, 1, 8, 2, 1), (128, 64, 8, 1, 16, 1, 1),
]


def _nvcc() -> str | None:
    import shutil

    found = shutil.which("nvcc")
    if found:
        return found
    try:
        path = Path(nvrtc.cuda_include_dir()).parent / "bin" / "nvcc"
    except Exception:
        return None
    return str(path) if path.exists() else None


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "d{}-n{}-w{}-wg{}-p{}".format(*c[:5]))
def test_tile_load_mapping(case):
    """Built for the host with nvcc (cached by content): every chunk once, from the right page,
    whole row segments, no bank conflicts; PG and PGR as expected."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit builds the host-side layout check)")
    check = Path(__file__).with_name("drafter_layout_check.cu")
    names = ("HEAD_DIM", "TILE_N", "NUM_WARPS", "WGMMA", "PAGE_SIZE", "EXPECT_PG", "EXPECT_PGR")
    defines = [f"-D{k}={v}" for k, v in zip(names, case)] + ["-DSTAGES=3", "-DDTYPE_BF16=1"]
    digest = hashlib.sha256()
    for path in [check, *sorted(nvrtc.CUDA_SRC_DIR.glob("*.cu*"))]:
        digest.update(path.read_bytes())
    digest.update(" ".join(defines).encode())
    exe = nvrtc.cache_dir().parent / "layout_check" / f"cupy-{digest.hexdigest()[:20]}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        build = subprocess.run([nvcc, "-std=c++17", "-w", "-arch=sm_90a", f"-I{nvrtc.CUDA_SRC_DIR}",
                                *defines, "-o", str(tmp), str(check)],
                               capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-4000:]
        os.replace(tmp, exe)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


# ---- sm_90a builds

@pytest.mark.parametrize("preset", [MAIN_PRESET, GPT_OSS])
@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"page{p}" if p else "arena")
def test_builds_do_not_spill_and_use_wgmma(builds, preset, page):
    res = builds[(preset, page)]
    assert _defines(preset, page, 90, {})["WGMMA"] == 1
    attn = res.resources["drafter_attention"]
    assert attn.spill_store_bytes + attn.spill_load_bytes == 0, attn
    summary = sp.parse_sass(_sass(res))["drafter_attention"]
    assert "HGMMA" in summary["mma"].split("+") and summary["traps"] == 0, summary


@pytest.mark.parametrize("preset", [MAIN_PRESET, GPT_OSS])
@pytest.mark.parametrize("page", PAGES, ids=lambda p: f"page{p}" if p else "arena")
def test_tile_loop_has_one_page_id_load_and_no_fence_waits_for_it(builds, preset, page):
    """The cause of issue 12's page-16 slowdown, as SASS: with 4 page-id loads per thread in
    flight, the QK^T WARPGROUP.ARRIVE waited for their scoreboard on every tile."""
    loads = sp.loop_global_loads(_sass(builds[(preset, page)]))
    assert loads["ldgsts"] > 0 and loads["arrive"] >= 2, loads  # the loop was found
    assert loads["ldg"] == 1, loads  # one page-id (or slot-id) load per thread and tile
    assert loads["arrive_waits_on_ldg"] == 0, loads


def test_loop_report_sees_a_fence_waiting_for_a_load():
    """loop_global_loads on a hand-made listing: an LDG setting scoreboard 5 and an ARRIVE
    waiting on it inside a loop closed by a backward branch over a barrier."""
    def ins(addr, text, ctrl):
        lo, hi = 0, ctrl << 41
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x{lo:016x} */\n" \
               f"                                                   /* 0x{hi:016x} */\n"
    no_sb = (7 << 5) | (7 << 8)
    listing = ("\tFunction : drafter_attention\n"
               + ins(0x10, "BAR.SYNC.DEFER_BLOCKING 0x0", no_sb)
               + ins(0x20, "LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64], P0", no_sb)
               + ins(0x30, "LDG.E.CONSTANT R5, desc[UR4][R6.64]", (5 << 5) | (7 << 8))
               + ins(0x40, "WARPGROUP.ARRIVE", no_sb | (1 << (11 + 5)))
               + ins(0x50, "WARPGROUP.ARRIVE", no_sb)
               + ins(0x60, "@!P0 BRA 0x10", no_sb))
    assert sp.loop_global_loads(listing) == dict(loop_instructions=6, ldg=1, ldgsts=1, arrive=2,
                                                 arrive_waits_on_ldg=1)


# ---- the pipelined path (OVERLAP) at pages below a tile: page ids through shared memory

PIPELINED = [(MAIN_PRESET, {"overlap": 2}), (MAIN_PRESET, {"overlap": 1}),
             (GPT_OSS, {"overlap": 2}), (QWEN3_CODER, {"overlap": 2}),
             (LAGUNA, {"wgmma": True, "overlap": 2})]  # 3 warpgroups: the interleaved mapping


@pytest.mark.parametrize("page", [8, 16, 32], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("case", PIPELINED, ids=lambda c: _label(c[0], None, 90, c[1]))
def test_pipelined_tile_loop_reads_page_ids_from_shared_memory(cache_dir, case, page):
    """With a page-id LDG in the pipelined loop, ptxas made the next iteration's first branch
    (before S = QK^T) wait for it: +11-15% at page 16 and +28% at page 8 on the H200. The ids
    now arrive by cp.async (one more LDGSTS) and no register load of the table is left."""
    preset, params = case
    res = _compile(preset, page, 90, params)
    attn = res.resources["drafter_attention"]
    if preset != LAGUNA:  # 3 pipelined warpgroups spill at 168 registers, ring or not
        assert attn.spill_store_bytes + attn.spill_load_bytes == 0, attn
    loads = sp.loop_global_loads(_sass(res))
    assert loads["ldgsts"] > 0 and loads["arrive"] >= 2, loads  # the loop was found
    assert loads["ldg"] == 0, loads


@pytest.mark.parametrize("case", [c for c in LAYOUT_CASES if c[3] and c[4]],
                         ids=lambda c: "d{}-n{}-w{}-p{}".format(*c[:3], c[4]))
def test_id_ring_bytes_follow_the_kernels_page_id_count(case):
    """kernels/cupy_backend.id_ring_bytes sizes the ring from the PG the kernel computes (the
    expected PG of each wgmma layout case, which test_tile_load_mapping checks in CUDA)."""
    head_dim, tile_n, warps, _, page, pg, _ = case
    ring = cb.id_ring_bytes(tile_n, 3, head_dim, warps, page, overlap=True)
    assert ring == (4 * warps * pg * 4 if page < tile_n else 0)
    assert cb.id_ring_bytes(tile_n, 3, head_dim, warps, page, overlap=False) == 0
    assert cb.id_ring_bytes(tile_n, 3, head_dim, warps, None, overlap=True) == 0


def test_id_ring_keeps_two_main_preset_ctas_per_sm():
    """The ring lives in the 1 KB the pipelined main preset leaves of half an SM's 228 KB."""
    geom = get_preset(MAIN_PRESET)
    for page in (8, 16, 32):
        p = cb.default_params(cb.Problem(geom, "paged", page, 1, 0), 90)
        assert p.overlap and cb.use_wgmma(p, geom.head_dim, 4, 90)
        need = p.smem_bytes(geom.head_dim, 4, True, page)
        assert need > p.smem_bytes(geom.head_dim, 4, True)  # the ring is counted
        assert 2 * (need + 1024) <= 228 * 1024, need


# ---- pages >= 64, the arena and mma.sync: the same SASS as before the change

def _digests() -> dict[str, str]:
    out = {}
    for preset, page, sm, params in UNCHANGED:
        res = _compile(preset, page, sm, params)
        text = sp.sass_text(str(res.cubin_path), "drafter_attention")
        out[_label(preset, page, sm, params)] = sp.sass_digest(text)
    return out


def test_page_ge_tile_arena_and_mma_sync_sass_unchanged(cache_dir):
    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump not installed")
    recorded = json.loads(DIGESTS.read_text())
    version = "{}.{}".format(*nvrtc.nvrtc_version())
    if recorded["nvrtc"] != version:
        pytest.skip(f"digests recorded with NVRTC {recorded['nvrtc']}, this is {version}")
    assert _digests() == recorded["digests"]


if __name__ == "__main__":  # python tests/test_page_small.py --update
    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python tests/test_page_small.py --update")
    data = {"nvrtc": "{}.{}".format(*nvrtc.nvrtc_version()),
            "note": "drafter_attention SASS (static_profile.sass_digest) of code the page-16 "
                    "change and the GQA 9 change (issue 12) must not touch, recorded from the "
                    "sources before them; tests/test_page_small.py",
            "digests": _digests()}
    DIGESTS.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {DIGESTS}: {len(data['digests'])} digests")
