"""The three host-sync layers agree on a GPU (marker `gpu`): the syncing reference store
(`reference-syncing`) blocks the host exactly once per layer per step in sync-debug mode, the
torch profiler and Nsight Systems alike; the suite's own store blocks 0 times in all three. The
Nsight Systems parts skip when `tuner.nsys.find_nsys()` finds no usable nsys (the skip says why,
e.g. which library its importer lacks)."""

from __future__ import annotations

import pytest
import torch

from drafter_attn.kernels.presets import get_preset
from drafter_attn.kernels.spec import Problem
from drafter_attn.tuner import measure, nsys, syncs
from drafter_attn.tuner.spec import Candidate
from drafter_attn.tuner.step import DecodeStep

pytestmark = pytest.mark.gpu

MAIN = get_preset("qwen3-8b-dflash-b16")
LAYERS = MAIN.num_layers


def _problem(layout="paged"):
    return Problem(MAIN, layout, 64 if layout == "paged" else None, 2, 1024)


@pytest.fixture(scope="module")
def nsys_install():
    found = nsys.find_nsys()
    if not found.usable:
        pytest.skip(found.note)
    return found


@pytest.mark.parametrize("layout", ["paged", "arena"])
def test_in_process_layers_agree(layout):
    bad = DecodeStep(_problem(layout), "reference-syncing")
    report = syncs.detect_syncs(bad.run)
    assert report.counts == {"debug": LAYERS, "profiler": LAYERS}, report.profiler.by_call
    assert report.profiler.by_call == {"cudaStreamSynchronize": LAYERS}
    assert report.profiler.dtoh_copies == LAYERS and report.profiler.host_us > 0
    assert report.graph_capturable is False  # a read-back inside capture fails it
    good = DecodeStep(_problem(layout), "cupy")
    report = syncs.detect_syncs(good.run)
    assert report.counts == {"debug": 0, "profiler": 0} and report.graph_capturable is True


def test_all_three_layers_agree(nsys_install, tmp_path):
    out = syncs.compare(["cupy", "reference-syncing"], _problem(), runs=3, keep=tmp_path)
    good, bad = out["stores"]
    assert good["counts"] == {"debug": 0, "profiler": 0, "nsys": 0}, good
    assert good["nsys"]["steps"] == 3 and good["nsys_stats"]["syncs"] == 0
    assert bad["counts"] == {"debug": LAYERS, "profiler": LAYERS, "nsys": LAYERS}, bad
    assert bad["nsys"]["by_call"] == {"cudaStreamSynchronize": LAYERS} and bad["nsys"]["dtoh_copies"] == LAYERS
    assert bad["nsys"]["host_us"] > 0 and bad["agree"] is True and bad["reference_only"]
    # the capture holds the timed steps alone, so nsys stats over all of it says the same
    assert bad["nsys_stats"]["syncs"] == LAYERS and bad["nsys_stats"]["steps"] == 3
    assert {p.name for p in tmp_path.iterdir()} >= {"cupy.sqlite", "reference-syncing.sqlite"}


def test_measured_row_of_the_syncing_reference():
    """measure_candidate times the reference eagerly (no graph), fills every in-process layer and
    says what it is; the nsys columns too when nsys is usable here."""
    use_nsys = nsys.find_nsys().usable
    row = measure.measure_candidate(Candidate(_problem(), "reference-syncing", ()).to_wire(), reps=20, nsys=use_nsys)
    assert row["status"] == "ok", row.get("reason")
    assert "a reference that stalls the host" in row["reason"] and "timed eagerly" in row["reason"]
    assert row["syncs_debug"] == row["syncs_profiler"] == LAYERS and row["sync_host_us"] > 0
    assert row["graph_capturable"] is False and row["median_us"] > 0
    if use_nsys:
        assert row["syncs_nsys"] == LAYERS and row["sync_host_us_nsys"] > 0
    good = measure.measure_candidate(Candidate(_problem(), "cupy", ()).to_wire(), reps=20, nsys=use_nsys)
    assert good["status"] == "ok" and good["syncs_debug"] == good["syncs_profiler"] == 0
    assert good["graph_capturable"] is True and good["syncs_nsys"] == (0 if use_nsys else None)
    torch.cuda.synchronize()
