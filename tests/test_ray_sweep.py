"""Sweeps over a real local Ray cluster (CPU): a head and a second node started with `ray start`
on 127.0.0.1, fake GPUs (`--num-gpus`), an SM per node that the fake
fingerprint reports ($FAKE_SM, inherited by the node's actors), and the fake measure functions of
sweep_fakes. Each node is one process group, stopped by the fixture (or killed by a test)."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]', which `make install` does)")

from test_tuner_sweep import _candidates, _rows, killed_at_exit, wait_rows  # noqa: E402

from drafter_attn.tuner.db import ProfileDB  # noqa: E402

TESTS = Path(__file__).resolve().parent
RAY = str(Path(sys.executable).with_name("ray"))
FAKE = dict(measure="sweep_fakes:measure", fingerprint="sweep_fakes:node_fingerprint", progress=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """Ray nodes on this machine, each started by `ray start` in a process group of its own."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="ray-t")  # short: Ray's socket paths have a length limit
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.groups: list[int] = []

    def start_node(self, sm: int, gpus: int = 2, head: bool = False) -> int:
        """Start a node with `gpus` fake GPUs of SM `sm`; returns its process group id."""
        args = [RAY, "start", "--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", str(gpus),
                "--object-store-memory", str(80 << 20),
                "--dashboard-agent-listen-port", str(_free_port()), "--metrics-export-port", str(_free_port()),
                "--disable-usage-stats"]
        if head:
            args += ["--head", "--port", str(self.port), "--temp-dir", self.temp, "--include-dashboard", "false"]
        else:
            args += ["--address", self.address]
        env = {**os.environ, "FAKE_SM": str(sm), "PYTHONPATH": str(TESTS),
               # notice a dead node within about a second
               "RAY_health_check_period_ms": "300", "RAY_health_check_failure_threshold": "3",
               "RAY_health_check_initial_delay_ms": "0"}
        proc = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.groups.append(proc.pid)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        return proc.pid

    def kill_node(self, group: int) -> None:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        for g in reversed(self.groups):
            self.kill_node(g)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    # Token authentication off for every process of these tests (the nodes, the drivers and this
    # one): once any local `ray.init` has written ~/.ray/auth_token, Ray turns it on for some
    # processes and not others, and the second node could not join the head.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        c = LocalCluster()
        try:
            c.start_node(90, head=True)
            c.start_node(100)
            yield c
        finally:
            c.stop()


def _sweep_in_process(cluster, cands, path, **kw):
    from drafter_attn.tuner.ray_sweep import run_ray_sweep

    return run_ray_sweep(cands, path, address=cluster.address, **{**FAKE, **kw})


def _driver(cluster, path, ctx_lens, **kw) -> subprocess.Popen:
    """A sweep driver in a process of its own (to run two at once, or to kill)."""
    # The driver takes Ctrl-C as a shell-started one does: SIGINT unblocked and raising
    # KeyboardInterrupt, whatever disposition the test process would hand down (in full CI runs
    # only, a driver started from pytest did not act on SIGINT at all).
    script = textwrap.dedent(f"""
        import signal, sys
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from test_tuner_sweep import _candidates
        from drafter_attn.tuner.ray_sweep import run_ray_sweep
        out = run_ray_sweep(_candidates({list(ctx_lens)}), {str(path)!r}, address={cluster.address!r},
                            **{ {**FAKE, **kw}!r})
        print(out.summary())
    """)
    return subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(TESTS)},
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _sm_of_rows(path) -> dict:
    with ProfileDB(path, create=False) as db:
        rows = db.query("SELECT r.ctx_len, r.batch, r.status, r.reason, r.worker, e.sm FROM results r "
                        "JOIN environments e USING (env_id) ORDER BY r.id")
    return rows


def test_routing_by_sm_and_a_crash_and_a_hang(cluster, tmp_path):
    path = tmp_path / "r.db"
    cands = _candidates([1, 13, 17, 23], targets=["sm90", "sm100", "sm120"])  # no sm120 node
    out = _sweep_in_process(cluster, cands, path, timeout_s=3)
    rows = _sm_of_rows(path)
    assert len(rows) == 16 and out.not_run == {"sm120": 8}
    by_sm = collections.Counter(r["sm"] for r in rows)
    assert by_sm == {90: 8, 100: 8}
    # every row ran on the SM its candidate names: the candidates of one SM are measured once each
    for sm in (90, 100):
        assert sorted((r["ctx_len"], r["batch"]) for r in rows if r["sm"] == sm) == sorted(
            (c.problem.ctx_len, c.problem.batch) for c in cands if c.target == f"sm{sm}")
    status = {(r["sm"], r["ctx_len"]): r["status"] for r in rows}
    assert {s for (_, ctx), s in status.items() if ctx == 13} == {"failed_runtime"}
    assert {s for (_, ctx), s in status.items() if ctx == 17} == {"failed_timeout"}
    assert {s for (_, ctx), s in status.items() if ctx in (1, 23)} == {"ok"}
    assert all("killed by SIGSEGV" in r["reason"] for r in rows if r["ctx_len"] == 13)
    assert len({r["worker"] for r in rows}) >= 3  # several actors on both nodes took work


