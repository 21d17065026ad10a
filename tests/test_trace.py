"""TRACE=1 (kernels/cuda/trace.cuh; scripts/diag_timeline.py): the warp-specialised attention
kernel and the split combine record when each CTA reaches its steps. On the CPU: the traced build
compiles and names its buffers unmangled, and the untraced one has none. On a GPU: the traced
kernels compute what the plain ones do, and every CTA's times come in the order of its steps."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from drafter_attn.kernels import cupy_backend as cb
from drafter_attn.kernels import nvrtc

WS_B1 = "ws=3,tile_n=32,stages=6,lean=1,early_ids=1,combine=2"


def _defines(spec: str, page: int | None = 64, group: int = 4, **extra) -> dict:
    kw = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    return dict(cb.variant_defines("bfloat16", 128, page, 16, group, cb.Params(**kw), 90), **extra)


def _ptx(defines: dict) -> str:
    return Path(nvrtc.compile_cubin(cb.SOURCE, defines, "compute_90a").cubin_path).read_text()


@pytest.mark.parametrize("page", [64, None])
def test_traced_build_has_its_buffers(page):
    traced = _ptx(_defines(WS_B1, page, TRACE=1))
    for name in ("drafter_trace", "drafter_trace_combine"):
        # 4096 CTA rows of 32 u64 slots, by the names diag_timeline reads
        assert re.search(rf"\.global \.align 8 \.b8 {name}\[1048576\];", traced), name
    assert "%globaltimer" in traced and "%smid" in traced
    plain = _ptx(_defines(WS_B1, page))
    assert "drafter_trace" not in plain and "%globaltimer" not in plain


def test_traced_ws_rows_compiles_without_spills():
    res = cb.compile_variant(_defines("ws=3,ws_rows=1,tile_n=32,stages=6,lean=1,early_ids=1,"
                                      "ws_overlap=1", group=9, TRACE=1), 90)
    attn = res.resources["drafter_attention"]
    assert attn.spill_store_bytes == 0 and attn.spill_load_bytes == 0


def _diag():
    path = Path(__file__).resolve().parents[1] / "scripts" / "diag_timeline.py"
    spec = importlib.util.spec_from_file_location("diag_timeline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 2048), (2, 3000)])
def test_trace_on_gpu(batch, ctx):
    import torch

    from drafter_attn.tuner import timing

    d = _diag()
    impl, whole, out = d.one_layer(f"cupy:{WS_B1}", "qwen3-8b-dflash-b16", batch, ctx, 64)
    plain = out.clone()
    out.fill_(float("nan"))
    traced = d.trace_call(impl, torch.cuda.current_device())
    assert traced is not None
    whole()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)  # the trace only stores beside the math
    graph = timing.capture(whole)
    attn, comb = d.sample(graph, d.buffers(traced))
    plan = list(impl._plans.values())[-1]
    assert len(attn) == plan.splits * 8 * batch  # every CTA recorded its entry
    t = attn.astype("int64")
    for a, b in ((d.ENTRY, d.IDS), (d.ENTRY, d.Q), (d.Q, d.FIRST), (d.FIRST, d.LOOP),
                 (d.LOOP, d.MERGE_IN), (d.LAST_LOOP, d.MERGE_IN), (d.LOOP1, d.MERGE_IN),
                 (d.MERGE_IN, d.MERGED), (d.MERGED, d.STORED)):
        assert (t[:, a] <= t[:, b]).all(), (a, b)
    if plan.splits > 1:  # the combine starts once every attention CTA has stored
        assert len(comb) > 0
        assert comb[:, d.ENTRY].astype("int64").min() >= t[:, d.STORED].max()
        assert (comb[:, d.STORED] >= comb[:, d.ENTRY]).all()
    f = d.figures(attn, comb)
    assert 0 < f["first_tile_med"] < f["stored_max"] <= f["span"]
