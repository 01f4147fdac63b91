"""A decoding stage's one-off task (pipeline.executor.ray.device_task.on_a_worker: evaluate's pass at load, tune's
load check) on the session's Ray: its result comes back; waiting for resources is told apart from running, each
with its own deadline (workers.wait_s, workers.task_timeout_s), past which the task is cancelled and the error names
the key."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

from pipeline.executor.ray.device_task import on_a_worker
from pipeline.executor.ray.placement import Placement


def stage(gpus: float = 0, wait_s: float = 60.0, task_timeout_s: float = 60.0):
    """What on_a_worker reads of a decoding stage: its name, placement and worker settings."""
    return SimpleNamespace(name="evaluate", placement=Placement(1, gpus, 0.5, "cpu"),
                           cfg=SimpleNamespace(workers=SimpleNamespace(wait_s=wait_s, task_timeout_s=task_timeout_s)))


def where_and(x):
    return os.getpid(), x * 2


def sleep_then(seconds, path):
    open(path, "w").close()  # it started
    time.sleep(seconds)
    open(path, "a").write("finished")
    return seconds


# The session's workers cannot import this test module: its functions travel by value (Ray's cloudpickle).
from ray import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_the_task_runs_in_a_worker_process_and_returns(ray_session):
    pid, got = on_a_worker(stage(), where_and, 21, what="at load")
    assert got == 42 and pid != os.getpid()


def test_a_task_that_cannot_be_placed_fails_at_wait_s_naming_it(ray_session, tmp_path):
    marker = tmp_path / "started"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:  # 3 GPUs: the session advertises 2, so it stays pending
        on_a_worker(stage(gpus=3, wait_s=2.0), sleep_then, 0, str(marker), what="at load")
    assert str(err.value).startswith("workers.wait_s: at load still waiting for GPU 3 + CPU 0.5 after 2 s")
    assert time.monotonic() - t0 < 30 and not marker.exists()  # never ran


def test_a_task_that_runs_past_task_timeout_s_is_cancelled_naming_it(ray_session, tmp_path):
    marker = tmp_path / "started"
    with pytest.raises(TimeoutError) as err:
        on_a_worker(stage(task_timeout_s=1.0), sleep_then, 3, str(marker), what="load check")
    assert str(err.value).startswith("workers.task_timeout_s: load check still running after 1 s")
    assert marker.exists()  # it had started: running, not pending
    time.sleep(4.0)  # past its 3 s of sleep: had it not been cancelled, it would have written "finished"
    assert marker.read_text() == ""
