"""The sync detector's host-side parts (CPU): call classification, the Nsight Systems export
reader, the missing-nsys message, report rows, the deliberately bad backend."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from drafter_attn.kernels import reference, registry
from drafter_attn.kernels.spec import Geometry, Problem
from drafter_attn.kernels.syncing_store import SyncingStoreBackend
from drafter_attn.tuner import syncs
from drafter_attn.tuner.step import DecodeStep


def test_classify_runtime_counts_blocking_calls_inside_windows():
    calls = [("cudaLaunchKernel", 10, 2), ("cudaStreamSynchronize", 12, 30), ("cudaMemcpyAsync", 50, 3),
             ("cudaMemcpy", 60, 5), ("cudaDeviceSynchronize", 500, 100),  # outside the window
             ("cudaStreamSynchronize_v3020", 70, 4), ("cuCtxSynchronize", 80, 1)]
    r = syncs.classify_runtime(calls, windows=[(0, 100)], dtoh_copies=2)
    assert r.count == 4 and r.host_us == 40 and r.dtoh_copies == 2
    assert r.by_call == {"cudaStreamSynchronize": 2, "cudaMemcpy": 1, "cuCtxSynchronize": 1}
    assert syncs.classify_runtime(calls).count == 5  # no window: everything
    assert syncs.classify_runtime([("cudaLaunchKernel", 0, 1)]).count == 0


def _nsys_export(path, text_column: bool):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    con.executemany("INSERT INTO StringIds VALUES (?, ?)",
                    [(1, "cudaLaunchKernel_v7000"), (2, "cudaStreamSynchronize_v3020"), (3, syncs.MARKER),
                     (4, "cudaMemcpyAsync_v3020")])
    if text_column:
        con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, text TEXT, textId INTEGER)")
        rows = [(1000, 5000, syncs.MARKER, None), (10000, 15000, None, 3), (20000, 21000, "other", None)]
    else:
        con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, text TEXT)")
        rows = [(1000, 5000, syncs.MARKER), (10000, 15000, syncs.MARKER), (20000, 21000, "other")]
    con.executemany("INSERT INTO NVTX_EVENTS VALUES (%s)" % ",".join("?" * len(rows[0])), rows)
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, nameId INTEGER)")
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?)", [
        (1100, 1200, 1), (1300, 1400, 4), (1500, 3500, 2),  # run 1: one sync of 2 us
        (11000, 11100, 1), (11200, 11300, 4), (11400, 13400, 2),  # run 2: the same
        (20100, 20900, 2),  # outside the step's ranges
    ])
    con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, copyKind INTEGER)")
    con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, ?)",
                    [(1350, 1450, 2), (11250, 11350, 2), (11260, 11300, 1), (20500, 20600, 2)])
    con.commit()
    con.close()


def test_parse_nsys_sqlite(tmp_path):
    for text_column in (False, True):
        path = tmp_path / f"r{text_column}.sqlite"
        _nsys_export(path, text_column)
        r = syncs.parse_nsys_sqlite(path, runs=2)
        assert r.count == 1 and r.host_us == 2.0 and r.dtoh_copies == 1
        assert r.by_call == {"cudaStreamSynchronize": 1}


def test_nsys_missing_is_said_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setattr(syncs.nsys_tool, "INSTALL_GLOBS", (str(tmp_path / "*"),))
    result = syncs.nsys_syncs({"problem": {}})
    assert result.syncs is None and result.note.startswith("nsys not found (PATH: no nsys; $NSYS: not set")
    assert "the Nsight Systems layer did not run" in result.note


def test_report_rows_are_null_where_not_measured():
    empty = syncs.SyncReport()
    assert empty.syncs is None and empty.graph_capturable is None
    assert set(empty.as_row().values()) == {None}
    r = syncs.SyncReport(debug_syncs=0, profiler=syncs.RuntimeSyncs(0, 0.0, 0), graph_tried=True,
                         notes=["nsys not found (PATH: no nsys)"])
    row = r.as_row()
    assert r.syncs == 0 and row["syncs_debug"] == 0 and row["syncs_profiler"] == 0
    assert row["graph_capturable"] is True and row["syncs_nsys"] is None
    assert "nsys not found" in row["sync_note"]
    bad = syncs.SyncReport(debug_syncs=5, profiler=syncs.RuntimeSyncs(6, 40.0, 5), graph_tried=True,
                           graph_error="RuntimeError: operation not permitted when stream is capturing")
    assert bad.syncs == 6 and bad.as_row()["graph_capturable"] is False
    assert "graph capture failed" in bad.as_row()["sync_note"]


def test_bad_step_reads_the_block_counts_and_still_computes_the_same(monkeypatch):
    g = Geometry(8, 2, 64, 4, num_layers=2, dtype="float32")
    reads = []
    original = torch.Tensor.tolist

    def spy(self):
        reads.append(tuple(self.shape))
        return original(self)

    for layout, page in (("paged", 8), ("arena", None)):
        p = Problem(g, layout, page, 2, 10)
        good = DecodeStep(p, "reference", device="cpu")
        bad = syncs.bad_step(p, "reference", device="cpu")
        assert bad.backend.name == "reference-syncing(reference)" and bad.backend.stalls_host
        assert bad.backend.supports(p) is None  # everything else is the wrapped backend's
        monkeypatch.setattr(torch.Tensor, "tolist", spy)
        out_bad = bad.run()
        assert reads == [(2,), (2,)]  # one host read of the per-request counts per layer's store
        reads.clear()
        out_good = good.run()
        assert reads == []
        monkeypatch.undo()
        for a, b in zip(out_bad, out_good):
            assert torch.equal(a, b)
        for a, b in zip(bad.k_cache + bad.v_cache + bad.ctx_lens, good.k_cache + good.v_cache + good.ctx_lens):
            assert torch.equal(a, b)
    assert bad.backend.last_block_counts == [14, 14]  # the arena: rows held after the store of 4
    paged = syncs.bad_step(Problem(g, "paged", 8, 2, 10), "reference", device="cpu")
    paged.run()
    assert paged.backend.last_block_counts == [2, 2]  # ceil((10 + 4) / 8) blocks per request
    wrapped = SyncingStoreBackend(registry.get("reference"))
    assert wrapped.paged_attention is reference.paged_attention and wrapped.with_params() is wrapped
    with pytest.raises(ValueError, match="no tunable parameters"):
        wrapped.with_params(tile_n=32)
