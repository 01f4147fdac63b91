"""The preflight proves output_dir is storage the driver and every worker share (issue #51, point 2), with real
actors on the session's Ray (2 fake GPUs, so 2 label actors). A fake of a node-local disk: each worker writes its
probe and reads it back, then the probe is gone for everyone else (the stage, unpickled in the actor, wraps the
worker's output_dir check to delete it), as a disk mounted on the workers' node and not on the head would behave.
The preflight refuses before any work, naming the driver's side; before #51 only the workers read each other's
probes, and a two-worker cluster on one node-local disk passed."""

import sys

import pytest
import ray.cloudpickle

from conftest import FAST
from pipeline.executor.ray.executor import execute
from pipeline.executor.ray.preflight import PreflightRefused
from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.runtime.config import load_config
from stages.label import LabelStage
from stages.prepare import PrepareStage

pytestmark = pytest.mark.integration

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NodeLocalOutput(LabelStage):
    def __setstate__(self, state):  # runs where the stage is unpickled: in the actor
        self.__dict__.update(state)
        import pipeline.executor.preflight as checks
        from pipeline.io.storage import location

        written = checks._output_dir

        def node_local(spec, row):
            problems = written(spec, row)  # written and read back on this node
            if row.get("probe"):
                location(row["probe"]).unlink()  # and not there for any other node
            return problems

        checks._output_dir = node_local


def test_a_worker_whose_output_the_driver_cannot_read_is_refused_before_any_work(tmp_path, ray_session):
    cfg = load_config([f"output_dir={tmp_path}", *FAST, "prepare.limit=4"])
    run_stage(PrepareStage(cfg), LocalExecutor())
    with pytest.raises(PreflightRefused) as refused:
        execute(NodeLocalOutput(cfg))
    problems = [(k, m) for _, k, m in refused.value.problems]
    assert any(k == "output_dir" and "the driver cannot read what this worker wrote" in m for k, m in problems), \
        problems
    assert not (tmp_path / "labels").exists() or not list((tmp_path / "labels").glob("part-*.parquet"))
