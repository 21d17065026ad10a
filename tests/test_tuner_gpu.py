"""The tuner on a GPU (marker `gpu`): the latency harness, the sync detector (a deliberately bad
step is counted, the project's own step measures zero), memory, and sweeps that survive faults."""

from __future__ import annotations

import math

import pytest
import torch

from drafter_attn.kernels import reference
from drafter_attn.kernels.presets import PRESETS
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import measure, memory, syncs, timing
from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.spec import Candidate
from drafter_attn.tuner.step import CorrectnessError, DecodeStep
from drafter_attn.tuner.sweep import result_row, run_sweep, visible_devices

pytestmark = pytest.mark.gpu

MAIN = PRESETS["qwen3-8b-dflash-b16"]
BACKENDS = ["cupy", "reference"]


def _problem(layout="paged", batch=2, ctx=1000, geom=MAIN):
    return Problem(geom, layout, 64 if layout == "paged" else None, batch, ctx)


@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_step_checks_and_replays_in_a_graph(layout):
    step = DecodeStep(_problem(layout), "cupy", accepted=9.5)
    assert step.check() < 1e-2
    eager = [o.clone() for o in step.run()]
    lens = step._lens.clone()
    graph_out = []
    graph = timing.capture(lambda: graph_out.extend(step.run()))
    for _ in range(3):  # every replay resets the lengths first: the same step each time
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(step._lens, lens)
    for a, b in zip(graph_out[-MAIN.num_layers:], eager):
        assert torch.equal(a, b)


def test_peak_bytes_are_the_steps_own():
    """What was live before a step was built (the L2 flush's buffer, another measurement's
    tensors) is not in its peak_bytes, and the shared registry backend keeps no plans of it."""
    from drafter_attn.kernels import registry

    c = Candidate(_problem(batch=1, ctx=2048), "cupy", (), 12.0, "main")
    shared = set(registry.get("cupy")._plans)  # other tests' plans on the shared instance
    measure.measure_candidate(c.to_wire(), reps=30)  # the process's lazy allocations (cuBLAS) first
    alone = measure.measure_candidate(c.to_wire(), reps=30)
    held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    beside = measure.measure_candidate(c.to_wire(), reps=30)
    del held
    assert alone["status"] == beside["status"] == "ok"
    assert abs(beside["peak_bytes"] - alone["peak_bytes"]) <= 2 << 20  # not the 256 MB held
    assert alone["peak_bytes"] >= alone["kv_bytes"] > 0
    assert set(registry.get("cupy")._plans) == shared  # the steps bound copies of their own


def test_latency_harness():
    step = DecodeStep(_problem(batch=4, ctx=4096), "cupy")
    step.check()
    row = measure.time_step(step, reps=40)
    assert row["count"] == 40
    assert 0 < row["min_us"] <= row["p10_us"] <= row["median_us"] <= row["p90_us"]
    assert row["repeat_median_us"] > 0
    # the halves each take less than the whole step, and the step's bytes are accounted
    assert 0 < row["attention_median_us"] < row["median_us"] * 1.1
    assert 0 < row["store_median_us"] < row["median_us"]
    assert row["bytes_moved"] == step.bytes_moved
    assert 0 < row["roofline_fraction"] < 1.5
    assert row["bandwidth_gbs"] == pytest.approx(row["bytes_moved"] / row["median_us"] / 1e3)
    assert row["l2_flushed"] in (True, False)
    auto = measure.time_step(step)  # repetitions chosen from the step's length
    assert measure.MIN_REPS <= auto["count"] <= measure.MAX_REPS


def test_measure_candidate_fills_a_whole_row(tmp_path):
    c = Candidate(_problem(batch=1, ctx=2048), "cupy", tuple(sorted({"num_splits": 0}.items())), 12.0, "main")
    result = measure.measure_candidate(c.to_wire(), reps=30)
    assert result["status"] == "ok", result.get("reason")
    for key in ("median_us", "p10_us", "p90_us", "count", "attention_median_us", "store_median_us",
                "bytes_moved", "bandwidth_gbs", "copy_bandwidth_gbs", "roofline_fraction", "rel_err",
                "kv_bytes", "workspace_bytes", "peak_bytes", "syncs_debug", "syncs_profiler", "sync_host_us"):
        assert result[key] is not None, key
    assert result["syncs_debug"] == 0 and result["syncs_profiler"] == 0
    assert result["graph_capturable"] is True and result["syncs_nsys"] is None
    assert result["peak_bytes"] >= result["kv_bytes"] > 0
    assert result["workspace_bytes"] > 0  # outputs at least
    with ProfileDB(tmp_path / "g.db") as db:
        from drafter_attn.tuner.env import fingerprint

        env = db.add_environment(fingerprint())
        db.add_result(result_row(c, result, env, "test", "0"))
        assert db.query("SELECT status FROM results")[0]["status"] == "ok"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_sync_detector_good_step_measures_zero(backend, layout):
    step = DecodeStep(_problem(layout, geom=PRESETS["laguna-dflash"]), backend)
    report = syncs.detect_syncs(step.run)
    assert report.debug_syncs == 0
    assert report.profiler.count == 0 and report.profiler.dtoh_copies == 0, report.profiler.by_call
    assert report.graph_capturable is True and report.syncs == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_detector_counts_the_bad_step(backend):
    step = syncs.bad_step(_problem(), backend)
    layers = MAIN.num_layers
    report = syncs.detect_syncs(step.run)
    assert report.debug_syncs >= layers  # one .tolist() per layer's store
    assert report.profiler.count >= layers, report.profiler.by_call
    assert report.profiler.host_us > 0 and report.profiler.dtoh_copies >= layers
    assert report.graph_capturable is False and "capture" in (report.as_row()["sync_note"] or "")
    assert report.syncs >= layers
    # the process is still usable after the failed capture
    good = DecodeStep(_problem(), backend)
    assert syncs.detect_syncs(good.run).syncs == 0


