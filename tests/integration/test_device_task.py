"""A decoding stage's one-off tasks (pipeline.executor.ray.device_task.on_workers: evaluate's pass at load, tune's
load check) on the session's Ray (2 logical GPUs): results come back in order, parts on GPUs run at once; waiting for
resources is told apart from running, each with its own deadline (workers.wait_s, workers.task_timeout_s), past
which the task is cancelled and the error names the key."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

from pipeline.executor.ray.device_task import by_load, on_a_worker, on_workers, split, where_of
from pipeline.executor.ray.placement import Placement


def stage(gpus: float = 0, wait_s: float = 60.0, task_timeout_s: float = 60.0, workers: int = 1, device="cpu"):
    """What on_workers reads of a decoding stage: its name, placement and worker settings (the functions here
    ignore the device: the session's GPUs are logical)."""
    return SimpleNamespace(name="evaluate", placement=Placement(workers, gpus, 0.5, device),
                           cfg=SimpleNamespace(workers=SimpleNamespace(wait_s=wait_s, task_timeout_s=task_timeout_s)))


def where_and(x):
    return os.getpid(), x * 2


def interval_after(seconds, x):
    """(start, end, x): when the part ran, by the machine's clock (time.time(): one clock for every process on it),
    around ``seconds`` of sleep."""
    start = time.time()
    time.sleep(seconds)
    return start, time.time(), x


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


def test_loads_are_dealt_one_part_per_gpu_worker_and_one_part_on_cpus():
    assert split([4, 16, 32], stage(gpus=1, workers=2, device="cuda")) == [[4, 32], [16]]
    assert split([4, 16], stage(gpus=1, workers=8, device="cuda")) == [[4], [16]]
    assert split([4, 16, 32], stage(gpus=0, workers=2)) == [[4, 16, 32]]  # CPUs: one quiet process
    assert split([4, 16, 32], stage(gpus=1, workers=2)) == [[4, 16, 32]]  # logical GPUs, the models on CPUs
    assert split([], stage(gpus=1, workers=2, device="cuda")) == [[]]
    # the parts' results back as one, in order of c (string keys, as the JSON files hold them)
    assert list(by_load([{"4": "a", "32": "c"}, {"16": "b"}]).items()) == [("4", "a"), ("16", "b"), ("32", "c")]
    assert where_of(["w"]) == "w" and where_of(["w1", "w2"]) == ["w1", "w2"]


def test_parts_on_gpus_run_at_once_and_a_part_waiting_for_a_siblings_gpu_is_not_timed_out(ray_session):
    """"At once" read from when each part ran, not where: two distinct worker processes held for parts run one after
    another too, whenever Ray handed the second part to another warm worker."""
    # 3 parts of 1 GPU on the session's 2: the third waits ~6 s for a sibling's GPU, past wait_s = 4 s, and runs.
    # Two worker processes started first (a generous wait_s): the first two parts must not wait for fresh ones to
    # start, which on a loaded 2-core machine can take most of the 4 s (as test_pool_failures' probe reads found).
    on_workers(stage(gpus=1, wait_s=120.0, workers=2), interval_after, [(0.0, "w1"), (0.0, "w2")], what="warm-up")
    got = on_workers(stage(gpus=1, wait_s=4.0, workers=3), interval_after, [(6.0, "a"), (6.0, "b"), (6.0, "c")],
                     what="at load")
    assert [x for _, _, x in got] == ["a", "b", "c"]  # in the parts' order
    (a_start, a_end, _), (b_start, b_end, _), (c_start, _, _) = got
    assert max(a_start, b_start) < min(a_end, b_end), got  # the first two at once: their runs overlap
    assert c_start >= min(a_end, b_end), got  # the third on a GPU a sibling gave back (2 GPUs), not a third at once
