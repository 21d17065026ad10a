"""The cutlass backend's CuTe kernels compile with NVRTC on a machine without a GPU (CPU test).

The main preset's default variants (paged 64 and arena) are compiled once per session for sm_90a,
sm_100 and sm_103, plus its warpgroup-MMA variants (wgmma=True) for sm_90a (the on-disk cubin
cache makes later runs instant); every kernel must be free of spills, and the SASS (cuobjdump
-sass) must hold tensor-core MMAs (HMMA, or HGMMA for wgmma), the cp.async and ldmatrix the CuTe
atoms stand for, and no trap instruction.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

cutlass_library = pytest.importorskip("cutlass_library", reason="needs the `cutlass` extra")

from drafter_attn.kernels import registry  # noqa: E402
from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS  # noqa: E402
from drafter_attn.kernels.spec import Geometry, Problem  # noqa: E402

SMS = (90, 100, 103)


def _nvrtc_available() -> str | None:
    from drafter_attn.kernels import nvrtc

    try:
        nvrtc.nvrtc_version()
        nvrtc.cuda_include_dir()
    except Exception as exc:  # no cuda-bindings / libnvrtc / CUDA headers on this machine
        return f"NVRTC unavailable: {exc}"
    return None


@pytest.fixture(scope="session")
def compiled():
    """One row per (SM, variant, kernel) for the main preset's paged-64 and arena variants
    (mma.sync on every SM, wgmma on sm_90a)."""
    reason = _nvrtc_available()
    if reason:
        pytest.skip(reason)
    from drafter_attn.kernels.static_profile import compile_variants, cutlass_default_variants

    variants = cutlass_default_variants(page_sizes=(64,), presets={MAIN_PRESET: PRESETS[MAIN_PRESET]},
                                        sms=SMS)
    assert len(variants) == 2 * len(SMS) + 2  # paged 64 + arena: mma.sync per SM, wgmma on sm_90a
    return compile_variants(SMS, variants, workers=min(2, os.cpu_count() or 1))


def _sass(cubin: str) -> str:
    from drafter_attn.kernels.static_profile import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("cuobjdump not found (nvidia-cuda-cuobjdump wheel)")
    env = dict(os.environ, PATH=f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    res = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _functions(sass: str) -> dict[str, list[str]]:
    """Instruction lines of each function in a cuobjdump -sass listing."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            current = m.group(1)
            out[current] = []
        elif current and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            out[current].append(line)
    return out


def _wgmma(row) -> bool:
    return "wgmma=1" in row["variant"]


def test_every_sm_and_layout_compiled(compiled):
    seen = {(r["sm"], r["variant"].split(":")[1], _wgmma(r)) for r in compiled}
    assert seen == ({(sm, layout, False) for sm in SMS for layout in ("page64", "arena")}
                    | {(90, layout, True) for layout in ("page64", "arena")})
    kernels = {r["kernel"] for r in compiled}
    assert kernels == {"drafter_attention", "drafter_combine", "drafter_store"}


def test_no_spills(compiled):
    spilling = [f"sm_{r['sm']} {r['variant']} {r['kernel']}: {r['spill_bytes']} spill bytes, "
                f"{r['stack_bytes']} stack bytes" for r in compiled
                if r["spill_bytes"] or r["stack_bytes"]]
    assert not spilling, "\n".join(spilling)
    for r in compiled:
        if r["kernel"] == "drafter_attention":
            assert 0 < r["registers"] <= 255
            # 3 stages x (K + V) 64 x (128 + 8) (padded rows) or 64 x 128 (swizzled, wgmma);
            # Q borrows the third stage
            assert r["smem_dynamic"] == (98304 if _wgmma(r) else 104448)


