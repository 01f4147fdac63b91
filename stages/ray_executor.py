"""What the Ray stages share: joining or starting Ray, worker placement, and the Ray actor-pool executor of the
stage driver (:mod:`pipeline.executor.driver`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from pipeline.runtime.config import RayConfig
from pipeline.executor.driver import run_stage
from pipeline.executor.local import Done, Execution, run_task
from pipeline.executor.stage import ShardStage, ShardTask, Worker
from pipeline.runtime.log import get as log
from pipeline.runtime.log import verbosity as log_verbosity


def ray_init_plan(cfg: RayConfig, verbosity: int, environ=os.environ) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """What :func:`init_ray` passes to ``ray.init`` (minus ``logging_config``, built from ``verbosity`` by
    :func:`ray_logging_config`) and the environment defaults it sets first, without importing Ray.

    * Ray's own INFO lines (driver and workers) only with -v; ``log_to_driver`` stays on, since the actors' own
      lines (``[label] ...`` at -v, tracebacks) reach the terminal through it.
    * A local Ray we start has one node and no autoscaler, so no node is ever drained: Ray Train's preemption
      watcher has nothing to watch there (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER``, its feature flag in
      ray/train/v2/_internal/constants.py), and creating its actor logs a core_worker.cc error line (constructor
      arguments in the object store with max_restarts > 0, ray-project/ray#53727) into every default run. On a
      cluster it stays on (a spot node can be drained). ``setdefault``: a value the user set wins.
    """
    address = cfg.address or environ.get("RAY_ADDRESS")
    local = not address or address == "local"
    kwargs: Dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, ignore_reinit_error=True,
                                  logging_level=logging.INFO if verbosity >= 1 else logging.WARNING)
    if local:  # a new local Ray ("local", or nothing to join), with the resources it may advertise
        kwargs.update(address=address, num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
    else:
        kwargs.update(address=address)
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if local:
        env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    return kwargs, env


def init_ray(cfg: RayConfig):
    """Join the cluster (`ray job submit` sets RAY_ADDRESS) or start a local Ray; idempotent."""
    import ray

    if not ray.is_initialized():
        kwargs, env = ray_init_plan(cfg, log_verbosity())
        for k, v in env.items():
            os.environ.setdefault(k, v)  # before ray.init: a local Ray's processes inherit them
        ray.init(**kwargs, logging_config=ray_logging_config())
    return ray


@dataclass
class Placement:
    """How many workers and what each one asks Ray for: one per GPU when the cluster has GPUs, else CPU actors."""

    num_workers: int
    num_gpus: float
    num_cpus: float

    @property
    def on_gpu(self) -> bool:
        return self.num_gpus > 0


def plan_workers(num_workers: Optional[int], cpus_per_worker: float) -> Placement:
    import ray

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if gpus > 0:
        n = min(num_workers, gpus) if num_workers else gpus
        return Placement(n, 1.0, cpus_per_worker)
    cpus = resources.get("CPU", 1)
    # Leave one worker's worth of CPU for the driver and Ray's own tasks.
    n = num_workers or max(1, int(cpus / cpus_per_worker) - 1)
    return Placement(n, 0.0, cpus_per_worker)


def worker_identity() -> str:
    """node id (short) and GPU ids of the calling Ray worker, e.g. '8f3a1c2d9e0b/gpu1', or the actor id on CPU."""
    import ray

    ctx = ray.get_runtime_context()
    node = ctx.get_node_id()[:12]
    gpus = ray.get_gpu_ids()
    if gpus:
        return f"{node}/gpu{','.join(str(int(g)) for g in gpus)}"
    actor = ctx.get_actor_id()
    return f"{node}/cpu-{actor[:8]}" if actor else f"{node}/cpu"


class StageActor:
    """One pool actor: the stage object shipped once, ``setup`` once (models loaded), then shard after shard."""

    def __init__(self, stage: ShardStage, threads: int):
        self.stage = stage
        self.worker = Worker(worker_identity(), threads)
        stage.setup(self.worker)

    def info(self) -> Dict[str, Any]:
        import ray

        return {"identity": self.worker.identity, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], **self.stage.worker_info()}

    def process(self, task: ShardTask) -> Dict[str, Any]:
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
    """The driver's executor for stages that declare actors: one actor per GPU (or CPU actors), each loading its
    models once. It fails as :class:`pipeline.executor.local.LocalExecutor` does: a shard whose ``process_shard``
    raises is retried up to ``resources().max_retries`` times, each failed attempt logged, and listed as failed
    after the last. A killed actor is restarted and its in-flight shard rerun by Ray, up to the same limit; an
    actor that is gone for good (its restarts used up) is dropped and its shard listed as failed, and the others
    carry on. When none is left, the shards not done are listed as failed, each named."""

    def __init__(self, ray_cfg: RayConfig):
        self.ray_cfg = ray_cfg

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        ray = init_ray(self.ray_cfg)

        res = stage.resources()
        place = plan_workers(res.num_workers, res.cpus_per_worker)
        # Ray reruns a shard whose actor died (restarting the actor first), never one that raised: that retry is
        # _drive's, so that both executors give a raising shard the same attempts.
        actor_cls = ray.remote(bound_actor_class(stage)).options(
            num_gpus=place.num_gpus, num_cpus=place.num_cpus,
            max_restarts=res.max_retries, max_task_retries=res.max_retries)
        threads = max(1, int(place.num_cpus))
        actors = [actor_cls.remote(threads) for _ in range(min(place.num_workers, len(tasks)))]
        try:
            infos = ray.get([a.info.remote() for a in actors])
            for info in infos:
                log(stage.name).info(worker_line(info))
            failures = self._drive(ray, stage, tasks, done, actors, [i["identity"] for i in infos])
        finally:  # also on an error or an interrupt: a job on a long-lived cluster must not leave actors behind
            for a in actors:
                ray.kill(a)
        return Execution(infos, failures)

    @staticmethod
    def _drive(ray, stage: ShardStage, tasks: List[ShardTask], done: Done, actors: list,
               identities: List[str]) -> List[str]:
        """Keep every live actor busy with one shard until the queue is empty; returns the failures."""
        from ray.exceptions import RayActorError, RayTaskError

        tries = stage.resources().max_retries + 1
        queue = list(tasks)
        attempts = {t.name: 0 for t in tasks}
        inflight = {}
        failures: List[str] = []
        live = len(actors)

        def fail(task: ShardTask, error: str) -> None:
            failures.append(f"{task.name}: {error}")
            done(task, None, error)

        def submit(i: int) -> None:
            task = queue.pop(0)
            inflight[actors[i].process.remote(task)] = (i, task)

        for i in range(len(actors)):
            if queue:
                submit(i)
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1)
            i, task = inflight.pop(ready[0])
            try:
                done(task, ray.get(ready[0]), None)
            except RayTaskError as err:  # process_shard raised: the actor is fine, the shard may be retried
                cause = err.cause  # the shard's own exception, worded as LocalExecutor words it
                error = f"{type(cause).__name__}: {cause}"
                attempts[task.name] += 1
                log(stage.name).warning(f"{task.name} attempt {attempts[task.name]}/{tries} failed: {error}")
                if attempts[task.name] < tries:
                    queue.insert(0, task)  # next, on the same actor: LocalExecutor retries a shard at once
                else:
                    fail(task, error)
            except RayActorError as err:  # Ray restarted the actor until max_restarts: it is gone for good
                live -= 1
                error = f"{type(err).__name__}: {str(err).splitlines()[0]}"
                log(stage.name).warning(f"{task.name} failed: worker {identities[i]} died and has no restart left "
                                        f"(max_restarts={tries - 1}); dropped, {live} worker(s) left")
                fail(task, error)
                i = None
            if queue and i is not None:
                submit(i)
        for task in queue:  # every actor is gone for good: what is left fails now, and a rerun picks it up
            fail(task, f"not run: no worker left ({len(actors)} dropped, their restarts used up)")
        return failures


def worker_line(info: Dict[str, Any]) -> str:
    """One short line per started worker: its identity, pid and the stage's scalar facts (device, a cost summary).
    Structured values (a whole cost profile) stay in the stage's summary.json (``workers``): printed, they were a
    raw JSON dump 600 characters long."""
    shown = " ".join(f"{k}={v}" for k, v in info.items()
                     if k not in ("identity", "pid", "node_id", "gpu_ids") and isinstance(v, (str, int, float)))
    return f"worker {info['identity']} pid={info['pid']} {shown}".rstrip()


def execute(stage: ShardStage):
    """run_stage with the executor the stage's resources ask for."""
    executor = RayActorPool(stage.cfg.ray) if stage.resources().actors else None
    return run_stage(stage, executor)


def ray_logging_config():
    """What ``ray.init`` gets for Ray's worker processes: errors only unless -v. Warnings too would let through Ray
    Train's placement-group cleaner, which warns once a second for a whole run where it finds more than one Ray
    session on the machine (seen on these 2-core machines: 57 of a 134-line run)."""
    import ray

    return ray.LoggingConfig(log_level="INFO" if log_verbosity() >= 1 else "ERROR")


def ray_train_logging_config():
    """What Ray Train's RunConfig gets: its per-report "Checkpoint created" / "Reporting training result" lines
    (two per epoch) only with -v, and its errors always."""
    import ray.train

    return ray.train.LoggingConfig(log_level="INFO" if log_verbosity() >= 1 else "ERROR")
