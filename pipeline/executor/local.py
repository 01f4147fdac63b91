"""Running shard tasks: one task wherever it runs (:func:`run_task`), and the in-process executor.

An executor takes a stage and its to-do tasks, calls ``done`` once per task, and returns an :class:`Execution`; the
Ray actor pool in ``pipeline/executor/ray/pool.py`` is the other one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from pipeline.executor.failures import RETRIED_REASONS, DeviceFailure
from pipeline.executor.stage import Rejects, ShardStage, ShardTask, Worker
from pipeline.io.shards import encode_metadata, write_jsonl_atomic, write_parquet_atomic
from pipeline.runtime.log import get as log

Done = Callable[[ShardTask, Optional[Dict[str, Any]], Optional[str]], None]


@dataclass
class Execution:
    workers: List[Dict[str, Any]]
    failures: List[str]  # "part-NNNNN.parquet: why"
    # what faults cost the run (the Ray pool's: workers restarted, retired, left out, shards taken back, prompts
    # refused; pipeline.executor.ray.pool_run.PoolRun.faults): summary.json's "faults", the closing line's
    faults: Dict[str, Any] = field(default_factory=dict)


def run_task(stage: ShardStage, task: ShardTask, worker: Worker) -> Dict[str, Any]:
    """Process one shard and write it: its rejects first, then the shard, each atomically, so the shard's presence
    is what marks the work done and a reader never sees half of it."""
    t0 = time.perf_counter()
    rejects = Rejects(worker.identity, task.refused, task.alone)
    table = stage.process_shard(task.input, rejects)
    expected = (task.rows - len(rejects)) * stage.rows_per_input
    if table.num_rows != expected:  # a stage bug would otherwise pass the done check on a rerun
        raise RuntimeError(f"{stage.name} {task.name}: {table.num_rows} rows for {task.rows} inputs and "
                           f"{len(rejects)} rejects (expected {expected})")
    meta = {**(table.schema.metadata or {}), **encode_metadata(task.metadata)}
    write_jsonl_atomic(rejects, task.rejects)
    write_parquet_atomic(table.replace_schema_metadata(meta), task.output, checksum=task.checksum or None,
                         stats=stage.shard_stats(table), **stage.parquet_options(table))
    return {"shard": task.name, "rows": table.num_rows, "rejects": len(rejects), "worker": worker.identity,
            "seconds": round(time.perf_counter() - t0, 3),
            # what the pool weighs a worker by while the stage runs (pipeline.executor.failures.far_above)
            "retried_rejects": sum(r.get("reason") in RETRIED_REASONS for r in rejects)}


class LocalExecutor:
    """Every task in this process, in order; a failing task is retried ``retries`` times. A stage whose shards wait on
    the store, not the CPU, says how many to run at once (``io_threads``: prepare's, each a write of a few hundred KB
    at 30 ms a request to object storage); ``done`` still comes once per task, in task order, from the calling
    thread, and the shards and the execution are those of one task after another."""

    def __init__(self, retries: int = 0, identity: str = "driver"):
        self.retries, self.identity = retries, identity
        self.broken: Optional[str] = None  # a DeviceFailure: the one device this process has, so nothing more runs

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        worker = Worker(self.identity)
        stage.setup(worker)
        self.broken = None
        attempts = partial(self._attempts, stage, worker=worker)
        threads = getattr(stage, "io_threads", 1)
        if threads > 1 and len(tasks) > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix=stage.name) as pool:
                return self._report(tasks, pool.map(attempts, tasks), done)
        return self._report(tasks, map(attempts, tasks), done)

    @staticmethod
    def _report(tasks: List[ShardTask], outcomes: Iterator[Tuple[Optional[Dict[str, Any]], Optional[str]]],
                done: Done) -> Execution:
        failures = []
        for task, (result, error) in zip(tasks, outcomes):
            done(task, result, error)
            if error is not None:
                failures.append(f"{task.name}: {error}")
        return Execution([], failures)

    def _attempts(self, stage: ShardStage, task: ShardTask, worker: Worker) -> Tuple[Optional[Dict[str, Any]],
                                                                                       Optional[str]]:
        """Runs ``task`` up to 1 + retries times: (its result, None) once done, else (None, the last error). A
        DeviceFailure is not retried: there is no other worker here to take the shard."""
        if self.broken:
            return None, f"not run: {self.broken}"
        for attempt in range(self.retries + 1):
            try:
                return run_task(stage, task, worker), None
            except DeviceFailure as err:
                self.broken = error = f"{type(err).__name__}: {err}"
                log(stage.name).warning(f"{task.name} failed: {error}; no other worker here")
                return None, error
            except Exception as err:  # noqa: BLE001 - one shard's failure must not stop the others
                error = f"{type(err).__name__}: {err}"
                log(stage.name).warning(f"{task.name} attempt {attempt + 1}/{self.retries + 1} failed: {error}")
        return None, error