def test_sass_has_tensor_cores_and_no_trap(compiled):
    for cubin, wgmma in sorted({(r["cubin"], _wgmma(r)) for r in compiled}):
        funcs = _functions(_sass(cubin))
        assert "drafter_attention" in funcs, sorted(funcs)
        attn = "\n".join(funcs["drafter_attention"])
        mma = r"\bHGMMA\." if wgmma else r"\bHMMA\."
        assert re.search(mma, attn), f"{cubin}: no {mma} in drafter_attention"
        assert "LDGSTS" in attn, f"{cubin}: no cp.async (LDGSTS) in drafter_attention"
        assert "LDSM" in attn, f"{cubin}: no ldmatrix (LDSM) in drafter_attention"
        for name, lines in funcs.items():
            traps = [line.strip() for line in lines if "TRAP" in line]
            assert not traps, f"{cubin}: {name} has trap instructions: {traps[:3]}"


# (HEAD_DIM, TILE_N, NUM_WARPS, STAGES, Q_SMEM, WGMMA): the main preset's mma.sync and wgmma
# variants and the 9-warp default (32-key tiles, Q in shared memory, 8 threads that do not load)
LAYOUT_CASES = [(128, 64, 4, 3, 0, 0), (128, 32, 9, 3, 1, 0), (128, 64, 4, 3, 0, 1)]


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        from drafter_attn.kernels.nvrtc import cuda_include_dir

        path = Path(cuda_include_dir()).parent / "bin" / "nvcc"
    except Exception:
        return None
    return str(path) if path.exists() else None


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "d{}-n{}-w{}-s{}-q{}-wg{}".format(*c))
def test_gather_partitions_match_the_smem_layouts(case):
    """Built for the host with nvcc (cached by content): the CuTe copy partitions the kernel's
    gathers use put every row where its layouts (and the page-id lookup) expect."""
    import hashlib

    from drafter_attn.kernels import cutlass_backend as kb
    from drafter_attn.kernels.nvrtc import CUDA_SRC_DIR, cache_dir

    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit builds the host-side layout check)")
    check = Path(__file__).with_name("cute_layout_check.cu")
    names = ("HEAD_DIM", "TILE_N", "NUM_WARPS", "STAGES", "Q_SMEM", "WGMMA")
    defines = [f"-D{k}={v}" for k, v in zip(names, case)] + ["-DPAGE_SIZE=64", "-DDTYPE_BF16=1"]
    digest = hashlib.sha256()
    for path in (check, CUDA_SRC_DIR / kb.SOURCE, CUDA_SRC_DIR / "combine_store.cuh",
                 CUDA_SRC_DIR / "common.cuh"):
        digest.update(path.read_bytes())
    digest.update(" ".join(defines + [kb.header_identity()]).encode())
    exe = cache_dir().parent / "layout_check" / f"check-{digest.hexdigest()[:20]}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(f".tmp{os.getpid()}")
        build = subprocess.run(
            [nvcc, "-std=c++17", "-w", "-arch=sm_90a", f"-I{kb.include_dir()}",
             f"-I{CUDA_SRC_DIR}", *defines, "-o", str(tmp), str(check)],
            capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-4000:]
        os.replace(tmp, exe)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_static_profile_lists_both_backends():
    from drafter_attn.kernels.static_profile import cutlass_default_variants, default_variants

    backends = {v.backend for v in default_variants()}
    assert {"cupy", "cutlass"} <= backends
    variants = cutlass_default_variants(sms=(90, 100, 120))
    for v in variants:
        assert v.source == "cute_drafter_attention.cu" and v.include_dirs and v.header_identity
        assert v.header_identity.startswith("cutlass-")
        assert dict(v.defines)["WGMMA"] <= (v.sm == 90)  # warpgroup variants: sm_90a only
    # each SM's mma.sync variants at its own defaults (sm_120: 32-key tiles, 99 KB a CTA)
    tiles = {(v.sm, dict(v.defines)["TILE_N"]) for v in variants if dict(v.defines)["NUM_WARPS"] == 4}
    assert tiles == {(90, 64), (100, 64), (120, 32)}


