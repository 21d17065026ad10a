"""CPU: `cupy:cluster=1` (kernels/cuda/cluster_merge.cuh, drafter_attention.cu CLUSTER_COMBINE;
issues 11 and 13), the splits of a (request, KV head) as one thread-block cluster that merges them
through distributed shared memory in the attention launch itself. What runs here: the launch
structures against cuda.h, the parameter checks, the shared memory it asks for, and the variants
compiled for every SM target. The GPU matrix (tests/test_backends_gpu.py, "cupy:cluster=1", and
test_cluster_merges_in_one_launch) checks results on an H200.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc
from drafter_attn.kernels import static_profile as sp
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem

MAIN = PRESETS["qwen3-8b-dflash-b16"]
LAGUNA = PRESETS["laguna-dflash"]


def _problem(g=MAIN, page=64, batch=1, ctx=8192):
    return Problem(g, "paged" if page else "arena", page, batch, ctx)


def test_parameter_checks():
    prob = _problem()
    assert cb.supports(prob, cb.default_params(prob, 90, cluster=True), 90) is None
    assert cb.supports(prob, cb.default_params(prob, 100, cluster=True), 100) is None
    too_many = cb.default_params(prob, 90, cluster=True, num_splits=cb.CLUSTER_MAX_SPLITS + 1)
    assert "at most 16 splits" in cb.supports(prob, too_many, 90)
    forced = cb.default_params(prob, 90, cluster=True, num_splits=cb.CLUSTER_MAX_SPLITS)
    assert cb.supports(prob, forced, 90) is None
    assert "SM 90 or newer" in cb.cluster_reason(cb.Params(cluster=True), prob, 80)
    assert cb.cluster_reason(cb.Params(), prob, 80) is None
    split_rows = cb.default_params(_problem(LAGUNA), 90, cluster=True, row_split=3)
    assert "row_split=1" in cb.supports(_problem(LAGUNA), split_rows, 90)
    with pytest.raises(ValueError, match="row_split=1"):
        cb.variant_defines(LAGUNA.dtype, LAGUNA.head_dim, 64, LAGUNA.block_size, LAGUNA.group,
                           split_rows, 90)


def test_defaults_with_cluster():
    """Off unless asked; asked, laguna keeps its rows in one CTA (a cluster's rank is its split),
    and the variant names CLUSTER_COMBINE while the others do not."""
    prob = _problem()
    assert not cb.default_params(prob, 90).cluster
    assert cb.default_params(_problem(LAGUNA), 90).row_split == 3
    assert cb.default_params(_problem(LAGUNA), 90, cluster=True).row_split == 1
    on = cb.default_params(prob, 90, cluster=True)
    g = MAIN
    assert cb.variant_defines(g.dtype, g.head_dim, 64, g.block_size, g.group, on, 90)[
        "CLUSTER_COMBINE"] == 1
    off = cb.default_params(prob, 90)
    assert "CLUSTER_COMBINE" not in cb.variant_defines(g.dtype, g.head_dim, 64, g.block_size,
                                                       g.group, off, 90)


def test_merge_buffer_fits_the_shared_memory_asked_for():
    """The merge buffer reuses the stages: the CTA asks for at least the buffer, and where the
    buffer is larger than the stages (many-warp CTAs, head_dim 128), for the buffer."""
    assert cb.merge_bytes(128, 4) == 64 * (136 * 4 + 4)
    assert cb.merge_bytes(64, 4) == 64 * (72 * 4 + 4)
    for g in (MAIN, PRESETS["gpt-oss-20b-dflash"], LAGUNA):
        prob = _problem(g)
        on = cb.default_params(prob, 100, cluster=True)
        warps = cb.num_warps(g.block_size, g.group, row_split=on.row_split)
        wg = cb.use_wgmma(on, g.head_dim, warps, 100)
        cta = cb.padded_warps(warps) if wg else warps
        off = cb.dataclasses.replace(on, cluster=False)
        assert on.smem_bytes(g.head_dim, warps, wg, 64) == max(
            off.smem_bytes(g.head_dim, warps, wg, 64), cb.merge_bytes(g.head_dim, cta))
    # 16 warps of 16 rows at head_dim 128: the buffer (141 KB) is more than the stages
    wide = cb.Params(tile_n=16, stages=6, q_smem=True, cluster=True)
    assert wide.smem_bytes(128, 16) == cb.merge_bytes(128, 16) > cb.dataclasses.replace(
        wide, cluster=False).smem_bytes(128, 16)


def test_splits_planned_within_one_cluster():
    """The wave model's split count, capped at a cluster (B=1 ctx 8k: 33 without, 16 with)."""
    free = cb.choose_splits(1, 8, 8192, 64, 132, 2)
    capped = cb.choose_splits(1, 8, 8192, 64, 132, 2, cb.CLUSTER_MAX_SPLITS)
    assert free == 33 and capped == 16


LAYOUT_PROBE = r"""
#include <cstddef>
#include <cstdio>
#include <cuda.h>
int main() {
  std::printf("%zu %zu %zu\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
              sizeof(CUlaunchAttributeValue));
  std::printf("%zu %zu %zu %zu %zu %zu\n", sizeof(CUlaunchConfig),
              offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),
              offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
              offsetof(CUlaunchConfig, blockDimX));
  std::printf("%d %d %d %d\n", (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
              (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE,
              (int)CU_CLUSTER_SCHEDULING_POLICY_SPREAD,
              (int)CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED);
  CUlaunchAttributeValue v;
  std::printf("%zu %zu\n", (size_t)((char*)&v.clusterDim.x - (char*)&v),
              (size_t)((char*)&v.clusterDim.z - (char*)&v));
  return 0;
}
"""


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        path = Path(nvrtc.cuda_include_dir()).parent / "bin" / "nvcc"
    except Exception:
        return None
    return str(path) if path.exists() else None


def test_launch_structures_match_cuda_h(tmp_path):
    """LaunchAttribute / LaunchConfig and the attribute ids against cuda.h's own, built for the
    host with nvcc."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the CUDA toolkit's cuda.h defines the structures)")
    src = tmp_path / "probe.cpp"
    src.write_text(LAYOUT_PROBE)
    exe = tmp_path / "probe"
    build = subprocess.run([nvcc, "-w", "-o", str(exe), str(src)], capture_output=True,
                           text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    lines = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60).stdout.split("\n")
    A, C = cb.LaunchAttribute, cb.LaunchConfig
    assert tuple(map(int, lines[0].split())) == (ctypes.sizeof(A), A.value.offset, A.value.size)
    assert tuple(map(int, lines[1].split())) == (ctypes.sizeof(C), C.smem.offset, C.stream.offset,
                                                 C.attrs.offset, C.num_attrs.offset,
                                                 C.block.offset)
    assert tuple(map(int, lines[2].split())) == (cb._CLUSTER_DIMENSION, cb._CLUSTER_POLICY,
                                                 cb._POLICY_SPREAD, cb._NON_PORTABLE)
    # cluster_config writes the dimension as the value's first three uints
    assert tuple(map(int, lines[3].split())) == (0, 8)
    config, attrs = cb.cluster_config((16, 8, 1), (128, 1, 1), 1000, 16)
    assert list(attrs[0].value[:3]) == [16, 1, 1] and attrs[1].value[0] == cb._POLICY_SPREAD
    assert config.num_attrs == 2 and list(config.grid) == [16, 8, 1] and config.smem == 1000


pytest.importorskip("cuda.bindings.nvrtc")

TARGETS = [sm for sm in (90, 100, 120) if sm in nvrtc.compile_targets()]


@pytest.mark.parametrize("sm", TARGETS)
@pytest.mark.parametrize("preset,page", [("qwen3-8b-dflash-b16", 64), ("qwen3-8b-dflash-b16", None),
                                         ("gpt-oss-20b-dflash", 16), ("laguna-dflash", 64)])
def test_cluster_variants_compile_without_spills(sm, preset, page):
    """The default variant of each SM with the cluster merge: no spill, and its SASS holds the
    two cluster barriers (arrive and wait each), which the plain variant does not."""
    g = PRESETS[preset]
    prob = _problem(g, page)
    barriers = []
    for cluster in (True, False):
        params = cb.default_params(prob, sm, cluster=cluster)
        assert cb.supports(prob, params, sm) is None
        defines = cb.variant_defines(g.dtype, g.head_dim, page, g.block_size, g.group, params, sm)
        result = cb.compile_variant(defines, sm)
        assert result.spills == 0
        text = sp.sass_text(str(result.cubin_path), "drafter_attention")
        if text is None:
            pytest.skip("cuobjdump not found")
        barriers.append((text.count("UCGABAR_ARV"), text.count("UCGABAR_WAIT")))
    assert barriers == [(2, 2), (0, 0)]
