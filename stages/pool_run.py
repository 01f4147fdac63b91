"""One run of the Ray actor pool (:class:`stages.pool.RayActorPool`): the actors' states and a handler per event.

Each event the pool sees (a preflight's answer, a setup's, a shard's result or error, an actor lost, a wait run out,
a GPU joining) moves one actor from one :class:`ActorState` to another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Optional, Set

from pipeline.executor.local import Done
from pipeline.executor.stage import ShardStage, ShardTask
from pipeline.runtime.log import get as log

from .placement import avoiding, could_host, plan_workers
from .pool import bound_actor_class, worker_line


class ActorState(Enum):
    CHECKING = "checking"  # created, its preflight in flight (it may still wait for a node with its resources)
    CHECKED = "checked"  # preflight passed, not told to set up yet
    STARTING = "starting"  # setup (loading the models) in flight
    IDLE = "idle"  # set up, waiting for a shard
    BUSY = "busy"  # a shard in flight on it
    LOST = "lost"  # died or unreachable, Ray restarting it: set up again at ``next_ping``
    PINGED = "pinged"  # lost, its setup in flight: it is back once that answers
    GONE = "gone"  # dropped for good (no restart left, its setup failed, or its preflight did)


@dataclass
class PoolActor:
    """The pool's record of one actor. ``shard`` is the shard in flight on it (BUSY) or, once it is lost, the shard
    kept for it until it is back (LOST, PINGED; None once handed to another actor or failed)."""

    handle: Any
    identity: str = "?"
    node: Optional[str] = None
    pid: Optional[int] = None
    state: ActorState = ActorState.CHECKING
    joined: bool = False  # started for a GPU that joined, or in place of one that could not set up
    created_at: float = 0.0
    gpu_ids: tuple = ()
    shard: Optional[ShardTask] = None
    lost_on: Optional[ShardTask] = None  # the shard it was last lost with, and whether that shard failed then
    lost_failed: bool = False
    lost_at: float = 0.0  # time.monotonic() of its last loss: rejoin_wait_s counts from it
    next_ping: float = 0.0
    deaths: int = 0  # losses seen: Ray restarts an actor max_restarts times, no more

    @property
    def down(self) -> bool:
        return self.state in (ActorState.LOST, ActorState.PINGED)

    def sees(self, info: Dict[str, Any]) -> None:
        self.identity, self.node, self.pid = info["identity"], info.get("node_id"), info.get("pid")
        self.gpu_ids = info.get("gpu_ids", [])


class PoolRun:
    """The actors of one run, from the preflight to the last shard; ``infos`` holds every set-up worker's info."""

    def __init__(self, pool, ray, stage: ShardStage, tasks: List[ShardTask], done: Done):
        self.pool, self.ray, self.stage, self.done = pool, ray, stage, done
        self.say = log(stage.name)
        res = stage.resources()
        # decided once: execute() placed it before the stage's fingerprint (its device kind) was taken
        self.place = getattr(stage, "placement", None) or plan_workers(res, ray.cluster_resources())
        self.max_restarts = res.max_retries
        self.tries = self.max_restarts + 1
        self.actor_cls = ray.remote(bound_actor_class(stage))
        self.queue = list(tasks)
        self.attempts = {t.name: 0 for t in tasks}
        self.failures: List[str] = []
        self.infos: List[Dict[str, Any]] = []
        self.actors: List[PoolActor] = []
        self.idle: List[PoolActor] = []  # the IDLE actors, the one given the next shard first
        self.waiting: Dict[Any, PoolActor] = {}  # ref -> its actor: whatever call of it is in flight
        self.bad_nodes: Set[str] = set()  # nodes an actor could not set up (or pass the preflight) on
        self.setup_errors: Dict[str, str] = {}  # node -> the last setup error there
        self.dead_nodes: set = set()
        self.nodes_seen = self.grown_at = 0.0
        self.spec = None

    # ---- start: the preflight, then every actor's setup ----------------------------------------------------------
    def new_actor(self, joined: bool = False) -> PoolActor:
        p = self.place
        opts = dict(num_gpus=p.num_gpus, num_cpus=p.num_cpus, max_restarts=self.max_restarts, max_task_retries=0)
        if self.bad_nodes:
            opts["label_selector"] = avoiding(self.bad_nodes)
        a = PoolActor(self.actor_cls.options(**opts).remote(max(1, int(p.num_cpus))), joined=joined,
                      created_at=time.monotonic())
        self.actors.append(a)
        return a

    def start(self, n: int):
        """Create ``n`` actors, run the preflight on them (stages.preflight: refuses before any work) and set them
        up; returns the preflight's report."""
        from .preflight import preflight

        self.say.info(f"workers: {self.place.describe()} ({self.place.why})")
        for _ in range(n):
            self.new_actor()
        report = preflight(self, self.actors)
        self.spec = report.spec
        for a, row in zip(self.actors, report.rows):
            a.sees(row)
            self.setup(a)
        return report

    def setup(self, a: PoolActor) -> None:
        a.state = ActorState.STARTING
        self.waiting[a.handle.setup.remote()] = a

    # ---- the event loop -----------------------------------------------------------------------------------------
    def drive(self) -> List[str]:
        """Every shard, until all are done or failed; returns the failures."""
        while True:
            now = time.monotonic()
            for a in self.down():  # set up again every lost actor that is not being set up
                if a.state is ActorState.LOST and now >= a.next_ping:
                    a.state = ActorState.PINGED
                    self.waiting[a.handle.setup.remote()] = a
            if self.idle:
                self.on_timeout(now)
            self.grow(now)
            while self.idle and self.queue:
                self.send(self.idle.pop(0), self.queue.pop(0))
            if self.finished(now):
                break
            if not self.waiting:  # only lost actors, none being set up right now: look again in a moment
                time.sleep(self.pool.poll_s)
                continue
            polling = self.down() or self.place.elastic or any(
                a.state in (ActorState.CHECKING, ActorState.STARTING) for a in self.actors)
            ready, _ = self.ray.wait(list(self.waiting), num_returns=1, timeout=self.pool.poll_s if polling else None)
            if ready:
                a = self.waiting.pop(ready[0])
                {ActorState.BUSY: self.on_shard, ActorState.PINGED: self.on_setup, ActorState.STARTING: self.on_setup,
                 ActorState.CHECKING: self.on_checked}[a.state](a, ready[0])
        self.fail_the_rest()
        return self.failures

    def down(self) -> List[PoolActor]:
        """The lost actors (LOST, PINGED), in the order they were lost."""
        return sorted((a for a in self.actors if a.down), key=lambda a: a.lost_at)

    def coming(self, now: float) -> bool:
        """Whether a worker may still take shards: one set up or setting up, a lost one within rejoin_wait_s, or a
        new one waiting for a node within workers.wait_s."""
        for a in self.actors:
            if a.state in (ActorState.IDLE, ActorState.BUSY, ActorState.STARTING):
                return True
            if a.down and now - a.lost_at < self.pool.rejoin_wait_s:
                return True
            if a.state in (ActorState.CHECKING, ActorState.CHECKED) and now - a.created_at < self.pool.wait_s:
                return True
        return False

    def finished(self, now: float) -> bool:
        busy = any(a.state is ActorState.BUSY for a in self.actors)
        if not busy and not self.queue and all(a.shard is None for a in self.down()):
            return True  # all done or failed: a restart or a joining worker still pending is not waited for
        return not self.coming(now)

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
            self.drop(a, "died and has no restart left")

    def on_setup(self, a: PoolActor, ref) -> None:
        """A setup answered: a new worker is ready or could not start; a lost one is back, gone, or not yet
        reachable."""
        from ray.exceptions import ActorDiedError, RayActorError

        was_lost = a.state is ActorState.PINGED
        try:
            info = self.ray.get(ref)
        except ActorDiedError as err:  # Ray will not restart it (its restart failed), or it died while loading
            if was_lost:
                return self.drop(a, "died and has no restart left")
            info = {"setup_error": f"{type(err).__name__}: its process died while setting up "
                                   f"({(str(err).splitlines() or [''])[0][:200]})"}
        except RayActorError:  # unreachable, not yet known dead or restarting: ask again in a moment
            if was_lost:
                a.state, a.next_ping = ActorState.LOST, time.monotonic() + self.pool.poll_s
                return None
            info = {"setup_error": "its process was lost while setting up"}
        if "setup_error" in info:
            if was_lost:
                return self.drop(a, f"could not set up again after a restart ({info['setup_error']}): no restart "
                                    "left")
            return self.setup_failed(a, info["setup_error"])
        if info.get("pid") != a.pid or info["identity"] != a.identity or not was_lost:  # a new process
            self.infos.append(info)
            self.say.info(worker_line(info) + (f" (restarted worker {a.identity})" if was_lost else ""))
        a.sees(info)
        if a.shard is not None:
            self.send(a, a.shard)
        else:
            self.make_idle(a, first=False)

    def setup_failed(self, a: PoolActor, error: str) -> None:
        """A new worker could not set up: its node is avoided from now on, and another worker is started on any
        other node that could host one (it waits there for free resources, or for a node to join)."""
        a.state = ActorState.GONE
        self.ray.kill(a.handle, no_restart=True)
        node = a.node or "?"
        self.bad_nodes.add(node)
        self.setup_errors[node] = error
        try:
            nodes = self.ray.nodes()
        except Exception:  # noqa: BLE001 - the control store busy: try the replacement anyway
            nodes = None
        again = self.queue and (nodes is None or could_host(nodes, self.place, self.bad_nodes))
        self.say.warning(f"worker {a.identity} on node {node[:12]} could not set up: {error}; "
                         + ("starting one on another node" if again else "no other node can take a worker"))
        if again:
            self.check(self.new_actor(joined=True))

    def check(self, a: PoolActor) -> None:
        """A worker started after the preflight (a joining GPU, a replacement) runs the same checks first."""
        a.state = ActorState.CHECKING
        self.waiting[a.handle.preflight.remote(self.spec)] = a

    def on_checked(self, a: PoolActor, ref) -> None:
        from .preflight import late_problems

        try:
            row = self.ray.get(ref)
        except Exception as err:  # noqa: BLE001 - its node went away: nothing to set up
            a.state = ActorState.GONE
            self.say.warning(f"a joining worker was lost before its checks answered ({type(err).__name__})")
            return
        a.sees(row)
        problems = late_problems(self.spec, row)
        if problems:
            a.state = ActorState.GONE
            self.ray.kill(a.handle, no_restart=True)
            self.bad_nodes.add(a.node or "?")
            self.say.warning(f"worker {a.identity} (node {row.get('node_ip')}) fails the preflight, not used: "
                             + "; ".join(f"{k}: {m}" for k, m in problems))
            return
        self.setup(a)

    def grow(self, now: float) -> None:
        """With num_workers null on GPUs: one more actor for every GPU the cluster has gained, while shards wait."""
        if not self.place.elastic or not self.queue or now - self.grown_at < self.pool.poll_s:
            return
        self.grown_at = now
        try:
            gpus = int(self.ray.cluster_resources().get("GPU", 0))
            if self.bad_nodes:
                gpus -= sum(int(n.get("Resources", {}).get("GPU", 0)) for n in self.ray.nodes()
                            if n["NodeID"] in self.bad_nodes and n.get("Alive"))
        except Exception:  # noqa: BLE001 - the control store busy: look again next time
            return
        mine = sum(a.state is not ActorState.GONE for a in self.actors)
        # no more new workers than shards left for them to take
        spare = len(self.queue) - sum(a.state in (ActorState.CHECKING, ActorState.CHECKED, ActorState.STARTING,
                                                  ActorState.IDLE) for a in self.actors)
        for _ in range(max(0, min(gpus - mine, spare))):
            self.say.info(f"a GPU joined the cluster ({gpus} now): starting a worker for it")
            self.check(self.new_actor(joined=True))

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

    def drop(self, a: PoolActor, why: str) -> None:
        a.state = ActorState.GONE
        self.ray.kill(a.handle, no_restart=True)
        left = sum(b.state is not ActorState.GONE for b in self.actors)
        self.say.warning(f"{a.lost_on.name} {'failed' if a.lost_failed else 'lost'}: worker {a.identity} {why} "
                         f"(max_restarts={self.max_restarts}); dropped, {left} worker(s) left")
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
        if not rest:
            return
        if self.setup_errors and not self.infos:  # no worker ever started: say why
            why = "; ".join(f"node {n[:12]}: {e}" for n, e in self.setup_errors.items())
            raise RuntimeError(f"{self.stage.name}: no worker could start ({why})")
        gone = sum(a.state is ActorState.GONE for a in self.actors)
        restarting = (f", {len(pending)} not back within {self.pool.rejoin_wait_s:g} s of a restart" if pending
                      else "")
        for task in rest:
            self.fail(task, f"not run: no worker left ({gone} dropped, their restarts used up{restarting})")

    def workers(self) -> List[Dict[str, Any]]:
        """The manifest's ``workers``: every set-up worker's info, then every other actor that passed its preflight
        (placed, but no shard was left for it by the time its setup would have ended)."""
        seen = {(i.get("identity"), i.get("pid")) for i in self.infos}
        rest = [{"identity": a.identity, "pid": a.pid, "node_id": a.node, "gpu_ids": a.gpu_ids,
                 "status": "placed, not set up: no shard left for it"}
                for a in self.actors if a.state is not ActorState.GONE and a.pid is not None
                and (a.identity, a.pid) not in seen]
        return self.infos + rest

    def kill_all(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a.handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