def test_backend_protocol_and_supports():
    from drafter_attn.kernels import cutlass_backend as kb

    backend = registry.get("cutlass")
    assert isinstance(backend, registry.Backend) and backend.name == "cutlass"
    main = Problem(PRESETS[MAIN_PRESET], "paged", 64, 8, 4096)
    assert backend.supports(main) is None
    assert backend.default_params(main) == {"tile_n": 64, "stages": 3, "num_splits": 0,
                                            "q_smem": False, "min_ctas": 1, "wgmma": False}
    assert set(backend.tunables(main)) == set(backend.default_params(main))
    laguna = Problem(PRESETS["laguna-dflash"], "arena", None, 2, 1000)
    # 9 warps (168 registers a thread): Q in shared memory, 32-key tiles
    assert backend.params_for(laguna) == kb.Params(tile_n=32, stages=3, q_smem=True)
    with pytest.raises(ValueError, match="unknown cutlass params"):
        backend.with_params(skip_compute=True)  # a cupy-only knob
    assert backend.with_params(tile_n=32).params_for(main).tile_n == 32
    assert "head_dim 96" in backend.supports(Problem(Geometry(8, 2, 96, 16), "paged", 64, 1, 10))
    assert "query rows exceed" in backend.supports(Problem(Geometry(32, 1, 128, 16), "arena",
                                                           None, 1, 10))
    with pytest.raises(ValueError, match="tile_n=8 must be a power of two from 16"):
        backend.with_params(tile_n=8)  # out-of-range values are refused before any compile
    with pytest.raises(ValueError, match="stages=1 must be from 2"):
        backend.with_params(stages=1)
    assert "smem" in backend.with_params(tile_n=128, stages=4).supports(
        Problem(PRESETS["laguna-dflash"], "paged", 64, 1, 10))
    # wgmma=True: warpgroup MMAs on sm_90 for whole 64-row warpgroups, mma.sync otherwise
    wg = backend.with_params(wgmma=True)
    assert wg.supports(main) is None and wg.supports(laguna) is None
    for (qb, group, sm), want in {(16, 4, 90): 1, (16, 8, 90): 1, (16, 4, 100): 0,
                                  (16, 9, 90): 0, (10, 4, 90): 1}.items():
        params = wg.params_for(Problem(Geometry(8 * group, 8, 128, qb), "arena", None, 1, 1))
        assert kb.variant_defines("bfloat16", 128, None, qb, group, params, sm)["WGMMA"] == want
    # the host's shared-memory size mirrors the kernel's layout
    assert kb.smem_bytes(64, 3, 128, 4, False) == 3 * 2 * 64 * 136 * 2  # Q borrows stage 3
    assert kb.smem_bytes(64, 3, 128, 9, True) == (3 * 2 * 64 + 144) * 136 * 2
    assert kb.smem_bytes(32, 3, 128, 8, False) == (3 * 2 * 32 + 128) * 136 * 2  # Q too big
    assert kb.smem_bytes(64, 3, 128, 4, False, wgmma=True) == 3 * 2 * 64 * 128 * 2  # swizzled


def test_wgmma_refuses_the_shapes_it_got_wrong():
    """Issue 19: the CuTe wgmma path gave wrong results at head_dim 64 on the H200 (and its
    suspected cause also hits tile_n == head_dim with Q in registers): those shapes are refused
    with a reason (the GPU matrix checks the call raises it); the mma.sync default takes them."""
    d64 = Problem(Geometry(8, 1, 64, 16), "paged", 16, 2, 237)
    d128 = Problem(PRESETS[MAIN_PRESET], "paged", 64, 8, 4096)
    wgmma = registry.from_spec("cutlass:wgmma=1")
    assert "issue 19" in wgmma.supports(d64)
    assert wgmma.supports(d128) is None
    assert "tile_n 128" in wgmma.with_params(tile_n=128).supports(d128)
    assert wgmma.with_params(tile_n=128, q_smem=True).supports(d128) is None
    assert registry.get("cutlass").supports(d64) is None
