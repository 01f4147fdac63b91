"""Joining or starting Ray, and keeping Ray's own logs out of a default run: what every Ray stage shares."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Tuple

from pipeline.runtime.config import RayConfig
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
    * Ray Train's controller polls its workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (2 s by default), and a
      run waits a poll at each of its phases: at 0.5 s a 16-row train took 6 s less of 49 on a 2-core machine
      (0.2 s: the same). A local Ray only; a cluster's own setting stands.
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
        env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.5"
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
