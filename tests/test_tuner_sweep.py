"""Sweeps (CPU, with fake worker functions): crash isolation, timeouts, resume after a kill."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from drafter_attn.tuner.db import ProfileDB, SchemaError
from drafter_attn.tuner.spec import parse_spec, tomllib
from drafter_attn.tuner.sweep import SweepError, run_sweep, serves

REPO = Path(__file__).resolve().parent.parent
FAKE = dict(measure="sweep_fakes:measure", fingerprint="sweep_fakes:fingerprint", progress=False)


def _candidates(ctx_lens, batches=(1, 2), targets=None):
    extra = f"targets = {list(targets)}" if targets else ""
    spec = parse_spec(tomllib.loads(textwrap.dedent(f"""
        [sweep]
        backends = ["reference"]
        presets = ["qwen3-8b-dflash-b16"]
        arena = true
        batches = {list(batches)}
        ctx_lens = {list(ctx_lens)}
        {extra}
    """)), "t.toml")
    return spec.candidates()


def _rows(path):
    with ProfileDB(path, create=False) as db:
        return db.query("SELECT uid, candidate_key, ctx_len, batch, status, reason, median_us, worker "
                        "FROM results ORDER BY id")


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen):
    """`proc`, killed on the way out if it still runs (a test that fails must leave no driver)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_rows(path, n: int, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    """Wait until the database at `path` holds `n` result rows, while `proc` (its sweep) runs."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if path.exists() and len(_rows(path)) >= n:
                return
        except SchemaError:  # the sweep is creating the file this instant (empty, no schema yet)
            pass
        assert proc.poll() is None, "the sweep ended before it was stopped"
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} rows after {timeout_s} s")


def test_faults_and_timeouts_are_recorded_and_the_sweep_goes_on(tmp_path):
    path = tmp_path / "s.db"
    cands = _candidates([1, 13, 17, 19, 23])
    out = run_sweep(cands, path, devices=[None, None], timeout_s=3, **FAKE)
    rows = _rows(path)
    assert len(rows) == len(cands) == 10 and out.measured == 10 and out.skipped == 0
    by_ctx = collections.defaultdict(set)
    for r in rows:
        by_ctx[r["ctx_len"]].add(r["status"])
    assert by_ctx == {1: {"ok"}, 13: {"failed_runtime"}, 17: {"failed_timeout"}, 19: {"failed_runtime"},
                      23: {"ok"}}
    reasons = {r["ctx_len"]: r["reason"] for r in rows}
    assert "worker died (killed by SIGSEGV)" in reasons[13]
    assert "no result within 3 s" in reasons[17]
    assert "illegal memory access" in reasons[19]
    assert {r["median_us"] for r in rows if r["status"] == "ok"} == {1.0, 23.0}
    assert {r["worker"] for r in rows} == {"0", "1"}  # both workers took work
    assert out.by_status == {"ok": 4, "failed_runtime": 4, "failed_timeout": 2}

    # Run again: everything is done, nothing is measured; --retry-failed measures the failures.
    again = run_sweep(cands, path, devices=[None], timeout_s=3, **FAKE)
    assert again.skipped == 10 and again.measured == 0
    cands_ok = _candidates([1, 19, 23])
    retry = run_sweep(cands_ok, path, devices=[None], retry_failed=True, **FAKE)
    assert retry.skipped == 4 and retry.by_status == {"failed_runtime": 2}


def test_a_killed_sweep_resumes_without_losing_rows(tmp_path):
    path = tmp_path / "k.db"
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]
        from test_tuner_sweep import _candidates, FAKE
        from drafter_attn.tuner.sweep import run_sweep
        run_sweep(_candidates(list(range(30, 42))), {str(path)!r}, devices=[None],
                  options=dict(sleep=0.3), lease_s=1.0, **FAKE)
    """)
    with killed_at_exit(subprocess.Popen([sys.executable, "-c", script], start_new_session=True)) as proc:
        wait_rows(path, 4, proc)
        proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
        proc.wait(10)
    before = _rows(path)
    assert 4 <= len(before) < 24
    time.sleep(1.0)  # the orphaned worker must not write anything late
    assert _rows(path) == before

    # The killed sweep's claim on its in-flight candidate expires (1 s lease); this one takes it over.
    cands = _candidates(list(range(30, 42)))
    out = run_sweep(cands, path, devices=[None], **FAKE)
    after = _rows(path)
    assert out.skipped == len(before) and out.measured == len(cands) - len(before)
    assert after[:len(before)] == before  # finished rows untouched
    assert sorted(r["candidate_key"] for r in after) == sorted(c.key() for c in cands)  # each once


def test_workers_that_cannot_start_stop_the_sweep(tmp_path):
    with pytest.raises(SweepError, match="could not start: RuntimeError: no CUDA GPU"):
        run_sweep(_candidates([1]), tmp_path / "x.db", devices=[None], measure="sweep_fakes:measure",
                  fingerprint="sweep_fakes:broken_fingerprint", progress=False)


