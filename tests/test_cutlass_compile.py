"""The cutlass backend's CuTe kernels compile with NVRTC on a machine without a GPU (CPU test).

The main preset's default variants (paged 64 and arena) are compiled once per session for sm_90a,
sm_100 and sm_103, plus its warpgroup-MMA variants (wgmma=True) for sm_90a (the on-disk cubin
cache makes later runs instant); every kernel must be free of spills, and the SASS (cuobjdump
-sass) must hold tensor-core MMAs (HMMA, or HGMMA for wgmma), the cp.async and ldmatrix the CuTe
atoms stand for, and no trap instruction. Host-side nvcc builds of tests/cute_layout_check.cu
check the gather partitions and what the MMAs read; the wgmma SASS of the shapes where Q and P
have one fragment size is checked for Q's registers surviving the KV loop (issue #19).
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
            # 3 stages x (K + V) 64 x (128 + 8) (padded rows; Q borrows the third stage) or
            # 64 x 128 (swizzled, wgmma; plus the 64 x 128 Q tile, re-read for every KV tile)
            assert r["smem_dynamic"] == (98304 + 16384 if _wgmma(r) else 104448)


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
# variants, the 9-warp default (32-key tiles, Q in shared memory, 8 threads that do not load) and
# the wgmma variants at head_dim 64 (one 128-byte swizzle atom per row; 1 and 2 warpgroups)
LAYOUT_CASES = [(128, 64, 4, 3, 0, 0), (128, 32, 9, 3, 1, 0), (128, 64, 4, 3, 0, 1),
                (64, 64, 4, 3, 0, 1), (64, 64, 8, 3, 0, 1)]


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


def _nvcc_build(folder: str, source: Path, defines: list[str], extra: tuple[str, ...] = ()) -> Path:
    """nvcc output for `source` (the kernel headers on the include path), cached by content
    under the cubin cache's parent; skips the test without nvcc."""
    import hashlib

    from drafter_attn.kernels import cutlass_backend as kb
    from drafter_attn.kernels.nvrtc import CUDA_SRC_DIR, cache_dir

    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit builds this check)")
    digest = hashlib.sha256(source.read_bytes())
    for path in sorted(CUDA_SRC_DIR.glob("*.cu*")):
        digest.update(path.read_bytes())
    toolchain = [os.path.realpath(nvcc), kb.header_identity()]
    digest.update(" ".join([*defines, *extra, *toolchain]).encode())
    out = cache_dir().parent / folder / f"{source.stem}-{digest.hexdigest()[:20]}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        build = subprocess.run(
            [nvcc, "-std=c++17", "-w", "-arch=sm_90a", f"-I{kb.include_dir()}",
             f"-I{CUDA_SRC_DIR}", *defines, *extra, "-o", str(tmp), str(source)],
            capture_output=True, text=True, timeout=900)
        assert build.returncode == 0, build.stderr[-4000:]
        os.replace(tmp, out)
    return out


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=lambda c: "d{}-n{}-w{}-s{}-q{}-wg{}".format(*c))
def test_gather_partitions_match_the_smem_layouts(case):
    """Built for the host with nvcc (cached by content): the CuTe copy partitions the kernel's
    gathers use put every row where its layouts (and the page-id lookup) expect, and the MMAs
    read what the kernel means them to (with wgmma: K and V through the GMMA descriptors, Q
    through ldmatrix, emulated from the PTX ISA's layouts)."""
    names = ("HEAD_DIM", "TILE_N", "NUM_WARPS", "STAGES", "Q_SMEM", "WGMMA")
    defines = [f"-D{k}={v}" for k, v in zip(names, case)] + ["-DPAGE_SIZE=64", "-DDTYPE_BF16=1"]
    exe = _nvcc_build("layout_check", Path(__file__).with_name("cute_layout_check.cu"), defines)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


_SASS_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Za-z0-9_.]+)\s*([^;]*);")
_NO_DEST = ("ST", "LDGSTS", "BRA", "BAR", "EXIT", "RET", "WARPSYNC", "BSSY", "BSYNC", "DEPBAR",
            "LDGDEPBAR", "MEMBAR", "FENCE", "WARPGROUP", "NOP", "CALL", "YIELD", "RED", "CCTL")


