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
    """``fn(*args)`` in a Ray task of one worker's resources (a progress line every minute), or here without Ray."""
    import ray

    if not ray.is_initialized():
        return fn(*args)
    from .placement import plan_workers

    place = stage.placement or plan_workers(stage.resources(), ray.cluster_resources())
    task = ray.remote(fn).options(num_gpus=place.num_gpus, num_cpus=place.num_cpus, max_retries=0)
    say = log(stage.name)
    say.debug(f"{what}: one task of {place.asks()} (models on {place.device})")  # long ones say so every minute
    ref, t0 = task.remote(*args), time.monotonic()
    while not ray.wait([ref], timeout=60.0)[0]:
        say.info(f"{what}: running for {time.monotonic() - t0:.0f} s")
    return ray.get(ref)


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
