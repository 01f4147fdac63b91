"""The driver never publishes what it cannot see (issue #51, point 2): a worker that writes its shards where the
driver cannot read them (here: an executor that moves each finished shard to a folder of its own, as a disk mounted
on the workers' nodes and not on the head would hold it; a named fake of that disk) fails the stage naming the path,
with no _SUCCESS. Before, write_manifest skipped the shards it could not see and _SUCCESS went out over fewer rows."""

import shutil

import pyarrow as pa
import pytest

from pipeline.executor.driver import run_stage
from pipeline.executor.folder import mark_complete
from pipeline.executor.local import LocalExecutor
from pipeline.executor.stage import Plan, Resources, ShardStage, tasks_from_shards
from pipeline.io.shards import is_complete, shard_name, write_parquet_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config

SCHEMA = pa.schema([("prompt_id", pa.string()), ("x", pa.int64())])


class Copy(ShardStage):
    name = "copy"

    def __init__(self, cfg, inputs, folder):
        super().__init__(cfg, folder)
        self.inputs = inputs

    def fingerprint(self):
        return {"copy": True}

    def plan(self):
        return Plan(tasks_from_shards(self.inputs))

    def resources(self):
        return Resources()

    def process_shard(self, input, rejects):
        return read_table(input)


class NodeLocalDisk(LocalExecutor):
    """Runs each task, then moves its shard to ``disk``: what the driver sees of a worker's node-local disk."""

    def __init__(self, disk, moved=None):
        super().__init__()
        self.disk, self.moved = disk, moved

    def run(self, stage, tasks, done):
        def moved(task, result, error):
            if result is not None and (self.moved is None or task.name in self.moved):
                self.disk.mkdir(exist_ok=True)
                shutil.move(task.output, self.disk / task.name)
            done(task, result, error)

        return super().run(stage, tasks, moved)


def test_shards_the_driver_cannot_see_fail_the_stage_naming_the_path(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(3):
        write_parquet_atomic(pa.Table.from_pylist([{"prompt_id": f"p{i}", "x": i}], schema=SCHEMA),
                             inputs / shard_name(i))
    mark_complete(inputs)
    cfg, out = load_config(["progress=false"]), tmp_path / "out"
    with pytest.raises(RuntimeError) as refused:
        run_stage(Copy(cfg, inputs, out), NodeLocalDisk(tmp_path / "node-disk", moved={shard_name(1)}))
    message = str(refused.value)
    assert message.startswith("copy: 1 of 3 shard(s) were reported written by the workers but the driver cannot "
                              f"see them, e.g. {out / shard_name(1)}: output_dir must be storage"), message
    assert not is_complete(out)
    # the same run where the driver sees every shard publishes
    assert run_stage(Copy(cfg, inputs, out), LocalExecutor())["rows"] == 3 and is_complete(out)
