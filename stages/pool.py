"""The Ray actor pool: the stage driver's executor (:mod:`pipeline.executor.driver`) for stages that declare actors.

One actor per expected worker (:mod:`stages.placement`). An actor is cheap to create: it loads nothing until told.
The pool first runs the **preflight** on every expected worker, waiting for them as the cluster comes up
(``workers.wait_s``, a progress line meanwhile), and refuses before any work when a check fails
(:mod:`stages.preflight`); then each actor's ``setup`` loads the models and it takes shard after shard. An actor
that cannot set up (a hub error, an out-of-memory, its process killed while loading) is dropped and another is
started on a node it has not failed on; the stage fails only when no worker can start, with the setup errors in its
message. With ``num_workers: null`` on GPUs every GPU that joins later gets an actor.

Shards fail as under :class:`pipeline.executor.local.LocalExecutor`: a shard whose ``process_shard`` raises is retried
up to ``resources().max_retries`` times, each failed attempt logged. A lost actor (its process killed, or its node
gone) costs its in-flight shard one attempt too: the pool, not Ray, retries it (``max_task_retries=0``). Ray
restarts the actor (``max_restarts``); the pool counts it back once its ``setup`` answers again, and keeps the lost
shard for it meanwhile unless it cannot take it back (gone for good, its node dead, or not back within
:attr:`RayActorPool.rejoin_wait_s`); then any live actor takes the shard. The events and their handlers:
:class:`stages.pool_run.PoolRun`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

from pipeline.executor.local import Done, Execution, run_task
from pipeline.executor.stage import ShardStage, ShardTask, Worker
from pipeline.runtime.config import RayConfig

from .ray_runtime import init_ray, worker_identity


class StageActor:
    """One pool actor: the stage object shipped once; ``preflight`` checks its node, ``setup`` loads the models once
    (it never raises: a failure comes back as ``setup_error``, so that the pool can try another node), then shard
    after shard. Ray rebuilds a restarted actor from ``__init__`` alone, so the pool sets it up again."""

    def __init__(self, stage: ShardStage, threads: int):
        self.stage = stage
        self.worker = Worker(worker_identity(), threads)
        self.ready = False

    def where(self) -> Dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"identity": self.worker.identity, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def preflight(self, spec) -> Dict[str, Any]:
        from pipeline.executor.preflight import check_worker

        return {**self.where(), **check_worker(spec, self.stage, self.worker.threads)}

    def readable(self, spec, probes: List[str]) -> List[str]:
        from pipeline.executor.preflight import unreadable

        return unreadable(probes)

    def setup(self) -> Dict[str, Any]:
        if not self.ready:
            try:
                self.stage.setup(self.worker)
            except Exception as err:  # noqa: BLE001 - the pool places another worker and says why
                first = (str(err).splitlines() or [""])[0]
                return {**self.where(), "setup_error": f"{type(err).__name__}: {first}"}
            self.ready = True
        return self.info()

    def info(self) -> Dict[str, Any]:
        return {**self.where(), **self.stage.worker_info()}

    def process(self, task: ShardTask) -> Dict[str, Any]:
        if not self.ready:  # the pool sets every actor up first; a shard never loads models by surprise
            raise RuntimeError(f"worker {self.worker.identity} is not set up")
        return run_task(self.stage, task, self.worker)


def bound_actor_class(stage: ShardStage) -> type:
    """A StageActor class that carries ``stage`` in its own definition rather than as a constructor argument.

    Ray exports an actor class once to its control store, where it stays for the job, and rebuilds a restarted
    actor from it; a constructor argument over 100 KB (a stage holding its driver-side results, as tune's does)
    lives in the object store instead, which Ray warns about on every such actor (core_worker.cc: "constructor
    arguments in the object store and max_restarts > 0", ray-project/ray#53727, since losing them makes the
    restart fail). Bound here, a restart always finds the stage and nothing is logged."""

    class BoundStageActor(StageActor):
        def __init__(self, threads: int):
            super().__init__(stage, threads)

    BoundStageActor.__name__ = BoundStageActor.__qualname__ = f"StageActor[{stage.name}]"
    return BoundStageActor


class RayActorPool:
    """The executor: preflight, setup, then every shard on the pool (:class:`stages.pool_run.PoolRun`)."""

    rejoin_wait_s = 60.0  # how long a restarting actor keeps its lost shard, or is waited for when no other is left
    poll_s = 1.0  # how often lost actors, the node table and joining GPUs are looked at
    progress_s = 15.0  # seconds between "waiting for workers" lines

    def __init__(self, ray_cfg: RayConfig, wait_s: float = 600.0):
        self.ray_cfg = ray_cfg
        self.wait_s = wait_s  # workers.wait_s: how long the expected workers are waited for
        self.preflight = None  # the last run's preflight report (stages.preflight.Report)

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        from .pool_run import PoolRun

        ray = init_ray(self.ray_cfg)
        run = PoolRun(self, ray, stage, tasks, done)
        try:
            self.preflight = run.start(min(run.place.num_workers, len(tasks)))
            failures = run.drive()
        finally:  # also on an error or an interrupt: a job on a long-lived cluster must not leave actors behind
            run.kill_all()
        return Execution(run.workers(), failures)


def worker_line(info: Dict[str, Any]) -> str:
    """One short line per started worker: its identity, pid and the stage's scalar facts (device, a cost summary).
    Structured values (a whole cost profile) stay in the stage's summary.json (``workers``): printed, they were a
    raw JSON dump 600 characters long."""
    shown = " ".join(f"{k}={v}" for k, v in info.items()
                     if k not in ("identity", "pid", "node_id", "node_ip", "gpu_ids") and isinstance(v, (str, int, float)))
    return f"worker {info['identity']} pid={info['pid']} {shown}".rstrip()
