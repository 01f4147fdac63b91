"""A broken device, or a prompt that breaks devices, on one of two label workers (issues #51 and #67), with real
actors on the session's Ray (tests/conftest.py::ray_session: 2 fake GPUs, so 2 label actors) and the real label stage
on the bundled pair.

The first worker to set up is the broken one (a file claimed with O_EXCL names it); every batch it runs raises:
* "CUDA error: an illegal memory access" (a sticky error: the CUDA context is unusable after it): the worker is
  restarted in a fresh process, which (a fresh context) labels again; with the device broken for good (every process
  of that worker) it fails again and is retired, its shard going to the healthy one, which labels every prompt;
* a plain error on every batch, then on every other prompt retried alone (never FAILURES_IN_A_ROW in a row): the
  failures look like the prompts', so they become decode_error rejects; past label.max_reject_fraction the stage
  fails, naming the broken worker and its count, with no _SUCCESS, and a rerun without the fault labels every
  prompt (the shards with such rejects are redone);
* an out-of-memory on every prompt (its memory held by another process): out_of_memory rejects, until its count
  runs far above the other worker's; it is taken out, and the shards it wrote with rejects are redone by the other.
And one prompt raises the sticky error on every worker: charged to the prompt on two workers, it is rejected as
breaks_device, its shard-mates are labelled, both workers restarted, none retired.
Before #51 both ended with the broken worker's share silently rejected and a rerun that retried none of it; before
#67 the poisonous prompt retired one worker after another.
"""

import os
import shutil
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import ray.cloudpickle

from conftest import FAST, fault_cost
from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.executor.ray.executor import execute
from pipeline.io.shards import is_complete, list_shards, read_jsonl
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config
from stages.label import LabelStage
from stages.prepare import PrepareStage

pytestmark = pytest.mark.integration

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors unpickle BrokenOnOne from here

STICKY = "CUDA error: an illegal memory access was encountered"


class BrokenOnOne(LabelStage):
    """The label stage, broken on the first worker to set up: ``fault`` "sticky" raises STICKY on every batch of
    that process; "sticky_for_good" on every batch of that worker, restarted or not; "every_other" raises on every
    batch and on every other prompt retried alone; "oom" an out-of-memory on every batch. "poison": no worker is
    broken, and every batch holding the prompt ``poison`` (its input ids) raises STICKY, on any worker."""

    claim, fault, poison = "", "sticky", ()

    def setup(self, worker):
        super().setup(worker)
        self.calls = 0
        actor = ray.get_runtime_context().get_actor_id()  # the same actor's restarted process has the same one
        try:
            os.close(os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            self.broken = self.fault == "sticky_for_good" and Path(self.claim + ".actor").read_text() == actor
        else:
            self.broken = self.fault != "poison"
            Path(self.claim + ".actor").write_text(actor)
            Path(self.claim).write_text(worker.identity)

    def label_batch(self, ids):
        if self.fault == "poison" and any(tuple(x) == self.poison for x in ids):
            raise RuntimeError(STICKY)
        raised = Path(self.claim + ".raised")
        if self.fault == "sticky_for_good" and not self.broken:
            # the healthy worker waits until the broken one has failed in its fresh process too (else it could
            # label every shard before that process is up, and the retirement would never be reached)
            for _ in range(600):
                if raised.exists() and len(raised.read_text()) >= 2:
                    break
                time.sleep(0.2)
        if self.broken:
            self.calls += 1
            if self.fault.startswith("sticky"):
                with open(raised, "a") as f:
                    f.write("x")
                raise RuntimeError(STICKY)
            if self.fault == "oom":
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 1.2 GiB free)")
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


def expected_ids(prompts) -> list:
    return [r["prompt_id"] for p in list_shards(prompts) for r in read_table(p, columns=["prompt_id"]).to_pylist()]


def label_ids(tmp_path) -> list:
    """The prompts labelled or rejected (each once): what the matrix counts against the prompts given."""
    labels = tmp_path / "labels"
    return [*(r["prompt_id"] for p in list_shards(labels) for r in read_table(p, columns=["prompt_id"]).to_pylist()),
            *(r["prompt_id"] for p in (labels / "_rejects").glob("part-*.jsonl") for r in read_jsonl(p))]


def faults_line(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("faults cost: ")]


def rerun_changes_nothing(tmp_path):
    labels = tmp_path / "labels"
    before = {p.name: p.read_bytes() for p in [*list_shards(labels), *(labels / "_rejects").glob("*.jsonl")]}
    again = execute(LabelStage(config(tmp_path)))
    assert again["skipped"] is True
    assert {p.name: p.read_bytes() for p in [*list_shards(labels), *(labels / "_rejects").glob("*.jsonl")]} == before