def test_no_visible_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SweepError, match="no CUDA GPU is visible"):
        run_sweep(_candidates([1]), tmp_path / "x.db", **FAKE)


def test_progress_bar_runs(tmp_path, capsys):
    out = run_sweep(_candidates([1, 19]), tmp_path / "p.db", devices=[None],
                    **{**FAKE, "progress": True}, name="bar")
    assert out.measured == 4
    err = capsys.readouterr().err
    assert "failed_runtime" in err and "bar:" in err


def test_two_sweeps_at_once_measure_each_candidate_once(tmp_path):
    path = tmp_path / "c.db"
    cands = _candidates(list(range(40, 55)))  # 30 candidates
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run_sweep, cands, path, devices=[None, None], options=dict(sleep=0.1), **FAKE)
                for _ in range(2)]
        outs = [r.result(timeout=120) for r in runs]
    keys = [r["candidate_key"] for r in _rows(path)]
    assert sorted(keys) == sorted(c.key() for c in cands)  # every candidate, each exactly once
    assert all(o.measured > 0 for o in outs)  # both sweeps took work
    assert sum(o.measured for o in outs) == len(cands)
    assert sum(o.measured + o.skipped for o in outs) == 2 * len(cands)
    with ProfileDB(path) as db:
        assert db.query("SELECT * FROM claims") == []  # every claim released


def test_targets_route_by_sm_and_report_what_no_gpu_here_serves(tmp_path, capsys):
    cands = _candidates([1, 2], targets=["sm0", "sm90"])  # the fake GPU is sm 0
    assert len(cands) == 8 and {c.target for c in cands} == {"sm0", "sm90"}
    out = run_sweep(cands, tmp_path / "t.db", devices=[None], **{**FAKE, "progress": True})
    assert out.by_status == {"ok": 4} and out.not_run == {"sm90": 4}
    assert "4 not run: no GPU for target 'sm90'" in out.summary()
    assert "no GPU for target 'sm90'" in capsys.readouterr().err


def test_a_target_names_an_sm_or_a_gpu_class():
    h200 = dict(sm=90, gpu_name="NVIDIA H200")
    assert serves(None, h200) and serves("sm90", h200) and serves("h200", h200) and serves("H200", h200)
    assert not serves("sm100", h200) and not serves("B200", h200) and not serves("sm9", h200)


def test_fresh_candidates_are_measured_again_and_only_once_a_sweep(tmp_path):
    """`fresh` (tuner refine --with-winners): a candidate with a row already is measured again,
    and its new row is the newest; the rest are skipped as before."""
    path = tmp_path / "f.db"
    cands = _candidates([1, 23])
    first = run_sweep(cands, path, devices=[None], **FAKE)
    assert first.measured == len(cands) == 4
    again_key = cands[0].key()
    second = run_sweep(cands, path, devices=[None], fresh={again_key}, **FAKE)
    assert second.measured == 1 and second.skipped == 3
    rows = _rows(path)
    assert [r["candidate_key"] for r in rows].count(again_key) == 2
    assert rows[-1]["candidate_key"] == again_key  # the newest row is this sweep's
    # a fresh key listed twice in one sweep is measured once (its row since the start counts)
    third = run_sweep(cands + [cands[0]], path, devices=[None], fresh={again_key}, **FAKE)
    assert third.measured == 1 and third.skipped == 4


def test_candidates_no_gpu_serves_are_counted_once_over_worker_restarts(tmp_path):
    """`drop_unserved` runs again each time a worker restarts: what it dropped before is not
    reported, nor counted, a second time."""
    from drafter_attn.kernels.presets import get_preset
    from drafter_attn.kernels.spec import Problem
    from drafter_attn.tuner import sweep
    from drafter_attn.tuner.db import ProfileDB
    from drafter_attn.tuner.spec import Candidate

    class Bar:
        def __init__(self):
            self.reported = []

        def not_run(self, target, n):
            self.reported.append((target, n))

    g = get_preset("qwen3-8b-dflash-b16")
    cands = [Candidate(Problem(g, "paged", 64, b, 2048), "cupy", (), None, "main", target)
             for b, target in ((1, "sm999"), (2, "sm999"), (4, None))]
    bar = Bar()
    with ProfileDB(tmp_path / "p.db") as db:
        queue = sweep.SweepQueue(cands, db, sweep.SweepOutcome("s", len(cands)), bar)
        h200 = {"sm": 90, "gpu_name": "NVIDIA H200"}
        for _ in range(3):  # the first workers, then two restarts
            queue.drop_unserved([h200])
    assert bar.reported == [("sm999", 2)]
    assert queue.outcome.not_run == {"sm999": 2} and list(queue.pending) == [2]
