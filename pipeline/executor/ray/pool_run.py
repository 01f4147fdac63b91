"""One run of the Ray actor pool (:class:`pipeline.executor.ray.pool.RayActorPool`): the event loop and a handler per event.

Each event the pool sees (a preflight's answer, a setup's, a shard's result or error, an actor lost, a wait run out,
a GPU joining) moves one actor from one :class:`pipeline.executor.ray.pool_workers.ActorState` to another; how workers start (the
preflight, replacements, joining GPUs) is :class:`pipeline.executor.ray.pool_workers.WorkerStarts`.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Set

from pipeline.executor.failures import DeviceFailure
from pipeline.executor.local import Done
from pipeline.executor.stage import ShardStage, ShardTask
from pipeline.runtime.log import get as log

from .placement import plan_workers
from .actor import bound_actor_class, says_more, worker_line
from .pool_workers import ActorState, PoolActor, WorkerStarts


class PoolRun(WorkerStarts):
    """The actors of one run, from the preflight to the last shard; ``infos`` holds every set-up worker's info."""

    def __init__(self, pool, ray, stage: ShardStage, tasks: List[ShardTask], done: Done):
        self.pool, self.ray, self.stage, self.done = pool, ray, stage, done
        self.say = log(stage.name)
        res = stage.resources()
        # decided once, when the stage's fingerprint (its device kind) was first taken
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
            if a.state is ActorState.CHECKING and now - a.created_at < self.pool.wait_s:
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
        if isinstance(cause, DeviceFailure):  # the worker's device, not the shard: another worker takes it
            return self.retire(a, str(cause))
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
            (self.say.info if was_lost or says_more(info) else self.say.debug)(
                worker_line(info) + (f" (restarted worker {a.identity})" if was_lost else ""))
        a.sees(info)
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

    def retire(self, a: PoolActor, why: str) -> None:
        """``a``'s device failed (pipeline.executor.failures.DeviceFailure): the actor is killed for good and its GPU
        gets no other one in this run (:meth:`grow` counts it as taken); its shard goes to the next live worker,
        no attempt spent, since the shard did not fail."""
        task, a.shard = a.shard, None
        a.state, a.retired = ActorState.GONE, why
        self.ray.kill(a.handle, no_restart=True)
        left = sum(b.state is not ActorState.GONE for b in self.actors)
        self.say.warning(f"worker {a.identity} retired: {why}; {task.name} goes to another worker, {left} worker(s) "
                         "left")
        self.queue.insert(0, task)

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
        gone = sum(a.state is ActorState.GONE and not a.retired for a in self.actors)
        restarting = (f", {len(pending)} not back within {self.pool.rejoin_wait_s:g} s of a restart" if pending
                      else "")
        retired = [f"{a.identity} ({a.retired})" for a in self.actors if a.retired]
        retired = f"; retired, their device failed: {', '.join(retired)}" if retired else ""
        for task in rest:
            self.fail(task, f"not run: no worker left ({gone} dropped, their restarts used up{restarting}{retired})")