def _written_registers(op: str, operands: list[str]) -> set[int]:
    """General registers an instruction writes (its first operand, with the width the opcode
    implies; SHFL's comes after its predicate)."""
    if op.startswith(_NO_DEST) or not operands:
        return set()
    dest = operands[1] if op.startswith("SHFL") and len(operands) > 1 else operands[0]
    m = re.fullmatch(r"R(\d+)(?:\.reuse)?", dest)
    if not m:
        return set()
    if op.startswith("HGMMA"):
        width = int(re.search(r"64x(\d+)x", op).group(1)) // 2  # fp32 accumulators
    elif op.startswith("LDSM"):
        width = int(op[-1]) if op[-1].isdigit() else 1
    elif ".128" in op:
        width = 4
    elif ".64" in op or op.startswith("IMAD.WIDE"):
        width = 2
    else:
        width = 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def q_operand_clobbers(sass: str) -> list[str]:
    """For drafter_attention with wgmma: the registers S = Q K^T reads Q from (the A operands of
    the HGMMAs without .tnspB) must hold Q whenever the KV loop (the backward branch around
    them) comes back to them. Either an ldmatrix reloads each of them in the loop before the
    first S HGMMA, or nothing in the loop writes it. Returns the violations."""
    instrs, func = [], None
    for line in sass.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            func = m.group(1)
        elif func == "drafter_attention" and (m := _SASS_INSTR.search(line)):
            operands = [t.strip() for t in m.group(3).split(",")]
            instrs.append((int(m.group(1), 16), m.group(2), operands))
    s_mma = [(a, ops) for a, op, ops in instrs
             if op.startswith("HGMMA") and not any("tnspB" in t for t in ops)]
    assert s_mma, "no S = Q K^T HGMMA in drafter_attention"
    first, last = s_mma[0][0], s_mma[-1][0]
    q_regs = set()
    for _, ops in s_mma:
        base = int(re.match(r"R(\d+)", ops[1]).group(1))
        q_regs |= set(range(base, base + 4))  # 8 bf16/fp16 of a 64x16 A fragment per thread
    loops = [(a, int(ops[0], 16)) for a, op, ops in instrs
             if op == "BRA" and a > last and ops[0].startswith("0x") and int(ops[0], 16) <= first]
    assert loops, "no KV loop around the S HGMMAs"
    head, latch = min(t for _, t in loops), max(a for a, _ in loops)
    last_write = {}
    for a, op, ops in instrs:
        if head <= a < first:
            for r in _written_registers(op, ops) & q_regs:
                last_write[r] = op
    bad = []
    for r in sorted(q_regs):
        if r in last_write:
            if not last_write[r].startswith("LDSM"):
                bad.append(f"R{r} is set by {last_write[r]}, not reloaded, before S")
            continue
        writes = [f"{a:#x} {op} {', '.join(ops)}" for a, op, ops in instrs
                  if head <= a <= latch and r in _written_registers(op, ops)]
        if writes:
            bad.append(f"R{r} (Q, loaded before the KV loop) is overwritten in it: {writes[0]}")
    return bad


def test_q_operand_check_on_sass_listings():
    """The SASS check itself, on hand-written listings: Q held across the loop and overwritten by
    P's packing (the NVRTC/ptxas 13.0 build of issue #19), kept intact, and reloaded per tile."""
    def listing(body):
        return "\n".join(["        Function : drafter_attention"] + [
            f"        /*{a:04x}*/                   {text} ;" for a, text in body])

    loaded_once = [(0x100, "LDSM.16.M88.4 R88, [R27]"), (0x110, "LDSM.16.M88.4 R92, [R28]"),
                   (0x200, "DEPBAR.LE SB0, 0x1"),
                   (0x300, "HGMMA.64x64x16.F32.BF16 R24, R88, gdesc[UR20], RZ, !UPT"),
                   (0x310, "HGMMA.64x64x16.F32.BF16 R24, R92, gdesc[UR20], R24, gsb0")]
    clobbered = loaded_once + [(0x400, "F2FP.BF16.F32.PACK_AB R88, R25, R24"),
                               (0x410, "F2FP.BF16.F32.PACK_AB R89, R27, R26"),
                               (0x500, "HGMMA.64x64x16.F32.BF16 R56, R88, gdesc[UR20].tnspB, R56"),
                               (0x600, "@!P3 BRA 0x200")]
    kept = loaded_once + [(0x400, "F2FP.BF16.F32.PACK_AB R104, R25, R24"),
                          (0x500, "HGMMA.64x64x16.F32.BF16 R56, R104, gdesc[UR20].tnspB, R56"),
                          (0x600, "@!P3 BRA 0x200")]
    reloaded = [(0x200, "DEPBAR.LE SB0, 0x1"), (0x210, "LDSM.16.M88.4 R88, [R27]"),
                (0x220, "LDSM.16.M88.4 R92, [R28]")] + loaded_once[3:] + clobbered[5:]
    bad = q_operand_clobbers(listing(clobbered))
    assert [b.split()[0] for b in bad] == ["R88", "R89"] and "0x400 F2FP" in bad[0], bad
    assert q_operand_clobbers(listing(kept)) == []
    assert q_operand_clobbers(listing(reloaded)) == []


