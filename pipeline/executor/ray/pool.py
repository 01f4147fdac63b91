"""The Ray actor pool: the stage driver's executor (:mod:`pipeline.executor.driver`) for stages that declare actors.

One actor per expected worker (:mod:`pipeline.executor.ray.placement`). An actor is cheap to create: it loads nothing until told.
The pool first runs the **preflight** on every expected worker, waiting for them as the cluster comes up
(``workers.wait_s``, a progress line meanwhile), and refuses before any work when a check fails
(:mod:`pipeline.executor.ray.preflight`); then each actor's ``setup`` loads the models and it takes shard after shard. An actor
that cannot set up (a hub error, an out-of-memory, its process killed while loading) is dropped and another is
started on a node it has not failed on; the stage fails only when no worker can start, with the setup errors in its
message. With ``num_workers: null`` on GPUs every GPU that joins later gets an actor.

Shards fail as under :class:`pipeline.executor.local.LocalExecutor`: a shard whose ``process_shard`` raises is retried
up to ``resources().max_retries`` times, each failed attempt logged. A lost actor (its process killed, or its node
gone) costs its in-flight shard one attempt too: the pool, not Ray, retries it (``max_task_retries=0``). Ray
restarts the actor (``max_restarts``); the pool counts it back once its ``setup`` answers again, and keeps the lost
shard for it meanwhile unless it cannot take it back (gone for good, its node dead, or not back within
:attr:`RayActorPool.rejoin_wait_s`); then any live actor takes the shard. The events and their handlers:
:class:`pipeline.executor.ray.pool_run.PoolRun`; the actor itself: :mod:`pipeline.executor.ray.actor`.
"""

from __future__ import annotations

from typing import List

from pipeline.executor.local import Done, Execution
from pipeline.executor.stage import ShardStage, ShardTask
from pipeline.runtime.config import RayConfig

from .pool_run import PoolRun
from .runtime import init_ray


class RayActorPool:
    """The executor: preflight, setup, then every shard on the pool (:class:`pipeline.executor.ray.pool_run.PoolRun`)."""

    rejoin_wait_s = 60.0  # how long a restarting actor keeps its lost shard, or is waited for when no other is left
    poll_s = 1.0  # how often lost actors, the node table and joining GPUs are looked at
    progress_s = 15.0  # seconds between "waiting for workers" lines
    # The least a shard's deadline can be (workers.shard_timeout_factor times its expected time): a shard of a few
    # prompts done in seconds must not be taken back for a pause (a garbage collection, a slow write to storage).
    shard_floor_s = 300.0
    # Fresh processes a worker whose device failed gets before its GPU is retired: one. A sticky CUDA error is
    # the process's (its context), cleared by a new one at the cost of a model load; a GPU that fails again in a
    # fresh process is the GPU's, and each further try would cost another shard's time and another load.
    device_restarts = 1

    def __init__(self, ray_cfg: RayConfig, wait_s: float = 600.0, check_s: float = 900.0):
        self.ray_cfg = ray_cfg
        self.wait_s = wait_s  # workers.wait_s: how long the expected workers are waited for
        self.check_s = check_s  # workers.check_timeout_s: how long a started worker's checks may take
        self.preflight = None  # the last run's preflight report (pipeline.executor.ray.preflight.Report)

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        ray = init_ray(self.ray_cfg)
        run = PoolRun(self, ray, stage, tasks, done)
        try:
            self.preflight = run.start(min(run.place.num_workers, len(tasks)))
            failures = run.drive()
        finally:  # also on an error or an interrupt: a job on a long-lived cluster must not leave actors behind
            run.kill_all()
        return Execution(run.workers(), failures, run.faults())
