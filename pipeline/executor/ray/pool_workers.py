"""How the actor pool's workers start: the first ones through the preflight, then every later one (a GPU that joins,
a replacement for a worker that could not set up) through the same checks; and what the manifest says of them.
A mixin of :class:`pipeline.executor.ray.pool_run.PoolRun`, which holds the state (``actors``, ``waiting``, ``bad_nodes``, ...)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from pipeline.executor.preflight import where
from pipeline.executor.stage import ShardTask

from .placement import avoiding, could_host


class ActorState(Enum):
    CHECKING = "checking"  # created, its preflight in flight (it may still wait for a node with its resources)
    STARTING = "starting"  # setup (loading the models) in flight
    IDLE = "idle"  # set up, waiting for a shard
    BUSY = "busy"  # a shard in flight on it
    LOST = "lost"  # died or unreachable, Ray restarting it: set up again at ``next_ping``
    PINGED = "pinged"  # lost, its setup in flight: it is back once that answers
    GONE = "gone"  # dropped for good (no restart left, its setup failed, its preflight did, or its device: retired)


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
    retired: str = ""  # why, once its device failed (PoolRun.retire): GONE, and its GPU is not given another actor
    ref: Any = None  # its call in flight (a shard's, a setup's), and since when: the deadlines count from it
    since: float = 0.0
    # what the pool weighs it by (pipeline.executor.failures): device failures not put down to a prompt since its
    # last good shard, restarts the pool asked for, prompts and shards tried, rejects with a retried reason, shard
    # errors, and the shards it wrote with such rejects (redone by others if it is taken out)
    device_failures: int = 0
    restarts: int = 0
    prompts: int = 0
    shards: int = 0
    retried_rejects: int = 0
    shard_errors: int = 0
    with_rejects: List[ShardTask] = field(default_factory=list)

    @property
    def down(self) -> bool:
        return self.state in (ActorState.LOST, ActorState.PINGED)

    def sees(self, info: Dict[str, Any]) -> None:
        self.identity, self.node, self.pid = info["identity"], info.get("node_id"), info.get("pid")
        self.gpu_ids = info.get("gpu_ids", [])


class WorkerStarts:
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
        """Create ``n`` actors, run the preflight on them (pipeline.executor.ray.preflight: refuses before any work) and set them
        up; returns the preflight's report."""
        from .preflight import preflight

        # the preflight's line repeats it once they answer; while they do not, its progress lines say what they wait for
        self.say.debug(f"workers: {self.place.describe()} ({self.place.reason})")
        for _ in range(n):
            self.new_actor()
        report = preflight(self, self.actors)
        self.spec = report.spec
        for i, (a, row) in enumerate(zip(self.actors, report.rows)):
            a.sees(row)
            if i in report.excluded:  # failed its checks, the others enough (workers.min_fraction): not used
                why = "; ".join(f"{k}: {m}" for k, m in row.get("problems", []))[:300]
                a.state, a.retired = ActorState.GONE, f"left out by the preflight: {why}"
                self.events["excluded"].append({"worker": where(row), "why": why})
                self.ray.kill(a.handle, no_restart=True)
                continue
            self.setup(a)
        return report

    def setup(self, a: PoolActor) -> None:
        a.state = ActorState.STARTING
        self.call(a, a.handle.setup.remote())

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
        mine = sum(a.state is not ActorState.GONE or bool(a.retired) for a in self.actors)  # a retired GPU: taken
        # no more new workers than shards left for them to take
        spare = len(self.queue) - sum(a.state in (ActorState.CHECKING, ActorState.STARTING,
                                                  ActorState.IDLE) for a in self.actors)
        for _ in range(max(0, min(gpus - mine, spare))):
            self.say.info(f"a GPU joined the cluster ({gpus} now): starting a worker for it")
            self.check(self.new_actor(joined=True))

    def workers(self) -> List[Dict[str, Any]]:
        """The manifest's ``workers``: every set-up worker's info, then every other actor that passed its preflight
        (placed, but no shard was left for it by the time its setup would have ended)."""
        seen = {(i.get("identity"), i.get("pid")) for i in self.infos}
        rest = [{"identity": a.identity, "pid": a.pid, "node_id": a.node, "gpu_ids": a.gpu_ids,
                 "status": "placed, not set up: no shard left for it"}
                for a in self.actors if a.state is not ActorState.GONE and a.pid is not None
                and (a.identity, a.pid) not in seen]
        # every worker the pool gave up on, with why (the preflight's left out, the retired), and the restarted
        out = [{"identity": a.identity, "node_id": a.node, "gpu_ids": a.gpu_ids, "status": a.retired}
               for a in self.actors if a.retired]
        return self.infos + rest + out

    def kill_all(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a.handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
