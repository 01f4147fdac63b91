"""A decoding stage's one-off wall-clock work (evaluate's pass at load, tune's load check) where its models fit.

One Ray task that asks what one of the stage's workers asks (one GPU, or its CPUs), never the job's driver, which
may have no GPU at all (a RayJob head has none); in this process when Ray is not running (tests). On a CPU the task
decodes on one thread, as one decoding actor of one CPU does: a wall-clock benchmark wants one quiet process.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Tuple

from pipeline.runtime.log import get as log


def on_a_worker(stage, fn: Callable, *args, what: str) -> Any:
    """``fn(*args)`` in a Ray task of one worker's resources, or here without Ray.

    The task says when it starts (its first streamed item: node and pid), so that waiting for resources (pending:
    GPUs held by the stage's own actors as they shut down, or by another job) is told apart from running, each with
    its own clock and line every minute: pending for up to ``workers.wait_s``, running for up to
    ``workers.task_timeout_s``. Past either, the task is cancelled and the stage fails naming the key."""
    import ray

    if not ray.is_initialized():
        return fn(*args)
    from .placement import plan_workers

    place = stage.placement or plan_workers(stage.resources(), ray.cluster_resources())
    task = ray.remote(_announced).options(num_gpus=place.num_gpus, num_cpus=place.num_cpus, max_retries=0,
                                          num_returns="streaming")
    say, workers = log(stage.name), stage.cfg.workers
    say.debug(f"{what}: one task of {place.asks()} (models on {place.device})")
    gen = task.remote(fn, *args)
    started = _await(gen, what, "waiting for " + place.asks(), workers.wait_s, "workers.wait_s", say)
    say.debug(f"{what}: started on node {started['node_id'][:12]} pid={started['pid']}")
    return _await(gen, what, "running", workers.task_timeout_s, "workers.task_timeout_s", say)


def _announced(fn: Callable, *args) -> Iterator[Any]:
    """The task's body: first where it runs (the driver's sign that it started), then ``fn(*args)``."""
    import os

    import ray

    yield {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
    yield fn(*args)


def _await(gen, what: str, doing: str, limit_s: float, key: str, say) -> Any:
    """The streamed task's next item, with a line every minute while it is ``doing``; past ``limit_s`` the task is
    cancelled and a TimeoutError names ``key``."""
    import ray

    t0 = time.monotonic()
    while True:
        left = limit_s - (time.monotonic() - t0)
        if left <= 0:
            ray.cancel(gen, force=True)
            raise TimeoutError(f"{key}: {what} still {doing} after {limit_s:g} s; the task was cancelled (allow "
                               f"longer with {key}, or look at what holds the cluster's resources)")
        if ray.wait([gen], timeout=min(60.0, left))[0]:
            return ray.get(next(gen))
        say.info(f"{what}: {doing} for {time.monotonic() - t0:.0f} s")


@contextmanager
def batched_engine(cfg) -> Iterator[Tuple[Any, Any]]:
    """(models, pipeline.decoding.batched.BatchedEngine) of the config, compiled as engine.compile says; torch on one
    thread meanwhile when the models are on the CPU."""
    import torch

    from pipeline.decoding.batched import BatchedEngine
    from pipeline.decoding.compiled import apply_compile
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models

    models = load_models(cfg.model)
    threads = torch.get_num_threads()
    if models.device.type == "cpu":
        torch.set_num_threads(1)
    try:
        apply_compile(models, cfg.engine.compile)
        engine = Engine(models.target, models.draft, models.stop_token_ids if cfg.decode.stop_on_eos else None)
        yield models, BatchedEngine(engine)
    finally:
        torch.set_num_threads(threads)


def where(device) -> Dict[str, Any]:
    """Where a task ran (its output's ``where``): the Ray node and GPU ids, or the process without Ray."""
    import ray

    here = {"device": str(device)}
    if ray.is_initialized():
        here.update(node_id=ray.get_runtime_context().get_node_id(), gpu_ids=[str(g) for g in ray.get_gpu_ids()])
    return here
