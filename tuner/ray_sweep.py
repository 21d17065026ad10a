"""Sweeps over a Ray cluster: one actor per GPU of every node, candidates routed by SM, one writer.

    outcome = run_ray_sweep(spec.candidates(), "profiles/profile.db", address="auto")

Each actor holds one GPU (`num_gpus=1`) and keeps the local sweep's crash isolation: it measures
in a child worker process (tuner.worker.Slot) that it restarts after a fault or a hang, returning
that candidate as failed. Each actor reports its environment fingerprint once; the driver hands a
candidate only to actors whose GPU its target names (tuner.sweep.serves) and reports targets no
actor serves as not run. The driver is the only writer of the database: it claims each candidate
before handing it out (so concurrent sweeps share the work) and writes each result as it arrives.
A node that leaves takes only its in-flight candidates with it: they go back to the queue, and
after `max_tries` losses are recorded as failed (reason "node lost").

Ray is imported only here and only when called, so the local path never needs it.
"""

from __future__ import annotations

import logging
import time

from drafter_attn.tuner.db import ProfileDB
from drafter_attn.tuner.sweep import (CLAIM_LEASE_S, START_TIMEOUT_S, Progress, SweepError, SweepOutcome,
                                      SweepQueue, Worker, new_sweep_id)
from drafter_attn.tuner.worker import FINGERPRINT, MEASURE

MAX_TRIES = 3  # node losses one candidate may suffer before it is recorded as failed


def _import_ray():
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'drafter-attn-suite[ray]' "
                         "(or `make install`, which installs it)") from None
    return ray


class GpuActor:
    """A Ray actor's body (wrapped by ray.remote at run time): one GPU, one worker process."""

    def __init__(self, measure: str, fingerprint: str, options: dict, timeout_s: float):
        import multiprocessing as mp
        import socket

        import ray

        from drafter_attn.tuner.worker import Slot

        ctx = ray.get_runtime_context()
        gpus = ",".join(map(str, ray.get_gpu_ids())) or "-"
        self.node = f"{socket.gethostname()}:{ctx.get_node_id()[:6]}"
        self.label = f"{self.node}/gpu{gpus}"
        self.timeout_s = timeout_s
        # Ray has set CUDA_VISIBLE_DEVICES for this actor; the worker inherits it (device None).
        self.slot = Slot(mp.get_context("spawn"), None, self.label, measure, fingerprint, options)

    def info(self) -> dict:
        return dict(fp=self.slot.wait_ready(START_TIMEOUT_S), node=self.node, label=self.label)

    def measure(self, index: int, wire: dict) -> dict:
        return self.slot.measure_one(index, wire, self.timeout_s, START_TIMEOUT_S)

    def stop(self) -> None:
        self.slot.stop(kill=True)


def node_lost_result(node: str, tries: int) -> dict:
    return dict(status="failed_node_lost",
                reason=f"its node left the cluster while measuring it, {tries} time(s); last on {node}")


