"""What the Ray stages share: joining or starting Ray, worker placement, and the Ray actor-pool executor of the
stage driver (:mod:`pipeline.executor.driver`)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
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


class ActorState(Enum):
    """Where one pool actor is; each event the pool sees (a result, an error, a loss, a ping's answer, a wait run
    out) moves one actor from one to another."""

    IDLE = "idle"  # alive, waiting for a shard
    BUSY = "busy"  # a shard in flight on it
    LOST = "lost"  # died or unreachable, Ray restarting it: pinged at ``next_ping``
    PINGED = "pinged"  # lost, its ping in flight: it is back once the ping answers
    GONE = "gone"  # no restart left, or its restart failed: dropped for good


@dataclass
class PoolActor:
    """The pool's record of one actor. ``shard`` is the shard in flight on it (BUSY) or, once it is lost, the shard
    kept for it until it is back (LOST, PINGED; None once handed to another actor or failed)."""

    handle: Any
    identity: str
    node: Optional[str]
    pid: Optional[int]
    state: ActorState = ActorState.IDLE
    shard: Optional[ShardTask] = None
    lost_on: Optional[ShardTask] = None  # the shard it was last lost with, and whether that shard failed then
    lost_failed: bool = False
    lost_at: float = 0.0  # time.monotonic() of its last loss: rejoin_wait_s counts from it
    next_ping: float = 0.0
    deaths: int = 0  # losses seen: Ray restarts an actor max_restarts times, no more

    @property
    def down(self) -> bool:
        return self.state in (ActorState.LOST, ActorState.PINGED)


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
    :attr:`rejoin_wait_s` for one, then fails the shards not done with "no worker left".

    One run's state is :class:`PoolRun`: a :class:`PoolActor` record per actor and a handler per event."""

    rejoin_wait_s = 60.0  # how long a restarting actor keeps its lost shard, or is waited for when no other is left
    poll_s = 1.0  # how often pings of lost actors and their nodes' liveness are looked at

    def __init__(self, ray_cfg: RayConfig):
        self.ray_cfg = ray_cfg

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        ray = init_ray(self.ray_cfg)

        res = stage.resources()
        place = plan_workers(res.num_workers, res.cpus_per_worker)
        # Ray restarts a dead actor (max_restarts) but never reruns its task (max_task_retries=0): PoolRun does,
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
            failures = PoolRun(self, ray, stage, tasks, done, actors, infos).drive()
        finally:  # also on an error or an interrupt: a job on a long-lived cluster must not leave actors behind
            for a in actors:
                ray.kill(a)
        return Execution(infos, failures)


