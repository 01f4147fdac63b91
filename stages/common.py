"""What the Ray stages share: joining or starting Ray, worker placement, progress lines."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from pipeline.config import RayConfig


def init_ray(cfg: RayConfig):
    """Join the cluster (`ray job submit` sets RAY_ADDRESS) or start a local Ray; idempotent."""
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        kwargs = dict(include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
        address = cfg.address or os.environ.get("RAY_ADDRESS")
        if address and address != "local":
            ray.init(address=address, **kwargs)
        else:  # a new local Ray ("local", or nothing to join), with the resources it may advertise
            ray.init(address=address, num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, **kwargs)
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


class Progress:
    """Periodic one-line progress: done/total, rate, ETA."""

    def __init__(self, name: str, total: int, unit: str = "prompts", every: float = 5.0, enabled: bool = True):
        self.name, self.total, self.unit, self.every, self.enabled = name, total, unit, every, enabled
        self.done = 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int, extra: str = "", force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (force or now - self._last >= self.every or self.done >= self.total):
            self._last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            eta_s = f"{eta:,.0f}s" if eta != float("inf") else "?"
            print(f"[{self.name}] {self.done}/{self.total} {self.unit} ({rate:.2f}/s, ETA {eta_s}) {extra}".rstrip(),
                  flush=True)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.t0


@dataclass
class ShardTask:
    name: str  # shown in progress lines and failure lists
    args: Tuple[Any, ...]  # passed to the actor method
    rows: int  # for progress


def run_shard_actors(cfg, worker_cls, init_args: Sequence[Any], method: str, tasks: List[ShardTask],
                     num_workers: Optional[int], stage: str):
    """Run ``worker_cls(*init_args, threads).method(*task.args)`` for every task on a pool of decoding actors.

    One actor per GPU (or CPU actors), each loading its models once. A killed actor is restarted and its in-flight
    task retried (``workers.max_retries``); an actor that is gone for good is dropped and its task listed as
    failed, and the others carry on. Returns (actor infos, failed task names).
    """
    ray = init_ray(cfg.ray)
    from ray.exceptions import RayActorError, RayTaskError

    place = plan_workers(num_workers, cfg.workers.cpus_per_worker)
    n_workers = min(place.num_workers, len(tasks))
    actor_cls = ray.remote(worker_cls).options(
        num_gpus=place.num_gpus, num_cpus=place.num_cpus,
        max_restarts=cfg.workers.max_retries, max_task_retries=cfg.workers.max_retries)
    threads = max(1, int(place.num_cpus))
    actors = [actor_cls.remote(*init_args, threads) for _ in range(n_workers)]
    infos = ray.get([a.info.remote() for a in actors])
    for info in infos:
        print(f"[{stage}] worker {info['identity']} pid={info['pid']} device={info['device']} "
              f"step cost (s) {json.dumps(info.get('step_cost_seconds', {}))}", flush=True)
    progress = Progress(stage, sum(t.rows for t in tasks), enabled=cfg.progress, every=0)
    queue = list(tasks)
    inflight = {}
    failures: List[str] = []

    def submit(actor):
        task = queue.pop(0)
        inflight[getattr(actor, method).remote(*task.args)] = (actor, task)

    for a in actors:
        if queue:
            submit(a)
    while inflight:
        done, _ = ray.wait(list(inflight), num_returns=1)
        actor, task = inflight.pop(done[0])
        try:
            res = ray.get(done[0])
            progress.update(task.rows, f"{task.name} rows={res.get('rows')} rejects={res.get('rejects')} "
                                       f"by {res.get('worker')}")
        except (RayActorError, RayTaskError) as err:
            failures.append(task.name)
            print(f"[{stage}] {task.name} failed: {type(err).__name__}: {str(err).splitlines()[0]}", flush=True)
            progress.update(task.rows, f"{task.name} FAILED")
            if isinstance(err, RayActorError):  # restarts exhausted: this actor is gone for good
                actor = None
        if queue and actor is not None:
            submit(actor)
        if not inflight and queue:  # every actor is gone: what is left fails, a rerun picks it up
            failures.extend(t.name for t in queue)
            queue.clear()
    for a in actors:
        ray.kill(a)
    return infos, failures
