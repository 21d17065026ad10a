"""SM targets come from the installed NVRTC (nvrtcGetSupportedArchs), and a GPU no table knows still
gets code: its exact cubin where NVRTC supports it, else PTX the driver JITs. CPU tests, plus one
GPU test (marker `gpu`) that runs the cupy backend with the device's SM faked as 999."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

from drafter_attn.kernels import nvrtc
from drafter_attn.tuner import cli

# nvrtcGetSupportedArchs of NVRTC 13.5 (the wheel `make install` brings) and of CUDA 13.0's NVRTC
NVRTC_13_5 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121)
NVRTC_13_0 = (75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121)


def _need_nvrtc():
    try:
        nvrtc.supported_sms()
        nvrtc.cuda_include_dir()
    except nvrtc.CompileError as exc:
        pytest.skip(f"no NVRTC toolchain here: {exc}")


# -- the pure choices ---------------------------------------------------------------------------


@pytest.mark.parametrize("sm,arch", [(90, "sm_90a"), (100, "sm_100"), (103, "sm_103"),
                                     (107, "sm_107"), (110, "sm_110"), (120, "sm_120"),
                                     (121, "sm_121"), (80, "sm_80")])
def test_arch_specific_only_where_the_kernels_need_it(sm, arch):
    assert nvrtc.arch_for_sm(sm, NVRTC_13_5) == arch


def test_arch_for_an_sm_this_nvrtc_lacks_names_what_it_knows(monkeypatch):
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (13, 0))
    with pytest.raises(nvrtc.UnsupportedArch) as info:
        nvrtc.arch_for_sm(107, NVRTC_13_0)
    msg = str(info.value)
    assert "NVRTC 13.0 cannot compile for SM 107" in msg and "103, 110" in msg
    with pytest.raises(nvrtc.UnsupportedArch, match="newer nvidia-cuda-nvrtc"):
        nvrtc.arch_for_sm(130, NVRTC_13_0)


@pytest.mark.parametrize("device_sm,supported,arch", [
    (90, NVRTC_13_5, "sm_90a"),           # a known GPU: its own cubin
    (107, NVRTC_13_5, "sm_107"),          # Vera Rubin with NVRTC >= 13.4: exact cubin
    (107, NVRTC_13_0, "compute_103"),     # ... with an NVRTC that predates it: PTX of 10.3
    (999, NVRTC_13_5, "compute_121"),     # an SM no table knows: the highest PTX not above it
    (95, NVRTC_13_5, "compute_90"),       # plain PTX: compute_90a would run on SM 90 only
    (125, NVRTC_13_5, "compute_121"),
])
def test_device_target_route(device_sm, supported, arch):
    target = nvrtc.device_target(device_sm, supported)
    assert target.arch == arch
    assert target.ptx == arch.startswith("compute_")
    assert ("JIT-compiled by the driver" in target.describe()) == target.ptx


def test_device_target_refuses_gpus_below_the_kernels_minimum():
    with pytest.raises(nvrtc.UnsupportedArch, match="SM 80 or newer"):
        nvrtc.device_target(75, NVRTC_13_5)
    with pytest.raises(nvrtc.UnsupportedArch, match="SM 80 or newer"):
        nvrtc.device_target(70, NVRTC_13_5)


def test_supported_sms_are_the_compilers():
    _need_nvrtc()
    from cuda.bindings import nvrtc as raw

    err, archs = raw.nvrtcGetSupportedArchs()
    assert nvrtc.supported_sms() == tuple(sorted(archs))
    assert nvrtc.compile_targets() == tuple(a for a in sorted(archs) if a >= 80)


# -- the runtime route, compiled for real (no GPU) ----------------------------------------------


def test_unknown_sm_compiles_ptx_and_says_so_once(monkeypatch, tmp_path):
    """The cupy backend's compile for a device that pretends to be SM 999: PTX of the highest
    supported compute capability (no wgmma), one RuntimeWarning, never 'not a compile target'."""
    _need_nvrtc()
    from drafter_attn.kernels import cupy_backend as cb
    from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS

    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path))
    nvrtc._announce.cache_clear()
    g = PRESETS[MAIN_PRESET]
    defines = cb.variant_defines(g.dtype, g.head_dim, 64, g.block_size, g.group,
                                 cb.default_params(), 999)
    assert defines["WGMMA"] == 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = cb.compile_variant(defines, 999)
        again = cb.compile_variant(defines, 999)
    want = f"compute_{max(nvrtc.supported_sms())}"
    notes = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert notes == [f"SM 999 is not a target of this NVRTC: running PTX for {want}, "
                     "JIT-compiled by the driver"]
    assert first.arch == want and first.cubin_path.suffix == ".ptx" and again.cached
    ptx = first.cubin_path.read_text()
    assert f".target sm_{want.removeprefix('compute_')}" in ptx
    assert ".entry drafter_attention" in ptx and "mma.sync.aligned" in ptx
    assert "wgmma" not in ptx


# -- tuner compile --------------------------------------------------------------------------------


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,message", [
    (["--presets", "nosuch"], "--presets: unknown preset(s) nosuch; known: qwen3-8b-dflash-b16"),
    (["--pages", "0"], "--pages: 0 not a page size the kernels compile (8, 16, 32"),
    (["--pages", "64,12"], "--pages: 12 not a page size"),
    (["--sm", "75"], "SM 75: the kernels need SM 80 or newer"),
    (["--sm", "90,1300"], "cannot compile for SM 1300; it knows"),
    (["--workers", "0"], "--workers: expected a positive number, got 0"),
])
def test_compile_bad_input_is_one_line_and_exit_2(capsys, tmp_path, argv, message):
    if "--sm" in argv:
        _need_nvrtc()
    db = tmp_path / "c.db"
    rc, out, err = _run(capsys, "compile", *argv, "--db", db)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tuner compile: ") and message in err
    assert not db.exists()


def test_compile_without_cuda_bindings(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails as when not installed
    monkeypatch.setattr(nvrtc, "_nvrtc", nvrtc._nvrtc.__wrapped__)
    monkeypatch.setattr(nvrtc, "supported_sms", nvrtc.supported_sms.__wrapped__)
    rc, out, err = _run(capsys, "compile", "--sm", "107", "--no-db")
    assert rc == 2 and out == ""
    assert err == ("tuner compile: cuda-bindings is not installed: "
                   "pip install 'drafter-attn-suite[cu13]' (or [cu12])\n")


def test_compile_all_means_every_nvrtc_target_from_80(capsys, monkeypatch):
    from drafter_attn.kernels import static_profile

    monkeypatch.setattr(nvrtc, "supported_sms", lambda: NVRTC_13_5)
    seen = {}

    def fake_compile(sms, variants, workers=None):
        seen.update(sms=sms, variant_sms={v.sm for v in variants})
        return []

    monkeypatch.setattr(static_profile, "compile_variants", fake_compile)
    rc, _, _ = _run(capsys, "compile", "--sm", "all", "--backend", "cupy", "--no-db",
                    "--presets", "gpt-oss-20b-dflash")
    assert rc == 0 and seen["sms"] == NVRTC_13_5[1:]
    assert seen["variant_sms"] == set(NVRTC_13_5[1:])


def test_compile_sm_107_stores_its_profile(capsys, monkeypatch, tmp_path):
    """`tuner compile --sm 107` on this CPU machine: real NVRTC compiles, stored per SM (the
    arena variant of one request, whose split combine runs a CTA a row, and of a batch: 2 x 3
    kernels)."""
    _need_nvrtc()
    if 107 not in nvrtc.supported_sms():
        pytest.skip(f"NVRTC {nvrtc.nvrtc_version()} predates SM 107 (13.4+)")
    from drafter_attn.kernels import static_profile

    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path / "cache"))
    db = tmp_path / "c.db"
    rc, out, err = _run(capsys, "compile", "--sm", "107", "--presets", "gpt-oss-20b-dflash",
                        "--pages", "", "--backend", "cupy", "--workers", "1", "--db", db)
    assert rc == 0, err
    assert "static compile profile" in out and "6 kernel profiles stored" in err
    rc, out, _ = _run(capsys, "show", "--compile", "--sm", "107", "--db", db, "--format", "json")
    rows = json.loads(out)
    assert {r["kernel"] for r in rows} == {"drafter_attention", "drafter_combine", "drafter_store"}
    assert all(r["sm"] == 107 and r["arch"] == "sm_107" and r["spill_bytes"] == 0 for r in rows)
    if static_profile.cuobjdump_path():
        summary = static_profile.sass_summary(next(iter(
            (tmp_path / "cache" / "cubins").glob("*sm_107*.cubin"))).as_posix())
        assert summary["drafter_attention"] == {"mma": "HMMA", "traps": 0}


def test_parse_sass_finds_mmas_and_traps():
    from drafter_attn.kernels.static_profile import parse_sass, sass_problems

    listing = """
        Function : drafter_attention
        /*0100*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0110*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24 ;
        Function : drafter_store
        /*0000*/                   BPT.TRAP 0x1 ;
    """
    sass = parse_sass(listing)
    assert sass == {"drafter_attention": {"mma": "HGMMA+HMMA", "traps": 0},
                    "drafter_store": {"mma": "", "traps": 1}}
    rows = [dict(sm=107, variant="v", kernel=k, **v) for k, v in sass.items()]
    rows.append(dict(sm=107, variant="w", kernel="drafter_attention", mma="", traps=0))
    assert sass_problems(rows) == ["sm 107 v drafter_store: 1 trap instruction(s)",
                                   "sm 107 w drafter_attention: no tensor-core MMA in the SASS"]


# -- datasheets and predictions for the new targets -------------------------------------------


def test_datasheets_cover_every_target_with_a_public_figure():
    from drafter_attn.tuner.predict import load_datasheets, target_gpu

    gpus = load_datasheets()
    # every NVRTC 13.5 target the kernels run on, but SM 88 (no public GPU: said in the file)
    for sm in (s for s in NVRTC_13_5 if s >= 80 and s != 88):
        assert target_gpu(gpus, sm).sm == sm
    assert all(g.source and "nvidia" in g.source.lower() for g in gpus)
    rubin = target_gpu(gpus, 107)
    assert rubin.name.startswith("Vera Rubin") and rubin.bandwidth_tbs == 22.0


def test_predict_report_show_and_decode_for_sm_107(capsys, monkeypatch, tmp_path):
    """`tuner predict --sm 107` projects the H200's measured rows onto Vera Rubin; `tuner show`,
    `bench report` and `bench decode --sm 107` on another GPU all say they are predicted."""
    from profile_fakes import H200, build_db

    from drafter_attn.bench import cli as bench_cli
    from drafter_attn.bench import gpu

    db = tmp_path / "p.db"
    rows = [dict(layout=layout, page=page, batch=8, ctx=ctx, median_us=100.0 + ctx / 100,
                 bytes_moved=8 * ctx * 20480, attention_median_us=80.0, store_median_us=20.0)
            for layout, page in (("paged", 128), ("arena", None)) for ctx in (2048, 8192)]
    build_db(db, {"h": (H200, rows)})
    assert cli.main(["predict", "--sm", "107", "--db", str(db)]) == 0
    assert "4 predicted rows written from sm90" in capsys.readouterr().err

    rc, out, _ = _run(capsys, "show", "--sm", "107", "--db", db, "--format", "json")
    shown = json.loads(out)
    assert rc == 0 and len(shown) == 4
    assert {r["provenance"] for r in shown} == {"predicted"}
    assert {r["gpu_name"] for r in shown} == {"Vera Rubin (Rubin GPU) (predicted from NVIDIA H200)"}
    for r, src in zip(shown, rows):  # H200's efficiency x Rubin's bandwidth: times 4.8 / 22
        assert r["median_us"] == pytest.approx(src["median_us"] * 4.8 / 22.0)
        assert r["reason"].startswith("predicted: roofline projection")

    out_dir = tmp_path / "report"
    assert bench_cli.main(["report", "--sm", "107", "--db", str(db), "--out", str(out_dir)]) == 0
    md = (out_dir / "report.md").read_text()
    assert "0 measured and 4 predicted rows" in md
    assert "## SM 107, Vera Rubin (Rubin GPU) (predicted from NVIDIA H200)" in md

    capsys.readouterr()
    monkeypatch.setattr(gpu, "probe", lambda: [gpu.GpuInfo(0, "NVIDIA H200", 90, 132, 141 << 30)])
    assert bench_cli.main(["decode", "--sm", "107", "--page", "128", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "--sm 107 does not match the GPU here" in err and "SM 107 (Vera Rubin (Rubin))" in err
    assert "predicted rows recorded for SM 107" in err
    assert "4 for Vera Rubin (Rubin GPU) (predicted from NVIDIA H200)" in err
    # without predictions, it says how to make them
    empty = tmp_path / "e.db"
    build_db(empty, {"h": (H200, rows)})
    assert bench_cli.main(["decode", "--sm", "107", "--db", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "tuner predict --sm 107" in err and "predicted rows recorded" not in err


def test_fresh_install_predicts_sm_107_from_the_shipped_measurements(capsys, monkeypatch, tmp_path):
    """No --db anywhere, as on a fresh clone: `tuner predict --sm 107` reads the H200 rows
    shipped in profiles/sm90.db (never writing it) and stores its predictions in the database
    in use, where `tuner show`, `bench report` and `bench decode`'s exit-2 message find them."""
    import hashlib

    from profile_fakes import H200, build_db

    from drafter_attn.bench import cli as bench_cli
    from drafter_attn.bench import gpu
    from drafter_attn.kernels import shipped

    package = tmp_path / "profiles"
    package.mkdir()
    rows = [dict(layout="paged", page=128, batch=8, ctx=ctx, median_us=100.0 + ctx / 100,
                 bytes_moved=8 * ctx * 20480) for ctx in (2048, 8192)]
    build_db(package / "sm90.db", {"h": (H200, rows)})
    before = hashlib.sha256((package / "sm90.db").read_bytes()).hexdigest()
    monkeypatch.setattr(shipped, "shipped_dir", lambda: package)
    in_use = tmp_path / "data" / "profile.db"  # does not exist yet
    monkeypatch.setenv("DRAFTER_DB", str(in_use))

    assert cli.main(["predict", "--sm", "107"]) == 0
    err = capsys.readouterr().err
    assert "2 predicted rows written from sm90" in err
    assert f"measured rows read from {package / 'sm90.db'}; predicted rows stored in {in_use}" in err
    assert hashlib.sha256((package / "sm90.db").read_bytes()).hexdigest() == before
    assert cli.main(["predict", "--sm", "107"]) == 0  # again: nothing new
    assert "0 predicted rows written from sm90; 2 predicted before" in capsys.readouterr().err

    rc, out, _ = _run(capsys, "show", "--sm", "107")
    assert rc == 0 and "2 results in" in out and "(predicted from NVIDIA H200)" in out
    out_dir = tmp_path / "report"
    assert bench_cli.main(["report", "--sm", "107", "--out", str(out_dir)]) == 0
    assert "0 measured and 2 predicted rows" in (out_dir / "report.md").read_text()
    capsys.readouterr()
    monkeypatch.setattr(gpu, "probe", lambda: [gpu.GpuInfo(0, "NVIDIA H200", 90, 132, 141 << 30)])
    assert bench_cli.main(["decode", "--sm", "107", "--page", "128"]) == 2
    assert "predicted rows recorded for SM 107" in capsys.readouterr().err
    monkeypatch.setattr(gpu, "probe", lambda: [])  # no GPU at all: the same pointer
    assert bench_cli.main(["decode", "--sm", "107", "--page", "128"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU found" in err and "predicted rows recorded for SM 107" in err
    assert "2 for Vera Rubin (Rubin GPU) (predicted from NVIDIA H200)" in err


def test_predict_reads_the_database_in_use_once_it_holds_measurements(monkeypatch, tmp_path):
    from profile_fakes import H200, build_db

    from drafter_attn.kernels import shipped
    from drafter_attn.tuner.predict import default_source

    package = tmp_path / "profiles"
    package.mkdir()
    row = dict(batch=8, ctx=2048, bytes_moved=1 << 20)
    build_db(package / "sm90.db", {"h": (H200, [row])})
    monkeypatch.setattr(shipped, "shipped_dir", lambda: package)
    in_use = tmp_path / "profile.db"
    assert default_source(in_use, 107) == package / "sm90.db"  # missing: the shipped rows
    assert default_source(in_use, 90) is None  # nothing shipped but the target itself
    build_db(in_use, {"h": (H200, [row])})
    assert default_source(in_use, 107) is None  # measured here: read here
    assert default_source(in_use, 107, from_sm=100) is None  # nothing shipped for sm100 either


# -- on the GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_cupy_runs_on_a_gpu_no_table_knows(monkeypatch, layout):
    """The device pretends to be SM 999. PTX must be JIT-able on the real chip, so the compiler
    is held to the targets up to the real SM (as an NVRTC that predates a new GPU is): the route
    is PTX of compute_<real SM>, and store + attention match the reference."""
    import torch

    from drafter_attn.kernels import cupy_backend as cb
    from drafter_attn.kernels import reference, registry
    from drafter_attn.kernels.cache import random_arena_context, random_paged_context
    from drafter_attn.kernels.presets import MAIN_PRESET, PRESETS

    num_sms, real_sm = cb.device_info(0)
    below = tuple(s for s in nvrtc.supported_sms() if s <= real_sm)
    monkeypatch.setattr(nvrtc, "supported_sms", lambda: below)
    monkeypatch.setattr(cb, "device_info", lambda index: (num_sms, 999))
    cb._loaded.clear()
    nvrtc._announce.cache_clear()
    registry.get("cupy").clear_plans()  # a plan holds the module it loaded
    try:
        g = PRESETS[MAIN_PRESET]
        gen = torch.Generator().manual_seed(15)
        lens = [0, 63, 700, 4097]
        q, kb, vb = (torch.randn(len(lens), g.block_size, h, g.head_dim, generator=gen)
                     .to("cuda", g.torch_dtype)
                     for h in (g.num_q_heads, g.num_kv_heads, g.num_kv_heads))
        if layout == "paged":
            cache = random_paged_context(g, lens, 64, "cuda", gen)
            attend, ref_attend = "paged_attention", reference.paged_attention
        else:
            cache = random_arena_context(g, lens, max(lens) + 5, "cuda", gen)
            attend, ref_attend = "arena_attention", reference.arena_attention
        impl = registry.get("cupy")
        with pytest.warns(RuntimeWarning, match=f"SM 999 .* PTX for compute_{max(below)}"):
            out = getattr(impl, attend)(q, kb, vb, *cache)
        ref = ref_attend(q, kb, vb, *cache)
        torch.cuda.synchronize()
        rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert torch.isfinite(out).all() and rel < 1e-2, rel
    finally:
        cb._loaded.clear()  # later tests load modules for the real SM again
        registry.get("cupy").clear_plans()


def test_predict_names_each_source_gpu_once(capsys, tmp_path):
    """One GPU measured under several environments (kernel sources, driver versions) is one
    source of the projection: `tuner predict` names it once, not once per environment."""
    from profile_fakes import H200, build_db

    db = tmp_path / "p.db"
    rows = [dict(layout="paged", page=64, batch=1, ctx=2048, median_us=20.0, bytes_moved=1 << 23)]
    build_db(db, {f"src-{i}": (dict(H200, sources_hash=f"src-{i}"), rows) for i in range(3)})
    assert cli.main(["predict", "--sm", "107", "--db", str(db)]) == 0
    err = capsys.readouterr().err
    assert err.count("from NVIDIA H200 (") == 1
    assert "3 predicted rows written from sm90" in err


def test_the_compile_cache_follows_the_toolkit_and_the_nvrtc_wheel(tmp_path, monkeypatch):
    """A cached binary is of one toolkit and one NVRTC build: a /usr/local/cuda link moved to
    another toolkit (the same include path), or another patch release of the NVRTC wheel (the
    same major.minor), compiles again instead of serving the old bytes."""
    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path / "cache"))
    link = tmp_path / "cuda"
    link.symlink_to(os.path.dirname(nvrtc.cuda_include_dir()))
    monkeypatch.setenv("CUDA_HOME", str(link))
    ident = nvrtc.toolchain_identity(nvrtc.cuda_include_dir())
    assert ident[0] == os.path.realpath(nvrtc.cuda_include_dir()) and ident[0] != nvrtc.cuda_include_dir()
    arch = nvrtc.arch_for_sm(90)
    first = nvrtc.compile_cubin("read_floor.cu", dict(STAGES=4, CHUNK=16384), arch)
    assert nvrtc.compile_cubin("read_floor.cu", dict(STAGES=4, CHUNK=16384), arch).cached
    monkeypatch.setattr(nvrtc, "toolchain_identity", lambda inc: [ident[0], ["nvidia-cuda-nvrtc==99.0.1"]])
    other = nvrtc.compile_cubin("read_floor.cu", dict(STAGES=4, CHUNK=16384), arch)
    assert not other.cached and other.cubin_path != first.cubin_path
