"""One pool actor (:class:`StageActor`): the stage shipped once, its node checked, its models loaded once, then
shard after shard; and the one line the driver prints per started worker."""

from __future__ import annotations

import os
from typing import Any, Dict, List

from pipeline.executor.local import run_task
from pipeline.executor.stage import ShardStage, ShardTask, Worker

from .runtime import worker_identity


class StageActor:
    """One pool actor: the stage object shipped once; ``preflight`` checks its node, ``setup`` loads the models once
    (it never raises: a failure comes back as ``setup_error``, so that the pool can try another node), then shard
    after shard. Ray rebuilds a restarted actor from ``__init__`` alone, so the pool sets it up again."""

    def __init__(self, stage: ShardStage, threads: int):
        self.stage = stage
        self.worker = Worker(worker_identity(), threads)
        self.ready = False

    def where(self) -> Dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"identity": self.worker.identity, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def preflight(self, spec) -> Dict[str, Any]:
        from pipeline.executor.preflight import check_worker

        return {**self.where(), **check_worker(spec, self.stage, self.worker.threads)}

    def readable(self, spec, probes: List[str]) -> List[str]:
        from pipeline.executor.preflight import unreadable

        return unreadable(probes)

    def setup(self) -> Dict[str, Any]:
        if not self.ready:
            try:
                self.stage.setup(self.worker)
            except Exception as err:  # noqa: BLE001 - the pool places another worker and says why
                first = (str(err).splitlines() or [""])[0]
                return {**self.where(), "setup_error": f"{type(err).__name__}: {first}"}
            self.ready = True
        return self.info()

    def info(self) -> Dict[str, Any]:
        return {**self.where(), **self.stage.worker_info()}

    def process(self, task: ShardTask) -> Dict[str, Any]:
        if not self.ready:  # the pool sets every actor up first; a shard never loads models by surprise
            raise RuntimeError(f"worker {self.worker.identity} is not set up")
        return run_task(self.stage, task, self.worker)


def bound_actor_class(stage: ShardStage) -> type:
    """A StageActor class that carries ``stage`` in its own definition rather than as a constructor argument.

    Ray exports an actor class once to its control store, where it stays for the job, and rebuilds a restarted
    actor from it; a constructor argument over 100 KB (a stage holding its driver-side results, as tune's does)
    lives in the object store instead, which Ray warns about on every such actor (core_worker.cc: "constructor
    arguments in the object store and max_restarts > 0", ray-project/ray#53727, since losing them makes the
    restart fail). Bound here, a restart always finds the stage and nothing is logged."""

    class BoundStageActor(StageActor):
        def __init__(self, threads: int):
            super().__init__(stage, threads)

    BoundStageActor.__name__ = BoundStageActor.__qualname__ = f"StageActor[{stage.name}]"
    return BoundStageActor


def worker_line(info: Dict[str, Any]) -> str:
    """One short line per started worker: its identity, pid and the stage's scalar facts (device, a cost summary).
    Structured values (a whole cost profile) stay in the stage's summary.json (``workers``): printed, they were a
    raw JSON dump 600 characters long."""
    shown = " ".join(f"{k}={v}" for k, v in info.items()
                     if k not in ("identity", "pid", "node_id", "node_ip", "gpu_ids") and isinstance(v, (str, int, float)))
    return f"worker {info['identity']} pid={info['pid']} {shown}".rstrip()


BESIDES = ("identity", "pid", "node_id", "node_ip", "gpu_ids", "device", "compiled")  # the preflight's line said these


def says_more(info: Dict[str, Any]) -> bool:
    """Whether a worker's line tells more than the preflight did (label's measured step costs do; a tune or
    evaluate worker's device and compile flag do not, and its line then goes to -v)."""
    return any(k not in BESIDES and isinstance(v, (str, int, float)) for k, v in info.items())