# (HEAD_DIM, TILE_N) of wgmma variants (4 warps, page 64, bf16) whose Q and P fragments have one
# size: the shapes ptxas 13.0 gave both the same registers in (issue #19; head_dim 64 at the
# default 64-key tiles), and the main preset's shape
SASS_Q_CASES = [(64, 64), (128, 128), (128, 64)]


@pytest.mark.parametrize("toolchain", ["nvrtc", "nvcc"])
@pytest.mark.parametrize("case", SASS_Q_CASES, ids=lambda c: "d{}-n{}".format(*c))
def test_wgmma_q_fragment_survives_the_kv_loop(case, toolchain):
    """sm_90a SASS of the wgmma kernel, built by this environment's NVRTC (the backend's own
    route) and by nvcc where a CUDA toolkit is installed (a second ptxas version): the registers
    S = Q K^T reads Q from are reloaded in the KV loop or never written there. With Q held in
    registers across the loop, the CUDA 13.0 ptxas put P in them at these shapes, and S was
    computed from P from the second KV tile on."""
    from drafter_attn.kernels import cutlass_backend as kb
    from drafter_attn.kernels.nvrtc import CUDA_SRC_DIR

    head_dim, tile_n = case
    params = kb.Params(tile_n=tile_n, wgmma=True)
    defines = kb.variant_defines("bfloat16", head_dim, 64, 16, 4, params, 90)
    assert defines["WGMMA"] == 1 and defines["NUM_WARPS"] == 4
    if toolchain == "nvrtc":
        reason = _nvrtc_available()
        if reason:
            pytest.skip(reason)
        cubin = str(kb.compile_variant(defines, 90).cubin_path)
    else:
        flags = [f"-D{k}={v}" for k, v in sorted(defines.items())]
        cubin = str(_nvcc_build("sass_check", CUDA_SRC_DIR / kb.SOURCE, flags,
                                ("-cubin", *kb.NVRTC_OPTIONS)))
    bad = q_operand_clobbers(_sass(cubin))
    assert not bad, f"{toolchain} {defines}: " + "; ".join(bad[:4])


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
    # swizzled rows, and Q in its own tile (re-read for every KV tile on the wgmma path)
    assert kb.smem_bytes(64, 3, 128, 4, False, wgmma=True) == (3 * 2 * 64 + 64) * 128 * 2


def test_wgmma_accepts_the_shapes_issue_19_got_wrong():
    """Issue 19: the CuTe wgmma path gave wrong results at head_dim 64 on the H200 (Q held in
    registers across the KV loop, and ptxas gave them to P whenever tile_n == head_dim). With Q
    re-read from shared memory per tile (test_wgmma_q_fragment_survives_the_kv_loop checks the
    SASS; scripts/gpu_cute_check.sh the results on the H200) those shapes are accepted again, and
    run on the warpgroup path on sm_90 rather than falling back to mma.sync."""
    from drafter_attn.kernels import cutlass_backend as kb

    d64 = Problem(Geometry(8, 1, 64, 16), "paged", 16, 2, 237)
    d128 = Problem(PRESETS[MAIN_PRESET], "paged", 64, 8, 4096)
    wgmma = registry.from_spec("cutlass:wgmma=1")
    for backend, problem in [(wgmma, d64), (wgmma, d128), (wgmma.with_params(tile_n=128), d128),
                             (wgmma.with_params(tile_n=128, q_smem=True), d128),
                             (registry.get("cutlass"), d64)]:
        assert backend.supports(problem) is None, (backend, problem)
        assert backend.supports(problem, sm=90) is None, (backend, problem)
    g = d64.geometry
    params = wgmma.params_for(d64)
    assert params.wgmma and params.tile_n == 64 == g.head_dim and not params.q_smem
    defines = kb.variant_defines(g.dtype, g.head_dim, d64.page_size, g.block_size, g.group,
                                 params, 90)
    assert defines["WGMMA"] == 1