def run_ray_sweep(candidates, db_path, *, address: str | None = None, timeout_s: float = 600,
                  options: dict | None = None, measure: str = MEASURE, fingerprint: str = FINGERPRINT,
                  retry_failed: bool = False, progress: bool = True, sweep_id: str | None = None,
                  name: str = "sweep", lease_s: float = CLAIM_LEASE_S, max_gpus: int | None = None,
                  max_tries: int = MAX_TRIES) -> SweepOutcome:
    """Measure `candidates` on every GPU of a Ray cluster (at most `max_gpus`). `address`: None
    starts a local cluster, "auto" joins the one running here, "HOST:PORT" joins that one."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=address or "local", log_to_driver=False, logging_level=logging.WARNING)
    outcome = SweepOutcome(sweep_id or new_sweep_id(name), len(candidates))
    queue = SweepQueue(candidates, ProfileDB(db_path), outcome, Progress(progress, name, len(candidates)),
                       retry_failed=retry_failed, lease_s=lease_s)
    actors = []
    try:
        actors = _start_actors(ray, max_gpus, measure, fingerprint, options or {}, timeout_s)
        _Driver(ray, queue, actors, max_tries).run()
    finally:
        for a in actors:
            ray.kill(a)
        queue.close()
        if started:
            ray.shutdown()
    return outcome


def _start_actors(ray, max_gpus, measure, fingerprint, options, timeout_s) -> list:
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if max_gpus:
        gpus = min(gpus, max_gpus)
    if not gpus:
        raise SweepError("the Ray cluster has no GPU (start its nodes with GPUs, or `ray start --num-gpus N`)")
    # num_cpus=0: an actor waits on its worker process, and must not take a CPU slot from Ray.
    cls = ray.remote(num_gpus=1, num_cpus=0, max_restarts=0)(GpuActor)
    return [cls.options(scheduling_strategy="SPREAD").remote(measure, fingerprint, options, timeout_s)
            for _ in range(gpus)]


class _Driver:
    """The driver's loop: hand out claimed candidates, write results as they come, survive nodes."""

    def __init__(self, ray, queue: SweepQueue, actors: list, max_tries: int):
        self.ray, self.queue, self.max_tries = ray, queue, max_tries
        self.actors = dict(enumerate(actors))
        self.workers: dict[int, Worker] = {}
        self.inflight: dict = {}  # object ref -> (actor index, candidate index)
        self.tries: dict[int, int] = {}

    def run(self) -> None:
        self._meet_actors()
        idle = set(self.actors)
        while self.queue.open() or self.inflight:
            for a in sorted(idle):
                i = self.queue.take(self.workers[a])
                if i is not None:
                    ref = self.actors[a].measure.remote(i, self.queue.candidates[i].to_wire())
                    self.inflight[ref] = (a, i)
                    idle.discard(a)
            beat = self.queue.heartbeat()
            if not self.inflight:
                time.sleep(beat)  # only candidates that other sweeps hold: look again later
                continue
            ready, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=beat)
            for ref in ready:
                a, i = self.inflight.pop(ref)
                if self._finish(ref, a, i):
                    idle.add(a)

    def _meet_actors(self) -> None:
        """Each actor's fingerprint, once; then what no GPU of the cluster serves is not run."""
        refs = {a.info.remote(): k for k, a in self.actors.items()}
        ready, waiting = self.ray.wait(list(refs), num_returns=len(refs), timeout=START_TIMEOUT_S)
        if waiting:
            raise SweepError(f"{len(waiting)} GPU actor(s) could not start within {START_TIMEOUT_S} s "
                             f"(are the cluster's GPUs held by another job?)")
        for ref in ready:
            try:
                info = self.ray.get(ref)
            except self.ray.exceptions.RayTaskError as exc:
                raise SweepError(f"a GPU actor could not start its worker: {exc.cause or exc}") from None
            self.workers[refs[ref]] = Worker(info["label"], self.queue.add_environment(info["fp"]),
                                             info["fp"], info["node"])
        self.queue.drop_unserved([w.fp for w in self.workers.values()])

    def _finish(self, ref, a: int, i: int) -> bool:
        """Record what came back for candidate i from actor a; False when the actor is gone."""
        w = self.workers[a]
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            self._lost(a, i)
            return False
        except self.ray.exceptions.RayTaskError as exc:
            raise SweepError(f"GPU actor {w.label} failed: {exc.cause or exc}") from None
        self.queue.record(i, w, result)
        return True

    def _lost(self, a: int, i: int) -> None:
        """Actor a died with its node: requeue candidate i (or record it after max_tries), and
        report as not run what no remaining GPU serves."""
        w = self.workers.pop(a)
        del self.actors[a]
        self.tries[i] = self.tries.get(i, 0) + 1
        if self.tries[i] >= self.max_tries:
            self.queue.record(i, w, node_lost_result(w.node, self.tries[i]))
        else:
            self.queue.put_back(i)
            self.queue.outcome.requeued += 1
        if not self.workers:
            raise SweepError("every GPU actor of the cluster is gone (nodes left); finished rows are kept")
        self.queue.drop_unserved([x.fp for x in self.workers.values()])
