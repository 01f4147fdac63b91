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
    after the last. When none is left, the shards not done are listed as failed, each named.

    A lost actor (its process killed, or its node gone) costs its in-flight shard one attempt too, against the same
    limit: the pool, not Ray, retries it (``max_task_retries=0``, so the loss surfaces at once). Ray restarts the
    actor (``max_restarts``); the pool counts it back only once a ping (its ``info``) answers, and meanwhile keeps
    the lost shard for it (as Ray's own retry did: a shard that kills its actor every time uses up that actor's
    restarts, not the others') unless the actor cannot take it back: it is gone for good (restarts used up), its
    node is dead, or it is not back within :attr:`rejoin_wait_s`; then any live actor takes the shard. An actor gone
    for good is dropped with a line and the others carry on. The pool ends when every shard is done or failed and
    nothing is in flight, never waiting on a restart still pending (a lost node's actor waits for a GPU that the
    survivors hold until the pool ends). With no live actor left and only restarts pending, it waits
    :attr:`rejoin_wait_s` for one, then fails the shards not done with "no worker left"."""

    rejoin_wait_s = 60.0  # how long a restarting actor keeps its lost shard, or is waited for when no other is left
    poll_s = 1.0  # how often pings of lost actors and their nodes' liveness are looked at

    def __init__(self, ray_cfg: RayConfig):
        self.ray_cfg = ray_cfg

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        ray = init_ray(self.ray_cfg)

        res = stage.resources()
        place = plan_workers(res.num_workers, res.cpus_per_worker)
        # Ray restarts a dead actor (max_restarts) but never reruns its task (max_task_retries=0): _drive does,
        # counting that attempt as it counts a raising shard's, so that a lost node's shard moves to a live actor
        # instead of waiting on a restart that may never be placed.
        actor_cls = ray.remote(bound_actor_class(stage)).options(
            num_gpus=place.num_gpus, num_cpus=place.num_cpus, max_restarts=res.max_retries, max_task_retries=0)
        threads = max(1, int(place.num_cpus))
        actors = [actor_cls.remote(threads) for _ in range(min(place.num_workers, len(tasks)))]
        try:
            infos = ray.get([a.info.remote() for a in actors])
            for info in infos:
                log(stage.name).info(worker_line(info))
            failures = self._drive(ray, stage, tasks, done, actors, infos)
        finally:  # also on an error or an interrupt: a job on a long-lived cluster must not leave actors behind
            for a in actors:
                ray.kill(a)
        return Execution(infos, failures)

    def _drive(self, ray, stage: ShardStage, tasks: List[ShardTask], done: Done, actors: list,
               infos: List[Dict[str, Any]]) -> List[str]:
        """Keep every live actor busy with one shard until the queue is empty; returns the failures. ``infos``
        (one per actor) gets the info of every restarted actor that comes back appended."""
        import time

        from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

        say = log(stage.name)
        max_restarts = stage.resources().max_retries
        tries = max_restarts + 1
        queue = list(tasks)
        attempts = {t.name: 0 for t in tasks}
        failures: List[str] = []
        identity = [info["identity"] for info in infos]
        node = [info.get("node_id") for info in infos]
        pid = [info.get("pid") for info in infos]
        inflight: Dict[Any, Tuple[int, ShardTask]] = {}
        idle: List[int] = list(range(len(actors)))
        # actor -> what is known of it since it was lost: when, its last shard and whether that one failed, the
        # ping in flight (or when to send the next), the shard kept for it (held)
        down: Dict[int, Dict[str, Any]] = {}
        pings: Dict[Any, int] = {}
        gone: List[int] = []
        deaths = [0] * len(actors)  # losses seen per actor
        dead_nodes: set = set()
        nodes_seen = 0.0

        def fail(task: ShardTask, error: str) -> None:
            failures.append(f"{task.name}: {error}")
            done(task, None, error)

        def left() -> int:
            return len(actors) - len(gone)

        def lost(i: int, task: ShardTask, err: Exception) -> None:
            attempts[task.name] += 1
            error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            again = attempts[task.name] < tries
            say.warning(f"{task.name} attempt {attempts[task.name]}/{tries} failed: worker {identity[i]} lost "
                        f"({error}); " + ("it is retried on that worker once restarted, else on another" if again
                                          else "no attempt left"))
            if not again:
                fail(task, error)
            deaths[i] += 1
            d = {"since": time.monotonic(), "task": task, "failed": not again, "held": task if again else None,
                 "next_ping": 0.0}
            if deaths[i] > max_restarts:  # Ray restarts an actor max_restarts times, no more: gone for good
                drop(i, d)
            else:
                down[i] = d

        def drop(i: int, d: Dict[str, Any]) -> None:
            gone.append(i)
            say.warning(f"{d['task'].name} {'failed' if d['failed'] else 'lost'}: worker {identity[i]} died and has "
                        f"no restart left (max_restarts={max_restarts}); dropped, {left()} worker(s) left")
            release(i, d, "is gone for good")

        def release(i: int, d: Dict[str, Any], why: str) -> None:
            """The shard kept for lost actor ``i`` goes to the next live actor."""
            task, d["held"] = d["held"], None
            if task is not None:
                queue.insert(0, task)
                say.warning(f"{task.name} goes to another worker: worker {identity[i]} {why}")

        while True:
            now = time.monotonic()
            for i, d in down.items():  # ping every lost actor that is not being pinged
                if d["next_ping"] is not None and now >= d["next_ping"]:
                    d["next_ping"] = None
                    pings[actors[i].info.remote()] = i
            held = [i for i, d in down.items() if d["held"] is not None]
            if held and idle:  # a live actor waits: does a held shard have to wait for its own actor still?
                if now - nodes_seen >= self.poll_s:
                    nodes_seen = now
                    try:
                        dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
                    except Exception as err:  # noqa: BLE001 - the control store busy: ask again next time
                        say.debug(f"node table not read: {type(err).__name__}: {err}")
                for i in held:
                    if node[i] in dead_nodes:
                        release(i, down[i], "was on a node that died")
                    elif now - down[i]["since"] >= self.rejoin_wait_s:
                        release(i, down[i], f"is not back {self.rejoin_wait_s:g} s after it was lost")
            while idle and queue:
                i, task = idle.pop(0), queue.pop(0)
                inflight[actors[i].process.remote(task)] = (i, task)
            held = [i for i, d in down.items() if d["held"] is not None]
            if not inflight and not queue and not held:
                break  # all done or failed: a restart still pending is not waited for
            if not inflight and not idle and (
                    not down or all(now - d["since"] >= self.rejoin_wait_s for d in down.values())):
                break  # no live actor, and none coming back
            refs = list(inflight) + list(pings)
            if not refs:  # only lost actors, none pinged right now: look again in a moment
                time.sleep(self.poll_s)
                continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=self.poll_s if down else None)
            if not ready:
                continue
            ref = ready[0]
            if ref in pings:
                i = pings.pop(ref)
                try:
                    info = ray.get(ref)
                except ActorDiedError:  # Ray will not restart it (its restart failed): gone for good
                    drop(i, down.pop(i))
                except RayActorError:  # unreachable, not yet known dead or restarting: ask again in a moment
                    down[i]["next_ping"] = time.monotonic() + self.poll_s
                else:  # restarted and set up again: back in the pool, with its lost shard if it was kept for it
                    d = down.pop(i)
                    if info.get("pid") != pid[i] or info["identity"] != identity[i]:  # a new process
                        infos.append(info)
                        say.info(f"{worker_line(info)} (restarted worker {identity[i]})")
                    identity[i], node[i], pid[i] = info["identity"], info.get("node_id"), info.get("pid")
                    if d["held"] is not None:
                        inflight[actors[i].process.remote(d["held"])] = (i, d["held"])
                    else:
                        idle.append(i)
                continue
            i, task = inflight.pop(ref)
            try:
                done(task, ray.get(ref), None)
            except RayTaskError as err:  # process_shard raised: the actor is fine, the shard may be retried
                cause = err.cause  # the shard's own exception, worded as LocalExecutor words it
                error = f"{type(cause).__name__}: {cause}"
                attempts[task.name] += 1
                say.warning(f"{task.name} attempt {attempts[task.name]}/{tries} failed: {error}")
                if attempts[task.name] < tries:  # next, on the same actor: LocalExecutor retries a shard at once
                    inflight[actors[i].process.remote(task)] = (i, task)
                else:
                    fail(task, error)
                    idle.insert(0, i)
            except RayActorError as err:  # the actor died or cannot be reached: its shard was lost with it
                lost(i, task, err)
            else:
                idle.insert(0, i)
        pending = list(down.values())
        rest = queue + [d["held"] for d in pending if d["held"] is not None]
        restarting = f", {len(pending)} not back within {self.rejoin_wait_s:g} s of a restart" if pending else ""
        for task in rest:  # no worker is left: what is not done fails now, and a rerun picks it up
            fail(task, f"not run: no worker left ({len(gone)} dropped, their restarts used up{restarting})")
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
