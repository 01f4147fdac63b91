"""What a failure while decoding means (pipeline/executor/failures.py), and what the driver and the in-process
executor do with it: a prompt's own failure is a reject that a rerun retries; a device's (a sticky CUDA error, or
FAILURES_IN_A_ROW prompts in a row) is no reject, it fails the shard; decoding rejects past the stage's
max_reject_fraction fail the stage, naming each worker's count. The Ray pool's side (the worker retired, its shard to
the other) is tests/integration/test_broken_device.py's."""

from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.executor.driver import run_stage
from pipeline.executor.failures import FAILURES_IN_A_ROW, DeviceFailure, PromptFailures, sticky_device_error
from pipeline.executor.folder import mark_complete
from pipeline.executor.local import LocalExecutor
from pipeline.executor.stage import Plan, Resources, ShardStage, tasks_from_shards
from pipeline.io.shards import is_complete, list_shards, shard_name, write_parquet_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config

SCHEMA = pa.schema([("prompt_id", pa.string()), ("x", pa.int64())])


def test_a_sticky_device_error_is_the_devices_at_once():
    f = PromptFailures("node/gpu3")
    assert sticky_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(DeviceFailure, match=r"worker node/gpu3: the device failed on prompt p-7 \(RuntimeError: "
                                            r"CUDA error") as failure:
        f.failed(RuntimeError("CUDA error: an illegal memory access was encountered"), "p-7")
    assert failure.value.prompts == ("p-7",)  # charged to the prompt in flight (issue #67)
    # and it survives the trip from a Ray actor to the driver (pickled), prompts included
    import pickle

    back = pickle.loads(pickle.dumps(failure.value))
    assert type(back) is DeviceFailure and back.prompts == ("p-7",) and str(back) == str(failure.value)
    # an out-of-memory says "CUDA" too, and is the prompt's (its size), not the device's: no raise, not counted
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not sticky_device_error(oom)
    assert [f.failed(oom) for _ in range(2 * FAILURES_IN_A_ROW)] == ["out_of_memory"] * (2 * FAILURES_IN_A_ROW)


def test_prompts_failing_in_a_row_are_the_devices_and_a_success_resets_the_count():
    f = PromptFailures("w")
    for _ in range(3):
        assert [f.failed(ValueError("bad")) for _ in range(FAILURES_IN_A_ROW - 1)] == \
            ["decode_error"] * (FAILURES_IN_A_ROW - 1)
        f.succeeded()
    for _ in range(FAILURES_IN_A_ROW - 1):
        f.failed(ValueError("bad"))
    with pytest.raises(DeviceFailure, match=f"{FAILURES_IN_A_ROW} prompts in a row failed"):
        f.failed(ValueError("bad"))


class Doubling(ShardStage):
    """Doubles ``x``; a row whose x is in ``fail`` raises (a decode_error reject), and ``device`` raises
    DeviceFailure out of the shard that holds that x."""

    name = "doubling"

    def __init__(self, cfg, inputs, folder, fail=(), device=None, limit=None):
        super().__init__(cfg, folder)
        self.inputs, self.fail, self.device, self.limit = inputs, set(fail), device, limit

    def fingerprint(self):
        return {"double": True}

    def plan(self):
        return Plan(tasks_from_shards(self.inputs))

    def resources(self):
        return Resources()

    def max_reject_fraction(self):
        return self.limit

    def process_shard(self, input, rejects):
        rows, kept = read_table(input).to_pylist(), []
        for r in rows:
            if r["x"] == self.device:
                raise DeviceFailure("worker driver: the device failed (CUDA error)")
            if r["x"] in self.fail:
                rejects.add(r, "decode_error", "ValueError: bad")
                continue
            kept.append({"prompt_id": r["prompt_id"], "x": 2 * r["x"]})
        return pa.Table.from_pylist(kept, schema=SCHEMA)


@pytest.fixture
def inputs(tmp_path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(4):
        write_parquet_atomic(pa.Table.from_pylist([{"prompt_id": f"p{i}-{j}", "x": 10 * i + j} for j in range(5)],
                                                  schema=SCHEMA), folder / shard_name(i))
    mark_complete(folder)
    return folder


def test_decoding_rejects_past_the_limit_fail_the_stage_naming_the_worker_and_a_rerun_redoes_their_shards(
        inputs, tmp_path):
    cfg = load_config(["progress=false"])
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match=r"doubling: 2 of 20 prompts failed to decode \(10.0%, over "
                                           r"doubling.max_reject_fraction = 5.0%\) by worker: driver: 2"):
        run_stage(Doubling(cfg, inputs, out, fail={1, 32}, limit=0.05), LocalExecutor())
    assert not is_complete(out) and len(list_shards(out)) == 4
    # within the limit the same rejects pass, and a rerun without the failures redoes exactly their two shards
    assert run_stage(Doubling(cfg, inputs, tmp_path / "ok", fail={1, 32}, limit=0.10), LocalExecutor())["rejects"] == 2
    before = {p.name: p.stat().st_mtime_ns for p in list_shards(out)}
    again = run_stage(Doubling(cfg, inputs, out, limit=0.05), LocalExecutor())
    assert again["rows"] == 20 and again["rejects"] == 0 and is_complete(out)
    redone = sorted(p.name for p in list_shards(out) if p.stat().st_mtime_ns != before[p.name])
    assert redone == [shard_name(0), shard_name(3)]


