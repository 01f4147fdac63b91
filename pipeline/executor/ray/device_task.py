"""A decoding stage's one-off wall-clock work (evaluate's pass at load, tune's load check) where its models fit.

Ray tasks that each ask what one of the stage's workers asks (one GPU, or its CPUs), never the job's driver, which
may have no GPU at all (a RayJob head has none); in this process when Ray is not running (tests). On GPUs the work
is split into one part per worker (:func:`split`; evaluate's loads cut into chunks of prompts first, :func:`chunks`),
each on a GPU of its own; on CPUs it is one task, which decodes on one thread, as one decoding actor of one CPU
does: a wall-clock benchmark wants one quiet process.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Tuple

from pipeline.runtime.log import get as log


def on_a_worker(stage, fn: Callable, *args, what: str) -> Any:
    """``fn(*args)`` in a Ray task of one worker's resources, or here without Ray: :func:`on_workers` with one
    part."""
    return on_workers(stage, fn, [args], what=what)[0]


def on_workers(stage, fn: Callable, parts: List[tuple], what: str) -> List[Any]:
    """``[fn(*args) for args in parts]``, each part a Ray task of one worker's resources, all submitted at once (on
    GPUs, each its own: split the work so that every GPU the stage has takes a part); here, in turn, without Ray.

    Each task says when it starts (its first streamed item: node and pid), so that waiting for resources (pending:
    GPUs held by the stage's own actors as they shut down, by a sibling part, or by another job) is told apart from
    running, each with its own clock and a line every minute: pending for up to ``workers.wait_s`` (counted only
    while no sibling part runs: one may be waiting for a sibling's GPU), running for up to ``workers.task_timeout_s``.
    Past either, every part is cancelled and the stage fails naming the key."""
    import ray

    if not ray.is_initialized():
        return [fn(*args) for args in parts]
    from .placement import plan_workers

    place = stage.placement or plan_workers(stage.resources(), ray.cluster_resources())
    task = ray.remote(_announced).options(num_gpus=place.num_gpus, num_cpus=place.num_cpus, max_retries=0,
                                          num_returns="streaming")
    say, workers = log(stage.name), stage.cfg.workers
    each = f"{len(parts)} tasks" if len(parts) > 1 else "one task"
    say.debug(f"{what}: {each} of {place.asks()} (models on {place.device})")
    gens = [task.remote(fn, *args) for args in parts]
    results: Dict[int, Any] = {}
    since = {i: time.monotonic() for i in range(len(gens))}  # pending since, then running since
    started: Dict[int, dict] = {}
    said = time.monotonic()
    try:
        while len(results) < len(gens):
            waiting = [g for i, g in enumerate(gens) if i not in results]
            ready, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            now = time.monotonic()
            for g in ready:
                i = gens.index(g)
                item = ray.get(next(g))
                if i in started:
                    results[i] = item
                else:
                    started[i], since[i] = item, now
                    say.debug(f"{what}: part {i + 1}/{len(gens)} started on node {item['node_id'][:12]} "
                              f"pid={item['pid']}")
            if any(i not in results for i in started):  # a part waiting for a sibling's GPU is not stuck
                for i in range(len(gens)):
                    if i not in started:
                        since[i] = now
            for i in (j for j in since if j not in results):
                running = i in started
                limit, key = (workers.task_timeout_s, "workers.task_timeout_s") if running else \
                    (workers.wait_s, "workers.wait_s")
                if now - since[i] > limit:
                    doing = "running" if running else "waiting for " + place.asks()
                    part = f" (part {i + 1}/{len(gens)})" if len(gens) > 1 else ""
                    raise TimeoutError(f"{key}: {what}{part} still {doing} after {limit:g} s; cancelled (allow "
                                       f"longer with {key}, or look at what holds the cluster's resources)")
            if now - said >= 60.0:
                said = now
                say.info(f"{what}: {_states(started, results, len(gens), since, now, place.asks())}")
    except BaseException:
        for i, g in enumerate(gens):
            if i not in results:
                ray.cancel(g, force=True)
        raise
    return [results[i] for i in range(len(gens))]


def _states(started, results, n: int, since, now: float, asks: str) -> str:
    """'running for 61 s' (one part), or '1 done, 2 running (61 s), 1 waiting for GPU 1 + CPU 0.5 (61 s)'."""
    running = [now - since[i] for i in started if i not in results]
    pending = [now - since[i] for i in range(n) if i not in started]
    if n == 1:
        return f"running for {running[0]:.0f} s" if running else f"waiting for {asks} for {pending[0]:.0f} s"
    parts = [f"{len(results)} done"] if results else []
    if running:
        parts.append(f"{len(running)} running ({max(running):.0f} s)")
    if pending:
        parts.append(f"{len(pending)} waiting for {asks} ({max(pending):.0f} s)")
    return ", ".join(parts)


def parts_at_once(stage) -> int:
    """How many parts the work runs in: one per worker the stage has on GPUs, each GPU its own part; one where the
    models run on CPUs (logical GPUs included), as parts at once would share the cores that a wall-clock
    measurement times."""
    place = stage.placement
    return place.num_workers if place is not None and place.on_gpu and place.device == "cuda" else 1


def split(items: List[Any], stage) -> List[List[Any]]:
    """``items`` (loads, or :func:`chunks`) dealt round-robin into :func:`parts_at_once` parts."""
    n = min(len(items), parts_at_once(stage))
    return [items[i::n] for i in range(n)] if items else [items]


def chunks(loads: List[int], prompts: int, stage) -> List[Tuple[int, int, int, int]]:
    """(c, k, start, stop): chunk k of load c, its prompts [start, stop). Each load's prompts cut into contiguous
    chunks of whole waves (c prompts each, the load's last wave possibly short), so that every GPU worker has a
    part: at 64 GPUs one load alone would otherwise keep one GPU busy past workers.task_timeout_s while 63 idle.
    The parts go to the loads one at a time, each to the load with the most waves per part so far (a wave at any c
    takes about the same steps; at least one wave a part, at least one part a load); on CPUs, one chunk a load."""
    waves = {c: -(-prompts // c) for c in loads}
    share = {c: 1 for c in loads}
    for _ in range(parts_at_once(stage) - len(loads)):
        room = [c for c in loads if share[c] < waves[c]]
        if not room:
            break
        share[max(room, key=lambda c: waves[c] / share[c])] += 1
    out = []
    for c in loads:
        cuts = [waves[c] * i // share[c] for i in range(share[c] + 1)]
        out += [(c, k, a * c, min(b * c, prompts)) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return out


def by_load(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The parts' ``{"c": ...}`` results (:func:`split`'s loads) as one, in order of c."""
    return dict(sorted(((c, got) for part in parts for c, got in part.items()), key=lambda x: int(x[0])))


def where_of(parts: List[Any]) -> Any:
    """Where the work ran: the one part's ``where``, or every part's."""
    return parts if len(parts) > 1 else parts[0]


def _announced(fn: Callable, *args) -> Iterator[Any]:
    """The task's body: first where it runs (the driver's sign that it started), then ``fn(*args)``."""
    import os

    import ray

    yield {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}
    yield fn(*args)


@contextmanager
def batched_engine(cfg, model) -> Iterator[Tuple[Any, Any]]:
    """(models, pipeline.decoding.batched.BatchedEngine) of ``model`` (the stage's ``worker_model()``: the labels'
    commits and the one the driver resolved, never the hub's "main" again on a task's own), compiled as
    engine.compile says; torch on one thread meanwhile when the models are on the CPU."""
    import torch

    from pipeline.decoding.batched import BatchedEngine
    from pipeline.decoding.compiled import apply_compile
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models

    models = load_models(model)
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
