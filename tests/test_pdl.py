"""`cupy:pdl=1`: the split combine launched as the attention kernel's programmatic dependent
(griddepcontrol; SM 90 and newer). On the CPU: what it compiles to, what it refuses, and the
cuLaunchKernelEx structures against cuda.h; on a GPU (`gpu` marker): a split call's results and
its launch path. The GPU matrix (tests/test_backends_gpu.py) checks it on every shape."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc, reference, registry
from drafter_attn.kernels.cache import random_paged_context
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem

MAIN = PRESETS["qwen3-8b-dflash-b16"]


def _problem(batch=1, ctx=8192):
    return Problem(MAIN, "paged", 64, batch, ctx)


def test_pdl_is_off_by_default_and_named_only_when_on():
    cupy = registry.get("cupy")
    for batch in (1, 8, 32):
        assert not cupy.params_for(_problem(batch), 90).pdl
    plain = cb.variant_defines("bfloat16", 128, 64, 16, 4, cupy.params_for(_problem(), 90), 90)
    assert "PDL" not in plain  # the shipped variants keep their defines and their machine code
    on = registry.from_spec("cupy:pdl=1").params_for(_problem(), 90)
    assert cb.variant_defines("bfloat16", 128, 64, 16, 4, on, 90)["PDL"] == 1


def test_pdl_is_refused_below_sm90():
    pdl = registry.from_spec("cupy:pdl=1")
    assert pdl.supports(_problem(), 90) is None
    assert pdl.supports(_problem(), 100) is None
    assert "SM 90 and newer" in pdl.supports(_problem(), 80)
    with pytest.raises(ValueError, match="SM 90 and newer"):
        cb.variant_defines("bfloat16", 128, 64, 16, 4, pdl.params_for(_problem(), 80), 80)


def _sass(spec):
    from drafter_attn.kernels import static_profile as sp
    from drafter_attn.kernels.nvrtc import compile_cubin

    if sp.cuobjdump_path() is None:
        pytest.skip("cuobjdump is not installed")
    params = registry.from_spec(spec).params_for(_problem(), 90)
    defines = cb.variant_defines("bfloat16", 128, 64, 16, 4, params, 90)
    res = compile_cubin(cb.SOURCE, defines, "sm_90a", extra_options=cb.NVRTC_OPTIONS)
    return {fn: sp.sass_text(str(res.cubin_path), fn) for fn in ("drafter_attention", "drafter_combine")}


def test_pdl_build_lets_the_combine_launch_early_and_wait():
    """griddepcontrol.launch_dependents compiles to PREEXIT at the attention kernel's start,
    griddepcontrol.wait to ACQBULK before the combine reads a partial; neither is in the
    default build."""
    on, off = _sass("cupy:pdl=1"), _sass("cupy")
    assert "PREEXIT" in on["drafter_attention"] and "ACQBULK" in on["drafter_combine"]
    combine = on["drafter_combine"]
    first_load = min(i for i in (combine.find(" LDG"), combine.find(" LD.")) if i >= 0)
    assert combine.find("ACQBULK") < first_load
    assert "PREEXIT" not in off["drafter_attention"] and "ACQBULK" not in off["drafter_combine"]


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


LAYOUT_PROBE = r"""
#include <cstddef>
#include <cstdio>
#include <cuda.h>
int main() {
  std::printf("%zu %zu %zu %d\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
              sizeof(CUlaunchAttributeValue), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  std::printf("%zu %zu %zu %zu %zu %zu\n", sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, sharedMemBytes),
              offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
              offsetof(CUlaunchConfig, numAttrs), offsetof(CUlaunchConfig, blockDimX));
  return 0;
}
"""


def test_launch_structures_match_cuda_h(tmp_path):
    """LaunchAttribute / LaunchConfig (ctypes) against the CUDA headers' own layout, built for
    the host with nvcc."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit's cuda.h defines the structures)")
    src = tmp_path / "probe.cpp"
    src.write_text(LAYOUT_PROBE)
    exe = tmp_path / "probe"
    build = subprocess.run([nvcc, "-w", "-o", str(exe), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    attr, config = subprocess.run([str(exe)], capture_output=True, text=True,
                                  timeout=60).stdout.split("\n")[:2]
    A, C = cb.LaunchAttribute, cb.LaunchConfig
    assert tuple(map(int, attr.split())) == (ctypes.sizeof(A), A.value.offset, A.value.size,
                                            cb._PROGRAMMATIC_STREAM_SERIALIZATION)
    assert tuple(map(int, config.split())) == (ctypes.sizeof(C), C.smem.offset, C.stream.offset,
                                              C.attrs.offset, C.num_attrs.offset, C.block.offset)


@pytest.mark.gpu
def test_pdl_split_call_matches_the_reference_by_cuLaunchKernelEx():
    """B=1 ctx 8k (33 splits on an H200): the result matches the reference within the matrix's
    tolerance, the combine is launched programmatically, and a graph replay reproduces it."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA GPU of SM 90 or newer")
    impl = registry.from_spec("cupy:pdl=1")
    gen = torch.Generator().manual_seed(3)
    lens = [8000]
    k_pages, v_pages, table, ctx_lens = random_paged_context(MAIN, lens, 64, "cuda", gen)
    shape = (1, MAIN.block_size, MAIN.num_q_heads, MAIN.head_dim)
    kv = (1, MAIN.block_size, MAIN.num_kv_heads, MAIN.head_dim)
    q = torch.randn(shape, generator=gen).to("cuda", MAIN.torch_dtype)
    kb = torch.randn(kv, generator=gen).to("cuda", MAIN.torch_dtype)
    vb = torch.randn(kv, generator=gen).to("cuda", MAIN.torch_dtype)
    want = reference.paged_attention(q, kb, vb, k_pages, v_pages, table, ctx_lens).double()
    out = torch.full_like(q, float("nan"))
    impl.paged_attention(q, kb, vb, k_pages, v_pages, table, ctx_lens, out=out)
    plan = next(iter(impl._plans.values()))
    assert plan.splits > 1 and plan.combine._ex is not None
    assert torch.isfinite(out).all()
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2  # the matrix's bf16 bound
    graph = torch.cuda.CUDAGraph()
    replayed = torch.full_like(q, float("nan"))
    with torch.cuda.graph(graph):
        impl.paged_attention(q, kb, vb, k_pages, v_pages, table, ctx_lens, out=replayed)
    replayed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)