def test_two_sweeps_at_once_measure_each_candidate_once(cluster, tmp_path):
    path = tmp_path / "c.db"
    ctx = list(range(40, 50))  # 20 candidates
    procs = [_driver(cluster, path, ctx, max_gpus=2, options=dict(sleep=0.2)) for _ in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out[-3000:]
    keys = [r["candidate_key"] for r in _rows(path)]
    assert sorted(keys) == sorted(c.key() for c in _candidates(ctx))


def test_resume_after_the_driver_is_killed(cluster, tmp_path):
    path = tmp_path / "k.db"
    ctx = list(range(60, 70))
    with killed_at_exit(_driver(cluster, path, ctx, options=dict(sleep=0.4), lease_s=1.0)) as proc:
        wait_rows(path, 4, proc)
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9: no clean-up of any kind
        proc.wait(10)
    before = _rows(path)
    assert 4 <= len(before) < 20
    out = _sweep_in_process(cluster, _candidates(ctx), path)
    after = _rows(path)
    assert after[:len(before)] == before  # finished rows untouched
    assert out.skipped == len(before) and out.measured == 20 - len(before)
    assert sorted(r["candidate_key"] for r in after) == sorted(c.key() for c in _candidates(ctx))


def test_a_node_that_leaves_mid_sweep_loses_nothing(cluster, tmp_path):
    path = tmp_path / "n.db"
    third = cluster.start_node(90, gpus=1)
    ctx = list(range(80, 92))  # 24 candidates over 5 GPUs
    with killed_at_exit(_driver(cluster, path, ctx, options=dict(sleep=0.5))) as proc:
        wait_rows(path, 6, proc)
        before = _rows(path)
        cluster.kill_node(third)  # its actor is measuring a candidate now
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "1 requeued after their node left" in out  # its in-flight candidate, once
    after = _rows(path)
    assert after[:len(before)] == before
    assert sorted(r["candidate_key"] for r in after) == sorted(c.key() for c in _candidates(ctx))
    assert {r["status"] for r in after} == {"ok"}  # the lost candidate ran again elsewhere
    assert len({r["worker"] for r in after}) == 5  # the third node's GPU took part before it left


def test_ctrl_c_stops_the_actors_and_keeps_finished_rows(cluster, tmp_path):
    import ray

    path = tmp_path / "i.db"
    # 80 candidates of 0.6 s on 4 actors: about 12 s of work, so the Ctrl-C after the 4th row
    # lands mid-sweep even on a loaded 2-core machine (with 20, a CI run finished them all first).
    # In full CI runs (never alone) one SIGINT at this point was sometimes not acted on: Ctrl-C
    # again after 5 s without an exit, as a user would (not sooner: a second SIGINT during the
    # driver's clean-up would cut the release of its claims short).
    with killed_at_exit(_driver(cluster, path, list(range(100, 140)), options=dict(sleep=0.6))) as proc:
        wait_rows(path, 4, proc)
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                pass
        out, _ = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in out, out[-2000:]
    rows = _rows(path)
    assert 4 <= len(rows) < 80 and {r["status"] for r in rows} == {"ok"}
    with ProfileDB(path) as db:
        assert db.query("SELECT * FROM claims") == []  # released: a rerun need not wait for leases
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        deadline = time.time() + 30
        while ray.available_resources().get("GPU", 0) < 4 and time.time() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("GPU", 0) == 4  # every actor stopped, its GPU free
    finally:
        ray.shutdown()


def test_the_cli_sweeps_on_the_cluster_and_says_why_it_cannot_measure(cluster, tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('[sweep]\nbackends = ["reference"]\npresets = ["qwen3-8b-dflash-b16"]\narena = true\n'
                    'batches = [1]\nctx_lens = [64]\n')
    cmd = [sys.executable, "-m", "drafter_attn.tuner", "sweep", str(spec), "--db", str(tmp_path / "c.db"),
           "--no-progress", "--ray", cluster.address]
    # The real fingerprint needs a CUDA GPU: the actor's worker says so, and the sweep stops (exit 2).
    run = subprocess.run(cmd + ["--ray-gpus", "1"], capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "on Ray cluster 127.0.0.1" in run.stderr and "could not start its worker" in run.stderr
    run = subprocess.run(cmd + ["--devices", "0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--devices is for local sweeps" in run.stderr