@pytest.mark.faults
def test_a_sticky_device_error_restarts_the_worker_in_a_fresh_process_which_labels_again(prompts, tmp_path,
                                                                                         ray_session, caplog, fault_row):
    stage = broken(prompts, tmp_path, "sticky")
    caplog.set_level("WARNING", logger="blockpilot")
    summary = execute(stage)
    bad = (tmp_path / "broken-worker").read_text()
    assert summary["rows"] == 16 and summary["rejects"] == 0, summary
    assert [r["worker"] for r in summary["faults"]["restarted"]] == [bad] and "retired" not in summary["faults"]
    assert STICKY in summary["faults"]["restarted"][0]["why"]
    restarted = [r.getMessage() for r in caplog.records if "restarted in a fresh process" in r.getMessage()]
    assert len(restarted) == 1 and restarted[0].startswith(f"worker {bad} (node "), restarted
    assert f"1 worker restart(s) ({bad})" in faults_line(caplog)[0]
    assert is_complete(tmp_path / "labels")
    rerun_changes_nothing(tmp_path)
    fault_row("a sticky CUDA error on one worker of 2, once", "label", expected_ids(prompts), label_ids(tmp_path),
              fault_cost(summary))


@pytest.mark.faults
def test_a_device_that_fails_again_after_its_restart_is_retired_and_the_healthy_one_labels_every_prompt(
        prompts, tmp_path, ray_session, caplog, fault_row):
    stage = broken(prompts, tmp_path, "sticky_for_good")
    caplog.set_level("WARNING", logger="blockpilot")
    summary = execute(stage)
    bad = (tmp_path / "broken-worker").read_text()
    assert summary["rows"] == 16 and summary["rejects"] == 0, summary
    assert len(workers_of(tmp_path / "labels")) == 1
    assert len(summary["faults"]["restarted"]) == 1  # one fresh process first
    bad = summary["faults"]["restarted"][0]["worker"]  # (its GPU, as Ray gave it to the restarted process)
    assert bad not in workers_of(tmp_path / "labels")
    assert [r["worker"] for r in summary["faults"]["retired"]] == [bad] and \
        STICKY in summary["faults"]["retired"][0]["why"], summary["faults"]
    retired = [r.getMessage() for r in caplog.records if " retired: " in r.getMessage()]
    assert len(retired) == 1 and retired[0].startswith(f"worker {bad} (node ") and STICKY in retired[0], retired
    assert is_complete(tmp_path / "labels")
    rerun_changes_nothing(tmp_path)
    fault_row("a sticky CUDA error on one worker of 2, in every process of it", "label", expected_ids(prompts), label_ids(tmp_path),
              fault_cost(summary))


@pytest.mark.faults
def test_a_prompt_that_breaks_every_device_is_rejected_as_its_own_and_its_shard_mates_are_labelled(
        prompts, tmp_path, ray_session, caplog, fault_row):
    # the poisonous prompt, fixed before any run: the second prompt of the third shard
    first = read_table(sorted(list_shards(prompts))[2], columns=["prompt_id", "input_ids"]).to_pylist()[1]
    poison_id = first["prompt_id"]
    stage = broken(prompts, tmp_path, "poison")
    stage.poison = tuple(first["input_ids"])
    caplog.set_level("WARNING", logger="blockpilot")
    summary = execute(stage)
    assert summary["rows"] == 15 and summary["rejects"] == 1 and \
        summary["rejects_by_reason"] == {"breaks_device": 1}, summary
    (reject,) = [r for p in (tmp_path / "labels" / "_rejects").glob("*.jsonl") for r in read_jsonl(p)]
    assert reject["prompt_id"] == poison_id and reject["reason"] == "breaks_device" and STICKY in reject["detail"]
    faults = summary["faults"]
    assert list(faults["prompts_refused"]) == [poison_id] and len(faults["prompts_refused"][poison_id]) == 2
    assert len(faults["restarted"]) == 2 and "retired" not in faults, faults  # both restarted, none retired
    assert f"1 prompt(s) rejected as breaks_device ({poison_id})" in faults_line(caplog)[0]
    assert is_complete(tmp_path / "labels")
    rerun_changes_nothing(tmp_path)  # kept: not a retried reason, so the rerun breaks no third worker
    fault_row("one prompt raises a sticky CUDA error on every worker", "label", expected_ids(prompts), label_ids(tmp_path),
              fault_cost(summary))


@pytest.mark.faults
def test_a_worker_out_of_memory_on_every_prompt_is_taken_out_and_its_shards_redone(prompts, tmp_path, ray_session,
                                                                                   caplog, fault_row):
    stage = broken(prompts, tmp_path, "oom")
    caplog.set_level("WARNING", logger="blockpilot")
    summary = execute(stage)
    bad = (tmp_path / "broken-worker").read_text()
    assert summary["rows"] == 16 and summary["rejects"] == 0, summary  # its out_of_memory shards were redone
    (retired,) = summary["faults"]["retired"]
    assert retired["worker"] == bad and retired["why"].startswith("taken out: 8 of its 8 prompts failed to decode")
    assert bad not in workers_of(tmp_path / "labels")
    assert f"1 worker(s) retired ({bad}: taken out: 8 of its 8 prompts" in faults_line(caplog)[0]
    assert is_complete(tmp_path / "labels")
    rerun_changes_nothing(tmp_path)
    fault_row("one worker of 2 out of memory on every prompt", "label", expected_ids(prompts), label_ids(tmp_path),
              fault_cost(summary))


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
