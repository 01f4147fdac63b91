"""One run of the Ray actor pool (:class:`pipeline.executor.ray.pool.RayActorPool`): the event loop and a handler per event.

Each event the pool sees (a preflight's answer, a setup's, a shard's result or error, an actor lost, a wait run out,
a GPU joining) moves one actor from one :class:`pipeline.executor.ray.pool_workers.ActorState` to another; how workers start (the
preflight, replacements, joining GPUs) is :class:`pipeline.executor.ray.pool_workers.WorkerStarts`.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any, Dict, List, Optional, Set

from pipeline.executor.failures import (MIN_FAILURES, MIN_SHARD_ERRORS, PROMPT_BREAKS_DEVICE, DeviceFailure,
                                        far_above)
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
        w = getattr(stage.cfg, "workers", None)
        self.deadline_factor = getattr(w, "shard_timeout_factor", 8.0)  # workers.shard_timeout_factor
        self.setup_timeout_s = getattr(w, "setup_timeout_s", 1800.0)  # workers.setup_timeout_s
        self.task_timeout_s = getattr(w, "task_timeout_s", 7200.0)  # a shard's deadline before any shard has ended
        self.per_row = deque(maxlen=256)  # seconds per input row of the last shards done: a shard's expected time
        # prompt id -> the workers a device failure with it in flight was charged to (pipeline.executor.failures)
        self.charges: Dict[str, Set[str]] = {}
        self.avoid: Dict[str, Set[str]] = {}  # shard -> workers it failed on: another one takes it where one can
        # shard -> worker -> its errors charged to it (None once the shard failed on two: its own, no one's fault)
        self.shard_failed_on: Dict[str, Optional[Dict[str, int]]] = {}
        self.redo: Set[str] = set()  # shards done once, redone because their worker was taken out (done() said)
        self.events: Dict[str, Any] = {"restarted": [], "taken_back": [], "prompts_refused": {}, "excluded": []}

    def drive(self) -> List[str]:
        """Every shard, until all are done or failed; returns the failures."""
        while True:
            now = time.monotonic()
            for a in self.down():  # set up again every lost actor that is not being set up
                if a.state is ActorState.LOST and now >= a.next_ping:
                    a.state = ActorState.PINGED
                    self.call(a, a.handle.setup.remote())
            if self.idle:
                self.on_timeout(now)
            self.past_deadlines(now)
            self.grow(now)
            self.assign()
            if self.finished(now):
                break
            if not self.waiting:  # only lost actors, none being set up right now: look again in a moment
                time.sleep(self.pool.poll_s)
                continue
            # always a timeout: a call that never answers (a hung GPU) is found by its deadline, not waited for
            ready, _ = self.ray.wait(list(self.waiting), num_returns=1, timeout=self.pool.poll_s)
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

    def call(self, a: PoolActor, ref) -> None:
        a.ref, a.since = ref, time.monotonic()
        self.waiting[ref] = a

    def send(self, a: PoolActor, task: ShardTask) -> None:
        a.state, a.shard = ActorState.BUSY, task
        self.call(a, a.handle.process.remote(task))

    def assign(self) -> None:
        """The queue's shards to the idle workers, in order; a shard that failed on a worker goes to another one
        while any other worker may still take it (a prompt charged on one worker is then tried on a second)."""
        i = 0
        while self.idle and i < len(self.queue):
            task = self.queue[i]
            avoid = self.avoid.get(task.name)
            a = self.idle[0] if not avoid else next((x for x in self.idle if x.identity not in avoid), None)
            if a is None and any(x.identity not in avoid and x.state is not ActorState.GONE for x in self.actors):
                i += 1  # another worker will be free for it: the idle ones take the shards after it
                continue
            a = a or self.idle[0]
            self.idle.remove(a)
            self.queue.pop(i)
            self.send(a, task)

    def expected_s(self, task: ShardTask) -> Optional[float]:
        """A shard's expected seconds: its rows times the median seconds a row of the last shards done."""
        return task.rows * statistics.median(self.per_row) if self.per_row else None

    def deadline_s(self, task: ShardTask) -> float:
        """How long a shard may be in flight: workers.shard_timeout_factor times its expected time, at least
        RayActorPool.shard_floor_s; before any shard has ended, workers.task_timeout_s."""
        expected = self.expected_s(task)
        return self.task_timeout_s if expected is None else max(self.pool.shard_floor_s,
                                                                 self.deadline_factor * expected)

    def past_deadlines(self, now: float) -> None:
        """A shard in flight past its deadline is taken back and its worker restarted; a setup past
        workers.setup_timeout_s is given up on."""
        least = min(self.pool.shard_floor_s, self.task_timeout_s)  # no deadline is shorter: most need no median
        for a in list(self.actors):
            if a.state is ActorState.BUSY and now - a.since > least and now - a.since > self.deadline_s(a.shard):
                self.take_back(a, now)
            elif a.state in (ActorState.STARTING, ActorState.PINGED) and now - a.since > self.setup_timeout_s:
                self.waiting.pop(a.ref, None)
                why = f"its setup did not finish within workers.setup_timeout_s={self.setup_timeout_s:g} s"
                self.say.warning(f"gave up on worker {a.identity} (node {str(a.node)[:12]}): {why}")
                if a.state is ActorState.PINGED:
                    a.lost_on = a.lost_on or a.shard
                    self.drop(a, why)
                else:
                    self.setup_failed(a, why)

    def take_back(self, a: PoolActor, now: float) -> None:
        """``a``'s shard ran past its deadline (a hung call): another worker takes it (one attempt spent; the
        worker's output is written atomically at its end, so nothing of it was published), and ``a`` is
        restarted in a fresh process."""
        task = a.shard
        self.waiting.pop(a.ref, None)
        self.attempts[task.name] += 1
        expected = self.expected_s(task)
        why = (f"{task.name} on worker {a.identity} not done after {now - a.since:.0f} s (its deadline "
               f"{self.deadline_s(task):.0f} s: workers.shard_timeout_factor={self.deadline_factor:g} x "
               f"{expected or 0:.1f} s expected)")
        self.events["taken_back"].append({"shard": task.name, "worker": a.identity, "seconds": round(now - a.since)})
        self.avoid.setdefault(task.name, set()).add(a.identity)
        a.shard = None
        if self.attempts[task.name] < self.tries:
            self.say.warning(f"{why}: taken back, it goes to another worker")
            self.queue.insert(0, task)
        else:
            self.say.warning(f"{why}: no attempt left")
            self.fail(task, f"not done within its deadline on {self.attempts[task.name]} attempts")
        a.device_failures += 1
        self.restart_or_retire(a, f"its shard {task.name} hung")

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

    def on_result(self, a: PoolActor, result: Dict[str, Any]) -> None:
        task = a.shard
        tried = result["rows"] // max(1, self.stage.rows_per_input) + result["rejects"]
        self.per_row.append(result["seconds"] / max(1, tried))
        a.prompts, a.shards, a.device_failures = a.prompts + tried, a.shards + 1, 0
        a.retried_rejects += result.get("retried_rejects", 0)
        if result.get("retried_rejects"):
            a.with_rejects.append(task)
        if self.outlier(a):
            return  # taken out: this shard and its others with rejects go to other workers (done() not said yet)
        if task.name in self.redo:
            self.redo.discard(task.name)
            self.say.info(f"{task.name} redone by worker {a.identity}: rows={result['rows']} "
                          f"rejects={result['rejects']}")
        else:
            self.done(task, result, None)
        self.make_idle(a, first=True)

    def outlier(self, a: PoolActor) -> bool:
        """Takes ``a`` out when its failures run far above the other workers' (pipeline.executor.failures.
        far_above): its rejects with a retried reason per prompt (over the stage's max_reject_fraction too), or its
        shard errors per shard. Never the last worker left."""
        others = [b for b in self.actors if b is not a and (b.prompts or b.shards or b.shard_errors)]
        if not any(b.state is not ActorState.GONE for b in self.actors if b is not a):
            return False
        o_rej, o_prompts = sum(b.retried_rejects for b in others), sum(b.prompts for b in others)
        o_err, o_shards = sum(b.shard_errors for b in others), sum(b.shards + b.shard_errors for b in others)
        why = None
        if far_above(a.retried_rejects, a.prompts, o_rej, o_prompts, MIN_FAILURES, self.stage.max_reject_fraction()):
            why = (f"{a.retried_rejects} of its {a.prompts} prompts failed to decode (decode_error, out_of_memory), "
                   f"the other workers {o_rej} of {o_prompts}")
        elif far_above(a.shard_errors, a.shards + a.shard_errors, o_err, o_shards, MIN_SHARD_ERRORS):
            why = (f"{a.shard_errors} of its {a.shards + a.shard_errors} shards failed (reading or writing them), "
                   f"the other workers {o_err} of {o_shards}")
        if why is None:
            return False
        task, redo = a.shard, [t for t in a.with_rejects]
        a.shard = None
        self.retire(a, f"taken out: {why}", requeue=False)
        for t in reversed(redo):  # its shards with rejects are redone by the others, this one's first
            if t is not task:
                self.redo.add(t.name)
            self.avoid.setdefault(t.name, set()).add(a.identity)
            self.queue.insert(0, t)
        if task is not None and task not in redo:
            self.queue.insert(0, task)
        return True

    def on_error(self, a: PoolActor, err) -> None:
        """process_shard raised: the shard may be retried, next, on the same actor (as LocalExecutor retries a
        shard at once)."""
        task, cause = a.shard, err.cause  # the shard's own exception, worded as LocalExecutor words it
        error = f"{type(cause).__name__}: {cause}"
        if isinstance(cause, DeviceFailure):  # the worker's device, not the shard: another worker takes it
            return self.on_device_failure(a, cause)
        self.attempts[task.name] += 1
        self.count_shard_error(a, task)
        self.say.warning(f"{task.name} attempt {self.attempts[task.name]}/{self.tries} failed: {error}")
        if self.attempts[task.name] >= self.tries:
            self.fail(task, error)
            task = a.shard = None
        else:  # retried on another worker where one can take it: a node with broken storage fails every shard
            self.avoid.setdefault(task.name, set()).add(a.identity)
        if self.outlier(a):
            return
        if task is not None:
            self.queue.insert(0, task)
        self.make_idle(a, first=False)

    def count_shard_error(self, a: PoolActor, task: ShardTask) -> None:
        """A shard error counts against its worker until the shard fails on a second worker too: then it is the
        shard's (its input, a bug), and neither worker is charged with it."""
        failed_on = self.shard_failed_on.setdefault(task.name, {})
        if failed_on is None:  # the shard's own
            return
        failed_on[a.identity] = failed_on.get(a.identity, 0) + 1
        a.shard_errors += 1
        if len(failed_on) >= 2:
            for b in self.actors:
                b.shard_errors -= failed_on.get(b.identity, 0)
            self.shard_failed_on[task.name] = None

    def on_device_failure(self, a: PoolActor, cause: DeviceFailure) -> None:
        """``a``'s device failed on its shard. The failure is charged to the prompts in flight: one charged on two
        different workers broke both, so it is rejected (its error kept) and the shard redone without it, the
        workers not blamed; a batch's failure has its prompts decoded alone next time, so that the next failure
        names one. The shard goes to another worker, no attempt spent; ``a`` is restarted or retired
        (:meth:`restart_or_retire`)."""
        task, a.shard = a.shard, None
        a.device_failures += 1
        guilty = []
        for p in cause.prompts:
            seen = self.charges.setdefault(p, set())
            seen.add(a.identity)
            if len(seen) >= 2 and (len(cause.prompts) == 1 or p in task.alone):
                guilty.append(p)
        if guilty:
            for p in guilty:
                task.refused[p] = (f"broke the device of {len(self.charges[p])} workers "
                                   f"({', '.join(sorted(self.charges[p]))}): {cause}")[:500]
                self.events["prompts_refused"][p] = sorted(self.charges[p])
                for b in self.actors:  # the workers it broke are not to blame for it
                    if b.identity in self.charges[p]:
                        b.device_failures = max(0, b.device_failures - 1)
            self.say.warning(f"prompt(s) {', '.join(guilty)} broke the device of two workers: rejected as "
                             f"{PROMPT_BREAKS_DEVICE}; {task.name} is redone without them")
        elif len(cause.prompts) > 1:  # a batch: its prompts alone next time
            task.alone = tuple(sorted(set(task.alone) | set(cause.prompts)))
        if not guilty:
            self.avoid.setdefault(task.name, set()).add(a.identity)
        self.queue.insert(0, task)
        self.restart_or_retire(a, str(cause))

    def restart_or_retire(self, a: PoolActor, why: str) -> None:
        """A worker whose device failed gets a fresh process (a new CUDA context: a sticky error does not outlive
        it) once, RayActorPool.device_restarts; failing again before a shard of its own completes, its GPU is
        retired. A restart costs a model load (a minute on a GPU), a retired GPU the rest of the run."""
        if a.device_failures > self.pool.device_restarts or a.deaths >= self.max_restarts:
            return self.retire(a, why, requeue=False)
        a.deaths += 1
        a.restarts += 1
        self.events["restarted"].append({"worker": a.identity, "why": why[:300]})
        self.say.warning(f"worker {a.identity} (node {str(a.node)[:12]}) restarted in a fresh process: {why}")
        a.state, a.lost_at, a.next_ping = ActorState.LOST, time.monotonic(), time.monotonic() + self.pool.poll_s
        a.lost_on, a.lost_failed = None, False
        if a in self.idle:
            self.idle.remove(a)
        self.ray.kill(a.handle, no_restart=False)

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

    def retire(self, a: PoolActor, why: str, requeue: bool = True) -> None:
        """``a``'s device failed past its restarts, or its failures ran far above the others': the actor is killed
        for good and its GPU gets no other one in this run (:meth:`grow` counts it as taken); its shard (with
        ``requeue``) goes to the next live worker, no attempt spent, since the shard did not fail."""
        task, a.shard = a.shard, None
        a.state, a.retired = ActorState.GONE, why
        if a in self.idle:
            self.idle.remove(a)
        self.ray.kill(a.handle, no_restart=True)
        left = sum(b.state is not ActorState.GONE for b in self.actors)
        self.say.warning(f"worker {a.identity} (node {str(a.node)[:12]}, GPU {','.join(a.gpu_ids) or '-'}) retired: "
                         f"{why}; " + (f"{task.name} goes to another worker, " if requeue and task else "")
                         + f"{left} worker(s) left")
        if requeue and task is not None:
            self.queue.insert(0, task)

    def drop(self, a: PoolActor, why: str) -> None:
        a.state = ActorState.GONE
        self.ray.kill(a.handle, no_restart=True)
        left = sum(b.state is not ActorState.GONE for b in self.actors)
        what = f"{a.lost_on.name} {'failed' if a.lost_failed else 'lost'}: " if a.lost_on is not None else ""
        self.say.warning(f"{what}worker {a.identity} {why} (max_restarts={self.max_restarts}); dropped, {left} "
                         "worker(s) left")
        self.release(a, "is gone for good")

    def release(self, a: PoolActor, why: str) -> None:
        """The shard kept for lost actor ``a`` goes to the next live actor."""
        task, a.shard = a.shard, None
        if task is not None:
            self.queue.insert(0, task)
            self.say.warning(f"{task.name} goes to another worker: worker {a.identity} {why}")

    def faults(self) -> Dict[str, Any]:
        """What faults cost this run, for summary.json's ``faults`` ({} when none): the workers restarted (and why),
        retired or left out by the preflight (and why), the shards taken back past their deadline, the prompts
        rejected for breaking two workers' devices (with the workers)."""
        e = self.events
        retired = [{"worker": a.identity, "node_id": a.node, "gpu_ids": list(a.gpu_ids), "why": a.retired}
                   for a in self.actors if a.retired and not a.retired.startswith("left out by the preflight")]
        out = {"restarted": e["restarted"], "retired": retired, "left_out": e["excluded"],
               "taken_back": e["taken_back"], "prompts_refused": e["prompts_refused"]}
        return {k: v for k, v in out.items() if v}

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

