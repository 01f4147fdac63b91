"""A broken device on one of two label workers (issue #51, point 1), with real actors on the session's Ray
(tests/conftest.py::ray_session: 2 fake GPUs, so 2 label actors) and the real label stage on the bundled pair.

The first worker to set up is the broken one (a file claimed with O_EXCL names it); every batch it runs raises:
* "CUDA error: an illegal memory access" (a sticky error: the CUDA context is unusable after it): the worker is
  retired and its shard goes to the healthy one, which labels every prompt; none is a reject;
* a plain error on every batch, then on every other prompt retried alone (never FAILURES_IN_A_ROW in a row): the
  failures look like the prompts', so they become decode_error rejects; past label.max_reject_fraction the stage
  fails, naming the broken worker and its count, with no _SUCCESS, and a rerun without the fault labels every
  prompt (the shards with such rejects are redone).
Before #51 both ended with the broken worker's share silently rejected and a rerun that retried none of it.
"""

import os
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray.cloudpickle

from conftest import FAST
from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.executor.ray.executor import execute
from pipeline.io.shards import is_complete, list_shards
from pipeline.runtime.config import load_config
from stages.label import LabelStage
from stages.prepare import PrepareStage

pytestmark = pytest.mark.integration

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors unpickle BrokenOnOne from here

STICKY = "CUDA error: an illegal memory access was encountered"


class BrokenOnOne(LabelStage):
    """The label stage, broken on the first worker to set up: ``fault`` "sticky" raises STICKY on every batch;
    "every_other" raises on every batch and on every other prompt retried alone."""

    claim, fault = "", "sticky"

    def setup(self, worker):
        super().setup(worker)
        self.calls = 0
        try:
            os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            self.broken = False
        else:
            self.broken = True
            Path(self.claim).write_text(worker.identity)

    def label_batch(self, ids):
        if self.broken:
            self.calls += 1
            if self.fault == "sticky":
                raise RuntimeError(STICKY)
            if len(ids) > 1 or self.calls % 2:
                raise RuntimeError("a flaky kernel")
        return super().label_batch(ids)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """16 prompts in 4 shards of 4."""
    out = tmp_path_factory.mktemp("broken-device")
    run_stage(PrepareStage(config(out)), LocalExecutor())
    return out / "prompts"


def config(out, *extra):
    return load_config([f"output_dir={out}", *FAST, "prepare.shard_size=4", "label.num_workers=2", *extra])


def broken(prompts, tmp_path, fault):
    shutil.copytree(prompts, tmp_path / "prompts")
    stage = BrokenOnOne(config(tmp_path))
    stage.claim, stage.fault = str(tmp_path / "broken-worker"), fault
    return stage


def workers_of(labels):
    return {w for p in list_shards(labels) for w in pq.read_table(p, columns=["worker"])["worker"].to_pylist()}


def test_a_sticky_device_error_retires_the_worker_and_the_healthy_one_labels_every_prompt(prompts, tmp_path,
                                                                                          ray_session, caplog):
    stage = broken(prompts, tmp_path, "sticky")
    caplog.set_level("WARNING", logger="blockpilot")
    summary = execute(stage)
    bad = (tmp_path / "broken-worker").read_text()
    assert summary["rows"] == 16 and summary["rejects"] == 0, summary
    assert bad not in workers_of(tmp_path / "labels") and len(workers_of(tmp_path / "labels")) == 1
    retired = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    assert len(retired) == 1 and retired[0].startswith(f"worker {bad} retired: ") and STICKY in retired[0], retired
    assert is_complete(tmp_path / "labels")


def test_a_worker_whose_prompts_keep_failing_fails_the_stage_by_name_and_a_rerun_labels_them(prompts, tmp_path,
                                                                                             ray_session):
    stage = broken(prompts, tmp_path, "every_other")
    with pytest.raises(RuntimeError) as failed:
        execute(stage)
    bad = (tmp_path / "broken-worker").read_text()
    message = str(failed.value)
    assert "prompts failed to decode" in message and "label.max_reject_fraction = 1.0%" in message, message
    assert f"by worker: {bad}: " in message and "a flaky kernel" in message, message
    labels = tmp_path / "labels"
    assert not is_complete(labels) and len(list_shards(labels)) == 4  # the shards stay; no _SUCCESS over them
    rejected = sorted(p.name for p in (labels / "_rejects").glob("part-*.jsonl") if p.read_text().strip())
    assert rejected, "the broken worker's failed prompts are in its shards' reject files"

    rerun = execute(LabelStage(config(tmp_path)))  # the fault gone: the shards with decode_error rejects are redone
    assert rerun["rows"] == 16 and rerun["rejects"] == 0, rerun
    assert is_complete(labels) and not any(p.read_text().strip() for p in (labels / "_rejects").glob("*.jsonl"))
