"""Running shard tasks: one task wherever it runs (:func:`run_task`), and the in-process executor.

An executor takes a stage and its to-do tasks, calls ``done`` once per task, and returns an :class:`Execution`; the
Ray actor pool in ``pipeline/executor/ray/pool.py`` is the other one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from pipeline.executor.failures import DeviceFailure
from pipeline.executor.stage import Rejects, ShardStage, ShardTask, Worker
from pipeline.io.shards import encode_metadata, write_jsonl_atomic, write_parquet_atomic
from pipeline.runtime.log import get as log

Done = Callable[[ShardTask, Optional[Dict[str, Any]], Optional[str]], None]


@dataclass
class Execution:
    workers: List[Dict[str, Any]]
    failures: List[str]  # "part-NNNNN.parquet: why"


def run_task(stage: ShardStage, task: ShardTask, worker: Worker) -> Dict[str, Any]:
    """Process one shard and write it: its rejects first, then the shard, each atomically, so the shard's presence
    is what marks the work done and a reader never sees half of it."""
    t0 = time.perf_counter()
    rejects = Rejects(worker.identity)
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
            "seconds": round(time.perf_counter() - t0, 3)}


class LocalExecutor:
    """Every task in this process, one after another; a failing task is retried ``retries`` times."""

    def __init__(self, retries: int = 0, identity: str = "driver"):
        self.retries, self.identity = retries, identity

    def run(self, stage: ShardStage, tasks: List[ShardTask], done: Done) -> Execution:
        worker = Worker(self.identity)
        stage.setup(worker)
        failures, broken = [], None
        for task in tasks:
            error = f"not run: {broken}" if broken else self._attempts(stage, task, worker, done)
            if error is None:
                continue
            if error.startswith(DeviceFailure.__name__):  # the one device this process has: nothing more runs
                broken = error
            failures.append(f"{task.name}: {error}")
            done(task, None, error)
        return Execution([], failures)

    def _attempts(self, stage: ShardStage, task: ShardTask, worker: Worker, done: Done) -> Optional[str]:
        """Runs ``task`` up to 1 + retries times; None once done, else the last error. A DeviceFailure is not
        retried: there is no other worker here to take the shard."""
        for attempt in range(self.retries + 1):
            try:
                done(task, run_task(stage, task, worker), None)
                return None
            except DeviceFailure as err:
                error = f"{type(err).__name__}: {err}"
                log(stage.name).warning(f"{task.name} failed: {error}; no other worker here")
                return error
            except Exception as err:  # noqa: BLE001 - one shard's failure must not stop the others
                error = f"{type(err).__name__}: {err}"
                log(stage.name).warning(f"{task.name} attempt {attempt + 1}/{self.retries + 1} failed: {error}")
        return error
