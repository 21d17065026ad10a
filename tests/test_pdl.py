"""`pdl=1` on the warp-specialised kernel: its split combine launched as the attention's
programmatic dependent (griddepcontrol; cuLaunchKernelEx, in a graph a programmatic edge). On the
CPU: what it compiles to, what it refuses, and the launch structures against cuda.h; on a GPU
(`gpu` marker): a split call's result by both launch paths (the call's own graph with its
programmatic edge, and a captured graph). tests/test_backends_gpu.py runs it over the matrix."""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import launch, registry, static_profile
from drafter_attn.kernels.presets import MAIN_PRESET, get_preset
from drafter_attn.kernels.spec import Problem

from test_cutlass_compile import _nvcc

WS = "cupy:ws=3,tile_n=32,stages=9,early_ids=1"


def _problem(batch=1, ctx=8192):
    return Problem(get_preset(MAIN_PRESET), "paged", 64, batch, ctx)


def _defines(spec: str) -> dict:
    return cb.variant_defines("bfloat16", 128, 64, 16, 4, registry.from_spec(spec).params_for(_problem(), 90), 90)


def test_pdl_is_wss_and_named_only_when_on():
    assert _defines(f"{WS},pdl=1") == {**_defines(WS), "PDL": 1}
    assert "ws=2..4" in registry.from_spec("cupy:pdl=1").supports(_problem(), 90)
    assert cb.tunables()["pdl"] == [False, True]


@pytest.mark.parametrize("combine", [1, 2])
def test_pdl_build_launches_dependents_and_waits_before_reading_a_partial(cache_dir, combine):
    """launch_dependents compiles to PREEXIT in the attention kernel, griddepcontrol.wait to
    ACQBULK ahead of the combine's first global load; neither is in the plain build."""
    sass = {}
    for extra in ("", ",pdl=1"):
        res = cb.compile_variant(_defines(f"{WS},combine={combine}{extra}"), 90)
        assert res.spills == 0
        sass[extra] = {fn: static_profile.sass_text(res.cubin_path, fn)
                       for fn in ("drafter_attention", "drafter_combine")}
    on, off = sass[",pdl=1"], sass[""]
    assert "PREEXIT" in on["drafter_attention"] and "PREEXIT" not in off["drafter_attention"]
    combine_code = on["drafter_combine"]
    assert "ACQBULK" not in off["drafter_combine"]
    first_load = re.search(r"\bLDG\b|\bLD\.", combine_code)
    assert first_load and combine_code.find("ACQBULK") < first_load.start()


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
  std::printf("%zu %zu %zu %d %d\n", sizeof(CUgraphEdgeData), offsetof(CUgraphEdgeData, type),
              offsetof(CUgraphEdgeData, to_port), CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC,
              (int)CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC);
  return 0;
}
"""


def test_launch_structures_match_cuda_h(tmp_path):
    """LaunchAttribute, LaunchConfig and EdgeData (ctypes) against cuda.h's own layout and
    constants, built for the host with nvcc."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (cuda.h defines the structures)")
    src = tmp_path / "probe.cpp"
    src.write_text(LAYOUT_PROBE)
    exe = tmp_path / "probe"
    build = subprocess.run([nvcc, "-w", "-o", str(exe), str(src)], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    attr, config, edge = subprocess.run([str(exe)], capture_output=True, text=True,
                                        timeout=60).stdout.split("\n")[:3]
    A, C, E = launch.LaunchAttribute, launch.LaunchConfig, launch.EdgeData
    assert tuple(map(int, attr.split())) == (ctypes.sizeof(A), A.value.offset, A.value.size,
                                            launch.PROGRAMMATIC_STREAM_SERIALIZATION)
    assert tuple(map(int, config.split())) == (ctypes.sizeof(C), C.smem.offset, C.stream.offset,
                                              C.attrs.offset, C.num_attrs.offset, C.block.offset)
    # the edge _Graph adds for a programmatic launch: EdgeData(from_port 1, to_port 0, type 1)
    assert tuple(map(int, edge.split())) == (ctypes.sizeof(E), E.type.offset, E.to_port.offset, 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("combine", [1, 2])
def test_pdl_split_call_by_its_graph_and_captured(combine):
    """B=2, ragged contexts (splits on an H200): the eager call (the call's own graph, with its
    programmatic edge) matches the reference, and a captured graph's replays reproduce it."""
    import torch

    from drafter_attn.kernels import reference
    from drafter_attn.kernels.cache import random_paged_context

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is sm_90a's")
    g = get_preset(MAIN_PRESET)
    impl = registry.from_spec(f"{WS},pdl=1,combine={combine}")
    gen = torch.Generator().manual_seed(combine)
    lens = [7000, 130]
    cache = random_paged_context(g, lens, 64, "cuda", gen)
    q = torch.randn(2, g.block_size, g.num_q_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    kb = torch.randn(2, g.block_size, g.num_kv_heads, g.head_dim, generator=gen).to("cuda", g.torch_dtype)
    vb = torch.randn_like(kb)
    want = reference.paged_attention(q, kb, vb, *cache).float()
    out = torch.full_like(q, float("nan"))
    for _ in range(3):  # the first call plans; the later ones run the call's own graph
        out.fill_(float("nan"))
        impl.paged_attention(q, kb, vb, *cache, out=out)
    torch.cuda.synchronize()
    (plan,) = impl._plans.values()
    assert plan.splits > 1 and plan.combine.programmatic
    assert plan.launches.no_graph is None and plan.launches.graphs  # the edge was accepted
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    replayed = torch.full_like(q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.paged_attention(q, kb, vb, *cache, out=replayed)
    for _ in range(3):
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)