class PoolRun:
    """One run of :class:`RayActorPool`: keeps every live actor busy with one shard until the queue is empty.
    ``infos`` (one per actor) gets the info of every restarted actor that comes back appended."""

    def __init__(self, pool: RayActorPool, ray, stage: ShardStage, tasks: List[ShardTask], done: Done,
                 handles: list, infos: List[Dict[str, Any]]):
        self.pool, self.ray, self.done, self.infos = pool, ray, done, infos
        self.say = log(stage.name)
        self.max_restarts = stage.resources().max_retries
        self.tries = self.max_restarts + 1
        self.queue = list(tasks)
        self.attempts = {t.name: 0 for t in tasks}
        self.failures: List[str] = []
        self.actors = [PoolActor(h, info["identity"], info.get("node_id"), info.get("pid"))
                       for h, info in zip(handles, infos)]
        self.idle = list(self.actors)  # the IDLE actors, the one given the next shard first
        self.waiting: Dict[Any, PoolActor] = {}  # ref -> its actor: a shard (BUSY) or a ping (PINGED) in flight
        self.dead_nodes: set = set()
        self.nodes_seen = 0.0

    def drive(self) -> List[str]:
        """The event loop; returns the failures."""
        while True:
            now = time.monotonic()
            for a in self.down():  # ping every lost actor that is not being pinged
                if a.state is ActorState.LOST and now >= a.next_ping:
                    a.state = ActorState.PINGED
                    self.waiting[a.handle.info.remote()] = a
            if self.idle:
                self.on_timeout(now)
            while self.idle and self.queue:
                self.send(self.idle.pop(0), self.queue.pop(0))
            if self.finished(now):
                break
            busy = [r for r, a in self.waiting.items() if a.state is ActorState.BUSY]
            refs = busy + [r for r, a in self.waiting.items() if a.state is ActorState.PINGED]
            if not refs:  # only lost actors, none pinged right now: look again in a moment
                time.sleep(self.pool.poll_s)
                continue
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=self.pool.poll_s if self.down() else None)
            if not ready:
                continue
            a = self.waiting.pop(ready[0])
            if a.state is ActorState.PINGED:
                self.on_ping(a, ready[0])
            else:
                self.on_shard(a, ready[0])
        self.fail_the_rest()
        return self.failures

    def down(self) -> List[PoolActor]:
        """The lost actors (LOST, PINGED), in the order they were lost."""
        return sorted((a for a in self.actors if a.down), key=lambda a: a.lost_at)

    def finished(self, now: float) -> bool:
        busy = any(a.state is ActorState.BUSY for a in self.actors)
        down = self.down()
        if not busy and not self.queue and all(a.shard is None for a in down):
            return True  # all done or failed: a restart still pending is not waited for
        # no live actor, and none coming back
        return not busy and not self.idle and all(now - a.lost_at >= self.pool.rejoin_wait_s for a in down)

    def send(self, a: PoolActor, task: ShardTask) -> None:
        a.state, a.shard = ActorState.BUSY, task
        self.waiting[a.handle.process.remote(task)] = a

    def make_idle(self, a: PoolActor, first: bool) -> None:
        a.state, a.shard = ActorState.IDLE, None
        if first:  # one that just finished a shard is given the next one first, one back from a restart last
            self.idle.insert(0, a)
        else:
            self.idle.append(a)

    def fail(self, task: ShardTask, error: str) -> None:
        self.failures.append(f"{task.name}: {error}")
        self.done(task, None, error)

    def on_shard(self, a: PoolActor, ref) -> None:
        """A shard's answer: its result, its own error (the actor is fine), or its actor lost."""
        from ray.exceptions import RayActorError, RayTaskError

        try:
            result = self.ray.get(ref)
        except RayTaskError as err:
            self.on_error(a, err)
        except RayActorError as err:  # the actor died or cannot be reached: its shard was lost with it
            self.on_lost(a, err)
        else:
            self.on_result(a, result)

    def on_result(self, a: PoolActor, result) -> None:
        self.done(a.shard, result, None)
        self.make_idle(a, first=True)

    def on_error(self, a: PoolActor, err) -> None:
        """process_shard raised: the shard may be retried, next, on the same actor (as LocalExecutor retries a
        shard at once)."""
        task, cause = a.shard, err.cause  # the shard's own exception, worded as LocalExecutor words it
        error = f"{type(cause).__name__}: {cause}"
        self.attempts[task.name] += 1
        self.say.warning(f"{task.name} attempt {self.attempts[task.name]}/{self.tries} failed: {error}")
        if self.attempts[task.name] < self.tries:
            self.send(a, task)
        else:
            self.fail(task, error)
            self.make_idle(a, first=True)

    def on_lost(self, a: PoolActor, err: Exception) -> None:
        """``a`` was lost with its shard: one attempt spent; the shard is kept for it while Ray restarts it."""
        task = a.shard
        self.attempts[task.name] += 1
        error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        again = self.attempts[task.name] < self.tries
        self.say.warning(f"{task.name} attempt {self.attempts[task.name]}/{self.tries} failed: worker {a.identity} "
                         f"lost ({error}); " + ("it is retried on that worker once restarted, else on another"
                                                if again else "no attempt left"))
        if not again:
            self.fail(task, error)
        a.deaths += 1
        a.state, a.lost_at, a.next_ping = ActorState.LOST, time.monotonic(), 0.0
        a.shard, a.lost_on, a.lost_failed = task if again else None, task, not again
        if a.deaths > self.max_restarts:  # Ray restarts an actor max_restarts times, no more: gone for good
            self.drop(a)

    def on_ping(self, a: PoolActor, ref) -> None:
        """A lost actor's ping answered: it is back (with its kept shard, if any), gone, or not reachable yet."""
        from ray.exceptions import ActorDiedError, RayActorError

        try:
            info = self.ray.get(ref)
        except ActorDiedError:  # Ray will not restart it (its restart failed): gone for good
            self.drop(a)
        except RayActorError:  # unreachable, not yet known dead or restarting: ask again in a moment
            a.state, a.next_ping = ActorState.LOST, time.monotonic() + self.pool.poll_s
        else:  # restarted and set up again
            if info.get("pid") != a.pid or info["identity"] != a.identity:  # a new process
                self.infos.append(info)
                self.say.info(f"{worker_line(info)} (restarted worker {a.identity})")
            a.identity, a.node, a.pid = info["identity"], info.get("node_id"), info.get("pid")
            if a.shard is not None:
                self.send(a, a.shard)
            else:
                self.make_idle(a, first=False)

    def on_timeout(self, now: float) -> None:
        """A live actor is idle: does a kept shard have to wait for its own actor still? Not once that actor is
        not back within rejoin_wait_s, or its node is dead (looked up every poll_s)."""
        held = [a for a in self.down() if a.shard is not None]
        if not held:
            return
        if now - self.nodes_seen >= self.pool.poll_s:
            self.nodes_seen = now
            try:
                self.dead_nodes = {n["NodeID"] for n in self.ray.nodes() if not n.get("Alive")}
            except Exception as err:  # noqa: BLE001 - the control store busy: ask again next time
                self.say.debug(f"node table not read: {type(err).__name__}: {err}")
        for a in held:
            if a.node in self.dead_nodes:
                self.release(a, "was on a node that died")
            elif now - a.lost_at >= self.pool.rejoin_wait_s:
                self.release(a, f"is not back {self.pool.rejoin_wait_s:g} s after it was lost")

    def drop(self, a: PoolActor) -> None:
        a.state = ActorState.GONE
        left = sum(b.state is not ActorState.GONE for b in self.actors)
        self.say.warning(f"{a.lost_on.name} {'failed' if a.lost_failed else 'lost'}: worker {a.identity} died and "
                         f"has no restart left (max_restarts={self.max_restarts}); dropped, {left} worker(s) left")
        self.release(a, "is gone for good")

    def release(self, a: PoolActor, why: str) -> None:
        """The shard kept for lost actor ``a`` goes to the next live actor."""
        task, a.shard = a.shard, None
        if task is not None:
            self.queue.insert(0, task)
            self.say.warning(f"{task.name} goes to another worker: worker {a.identity} {why}")

    def fail_the_rest(self) -> None:
        """No worker is left: what is not done fails now, and a rerun picks it up."""
        pending = self.down()
        rest = self.queue + [a.shard for a in pending if a.shard is not None]
        gone = sum(a.state is ActorState.GONE for a in self.actors)
        restarting = (f", {len(pending)} not back within {self.pool.rejoin_wait_s:g} s of a restart" if pending
                      else "")
        for task in rest:
            self.fail(task, f"not run: no worker left ({gone} dropped, their restarts used up{restarting})")


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


def quiet_ray_train_reports() -> None:
    """Ray Train logs "Reporting training result ..." (a full repr of every report) through a logger named by its
    file path, which its log_level filter (RunConfig.logging_config, ``ray.train.*``) misses: quieted unless -v."""
    import logging

    if log_verbosity() < 1:
        from ray.train.v2._internal.execution import context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)