def test_nsys_layer_or_its_message():
    found = syncs.nsys_tool.find_nsys()
    if not found.usable:
        pytest.skip(found.note)
    result = syncs.nsys_syncs(Candidate(_problem(), "cupy", ()).to_wire(), runs=2)
    assert result.syncs is not None, result.note
    assert result.syncs.count == 0
    bad = syncs.nsys_syncs(Candidate(_problem(), "reference-syncing", ()).to_wire(), runs=2)
    assert bad.syncs.count == MAIN.num_layers, bad.note


def test_memory_of_a_split_step():
    step = DecodeStep(_problem(batch=1, ctx=8192), "cupy")  # batch 1: split-KV partials
    step.run()
    mem = memory.measure_step_memory(step.run, step.kv_bytes)
    out_bytes = MAIN.num_layers * step.q[0].numel() * step.q[0].element_size()
    assert mem.workspace_bytes >= out_bytes
    assert mem.peak_bytes >= mem.workspace_bytes + step.kv_bytes


def test_check_catches_unwritten_outputs_on_the_gpu():
    class Lazy:
        name = "lazy"

        def with_params(self, **p):
            return self

        def paged_attention(self, q, *args, **kw):
            out = torch.empty_like(q)  # gets the NaN-poisoned block
            ref = reference.paged_attention(q, *args, **kw)
            out[:, :-1] = ref[:, :-1]  # the last block row is never written
            return out

        store_paged = staticmethod(reference.store_paged)

    step = DecodeStep(_problem(), Lazy())
    with pytest.raises(CorrectnessError, match="NaN"):
        step.check()


def test_sweep_survives_a_sticky_device_fault(tmp_path):
    """A device-side assert poisons its process's CUDA context: that candidate is recorded as
    failed_runtime and the next one runs in a fresh worker."""
    from test_tuner_sweep import _candidates

    path = tmp_path / "f.db"
    out = run_sweep(_candidates([1, 13, 23], batches=(1,)), path, devices=visible_devices()[:1], progress=False,
                    measure="sweep_fakes:measure_gpu", fingerprint="sweep_fakes:gpu_fingerprint",
                    timeout_s=120)
    assert out.by_status == {"ok": 2, "failed_runtime": 1}
    with ProfileDB(path, create=False) as db:
        failed = db.query("SELECT reason FROM results WHERE status = 'failed_runtime'")
    assert "assert" in failed[0]["reason"].lower() or "CUDA" in failed[0]["reason"]


def test_real_sweep_of_a_tiny_spec(tmp_path):
    from drafter_attn.tuner.spec import load_spec

    spec_path = tmp_path / "tiny.toml"
    spec_path.write_text("""
[sweep]
backends = ["cupy"]
presets = ["gpt-oss-20b-dflash"]
page_sizes = [64]
arena = true
batches = [2]
ctx_lens = [512]
reps = 30

[[sweep.geometries]]
name = "head-dim-96"
num_q_heads = 8
num_kv_heads = 2
head_dim = 96
block_size = 8
""")
    spec = load_spec(spec_path)
    path = tmp_path / "r.db"
    one_gpu = visible_devices()[:1]
    out = run_sweep(spec.candidates(), path, progress=False, options=dict(reps=spec.reps),
                    devices=one_gpu, timeout_s=600)
    assert out.by_status == {"ok": 2, "unsupported": 2}, out.by_status
    with ProfileDB(path, create=False) as db:
        rows = db.query("SELECT * FROM results WHERE status = 'ok'")
        env = db.query("SELECT * FROM environments")[0]
    assert env["sm"] >= 80 and env["sm_count"] > 0 and env["sources_hash"]
    assert all(r["median_us"] > 0 and r["syncs_debug"] == 0 and r["kv_bytes"] > 0 for r in rows)
    assert math.isfinite(rows[0]["roofline_fraction"])
    again = run_sweep(spec.candidates(), path, progress=False, devices=one_gpu)
    assert again.skipped == 4 and again.measured == 0