def test_a_device_failure_in_the_drivers_process_fails_its_shard_and_every_later_one(inputs, tmp_path):
    cfg = load_config(["progress=false"])
    with pytest.raises(RuntimeError) as failed:
        run_stage(Doubling(cfg, inputs, tmp_path / "out", device=12), LocalExecutor(retries=2))  # x = 12: shard 1
    message = str(failed.value)
    assert "3 shard(s) failed" in message and "DeviceFailure: worker driver: the device failed" in message
    assert f"{shard_name(3)}: not run: DeviceFailure" in message, message
    assert [p.name for p in list_shards(tmp_path / "out")] == [shard_name(0)]  # shard 0 was done before it


def test_a_cublas_or_cudnn_allocation_failure_is_an_out_of_memory_not_a_sticky_device_error():
    """Issue #67: cuBLAS says its workspace did not fit as a "CUDA error", which retired the worker as broken."""
    f = PromptFailures("w")
    for err in (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
                RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")):
        assert not sticky_device_error(err)
        assert [f.failed(err) for _ in range(FAILURES_IN_A_ROW)] == ["out_of_memory"] * FAILURES_IN_A_ROW


def test_failures_in_a_row_start_again_with_each_shard():
    """Issue #67: the last prompts of one shard and the first of the next were counted as one run, retiring a worker
    whose failures were apart; a shard of failures in a row still retires it. Through DecodingStage.each_prompt,
    which every decoding stage's shard goes through (fails when it does not start the count again)."""
    from types import SimpleNamespace

    from pipeline.executor.stage import Rejects
    from stages.decoding import DecodingStage

    stage = DecodingStage.__new__(DecodingStage)  # each_prompt needs only the config's progress flag
    stage.cfg = SimpleNamespace(progress=False)
    bad = FAILURES_IN_A_ROW - 1

    def measure(rec):
        if rec["prompt_id"].startswith("bad"):
            raise ValueError("this prompt's own")
        return 1

    def shard(ids):
        rejects = Rejects("w")
        got = list(stage.each_prompt("s", pa.table({"prompt_id": ids}), rejects, measure))
        return len(got), [r["reason"] for r in rejects]

    assert shard(["ok"] + [f"bad{i}" for i in range(bad)]) == (1, ["decode_error"] * bad)
    assert shard([f"bad{i}" for i in range(bad)] + ["ok"]) == (1, ["decode_error"] * bad)
    with pytest.raises(DeviceFailure, match="in a row"):
        shard([f"bad{i}" for i in range(FAILURES_IN_A_ROW)])


def test_far_above_takes_out_a_worker_only_on_enough_failures_over_the_limit_and_far_above_the_others():
    """Issue #67: a worker whose failures run far above the others' is taken out while the stage runs."""
    from pipeline.executor.failures import FAR_ABOVE, MIN_FAILURES, far_above

    # every prompt of its first two shards out of memory, the others clean: out
    assert far_above(MIN_FAILURES, MIN_FAILURES, 0, 64, MIN_FAILURES, 0.01)
    # one short of the count: not yet, whatever the rate
    assert not far_above(MIN_FAILURES - 1, MIN_FAILURES - 1, 0, 64, MIN_FAILURES, 0.01)
    # bad prompts fall alike on every worker: the same rate as the others' is not far above it
    assert not far_above(10, 100, 100, 1000, MIN_FAILURES, 0.01)
    # FAR_ABOVE times the others' rate is out, just under it is not
    assert far_above(40, 100, 10, 1000, MIN_FAILURES, 0.01) == (0.4 >= FAR_ABOVE * 0.01)
    assert not far_above(39, 1000, 10, 1000, MIN_FAILURES, 0.01)
    # at or under the stage's max_reject_fraction: never out, however far above the others
    assert not far_above(10, 1000, 0, 1000, MIN_FAILURES, 0.01)
    assert far_above(11, 1000, 0, 1000, MIN_FAILURES, 0.01)
    # no one else has tried anything yet: the count and the limit decide
    assert far_above(MIN_FAILURES, MIN_FAILURES, 0, 0, MIN_FAILURES, 0.01)


def test_the_preflight_goes_on_without_failing_workers_only_when_enough_pass():
    """Issue #67: workers.min_fraction of the expected workers must pass; rounded up, and at least one."""
    from pipeline.executor.ray.preflight import enough_pass

    assert enough_pass(63, 64, 0.9) and enough_pass(58, 64, 0.9) and not enough_pass(57, 64, 0.9)
    assert not enough_pass(1, 2, 0.9) and enough_pass(2, 2, 0.9)  # small pools: every worker, as before
    assert not enough_pass(8, 9, 0.9) and enough_pass(9, 10, 0.9)
    assert not enough_pass(0, 1, 0.0001) and enough_pass(1, 2, 0.5)
