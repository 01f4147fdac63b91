"""Fault injection: kill the pipeline at its worst moments, rerun, and check that nothing is lost or duplicated.

Every run that is killed is the real CLI (``python -m stages.cli STAGE ... ray.address=local``) in its own session
with its own local Ray; a fault is a SIGKILL (of the driver's whole process group, or of one label actor), and every
test checks that no Ray process of a killed run outlives it. The reruns go through the CLI's entry point in this
process, on the session's Ray: what they resume from is on disk, and a fresh interpreter and Ray start-up (10-20 s a
run here) add nothing to it. Faults covered: the label driver killed mid-run, one label actor
killed mid-shard, the train run killed mid-way, an output folder that cannot be written. (A truncated label shard is
covered by tests/test_stages.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import FAST
from pipeline.io.shards import is_complete, list_shards

from .conftest import (HOLD_FIRST_PROMPT, PYTHON, REPO, Run, base_env, blockpilot_here, hook_pids, inject_hook,
                       marked_pids, ray_sessions, reap, short_tmpdir, validate)

# 16 prompts in 4 shards of 4, 32 new tokens, 0.5 CPU per actor, each run its own local Ray.
SMALL = [*FAST, "prepare.shard_size=4", "ray.address=local"]
# Label columns that are measured, not computed: wall seconds, the worker's name, and the cost-aware label (argmax
# tau / cost under the worker's own measured cost profile). Every other column, logits included, is deterministic at
# T = 0 and compared with the uninterrupted run.
MEASURED_COLUMNS = {"decode_seconds", "prefill_seconds", "trace_seconds", "worker", "label_speedup_block_size"}
# Ray Train V2's controller collects reports every 2 s and a worker's report waits for it once a few are queued,
# which puts a 2 s floor under each epoch; polling faster keeps 15 epochs short.
FAST_TRAIN_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


def compared_columns(labels: Path) -> list:
    names = pq.read_schema(list_shards(labels)[0]).names
    assert MEASURED_COLUMNS <= set(names), MEASURED_COLUMNS - set(names)
    return [n for n in names if n not in MEASURED_COLUMNS]


def label_rows(labels: Path) -> list:
    cols = compared_columns(labels)
    assert {"steps", "new_tokens", "logits", "tau", "trace_match"} <= set(cols)
    t = pa.concat_tables([pq.read_table(p, columns=cols) for p in list_shards(labels)])
    return sorted(t.to_pylist(), key=lambda r: r["prompt_id"])


def prompt_ids(out: Path) -> list:
    return sorted(i for p in list_shards(out / "prompts") for i in pq.read_table(p, columns=["prompt_id"])["prompt_id"]
                  .to_pylist())


def assert_no_ray_left(run: Run) -> None:
    """GCS and raylet died with the driver's process group; what escaped it (Ray workers, in sessions of their
    own) was killed by pid; nothing of the run is alive now."""
    assert not set(run.escaped.values()) & {"gcs_server", "raylet"}, run.escaped
    assert not run.left and not marked_pids(run.marker), run.left


def assert_complete_and_like_reference(out: Path, reference: Path, fault_row, fault: str) -> None:
    labels = out / "labels"
    v = validate(labels)
    assert v.returncode == 0, v.stdout + v.stderr
    assert is_complete(labels)
    assert [p.name for p in list_shards(labels)] == [p.name for p in list_shards(out / "prompts")]
    rows = label_rows(labels)
    ids = [r["prompt_id"] for r in rows]
    fault_row(fault, "label", prompt_ids(out), ids)
    assert len(ids) == len(set(ids)) == 16  # no duplicates
    assert ids == prompt_ids(out)  # exactly one row per accepted prompt
    expected = label_rows(reference / "labels")
    # T = 0: the same rows as an uninterrupted run, on every computed column (logits included); a mismatch names
    # the columns that differ.
    differ = sorted({c for a, b in zip(rows, expected) for c in a if a[c] != b[c]})
    assert not differ and rows == expected, differ


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, ray_session) -> Path:
    # the inputs of the runs under test, through the CLI's entry point on the session's Ray: the runs that are
    # killed and rerun below are fresh processes with their own local Ray
    out = tmp_path_factory.mktemp("prepared")
    run = blockpilot_here("prepare", f"output_dir={out}", *SMALL)
    assert run.rc == 0, run.tail()
    assert len(list_shards(out / "prompts")) == 4
    return out


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> Path:
    """One uninterrupted label run over the same prompts."""
    out = tmp_path_factory.mktemp("reference")
    shutil.copytree(prepared / "prompts", out / "prompts")
    run = blockpilot_here("label", f"output_dir={out}", *SMALL)  # one actor (FAST's): the labels are the same
    assert run.rc == 0, run.tail()
    assert validate(out / "labels").returncode == 0
    return out


def fresh(prepared: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(prepared / "prompts", out / "prompts")
    return out


@pytest.mark.faults
def test_label_driver_killed_mid_run_then_rerun(prepared, reference, tmp_path, fault_row):
    out = fresh(prepared, tmp_path)
    labels = out / "labels"
    # One actor: shards finish one after another, so the kill lands with work done and work left.
    run = Run([PYTHON, "-m", "stages.cli", "label", f"output_dir={out}", *SMALL, "label.num_workers=1"])
    run.wait_for(lambda: list_shards(labels), 240, "the first label shard")
    run.kill(signal.SIGKILL)  # the driver's whole process group: driver, GCS, raylet, ...
    assert_no_ray_left(run)
    done = {p.name: p.stat().st_mtime_ns for p in list_shards(labels)}
    assert 1 <= len(done) < 4 and not is_complete(labels), done
    assert validate(labels).returncode == 1  # an interrupted dataset is not passed off as complete

    print(f"[fault] label driver group SIGKILLed at {len(done)}/4 shards; escaped the group (killed by pid): "
          f"{sorted(run.escaped.values())}")
    # the rerun needs no fresh process: through the CLI's entry point, on the session's Ray
    rerun = blockpilot_here("label", f"output_dir={out}", *SMALL, "label.num_workers=1")
    assert rerun.rc == 0, rerun.tail()
    assert f"{4 - len(done)}/4 shards" in rerun.output, rerun.tail()  # only the missing shards are relabelled
    assert {p: (labels / p).stat().st_mtime_ns for p in done} == done  # finished shards untouched
    assert_complete_and_like_reference(out, reference, fault_row, "driver process group SIGKILLed, rerun")


@pytest.mark.faults
def test_label_actor_killed_mid_shard_is_restarted(prepared, reference, tmp_path, fault_row):
    out = fresh(prepared, tmp_path)
    labels = out / "labels"
    # Each label actor's first prompt is held (a sitecustomize hook on the run's PYTHONPATH, which its local Ray's
    # workers inherit) until the test writes a file: the victim is killed while it holds its shard, whatever the
    # machine's speed (a watch for the victim's read of its shard lost the race: it could write the whole shard
    # between that read and the kill).
    held = inject_hook(tmp_path / "hold", HOLD_FIRST_PROMPT)
    run = Run([PYTHON, "-m", "stages.cli", "label", f"output_dir={out}", *SMALL, "label.num_workers=2",
               "progress=true"], held)
    worker_line = re.compile(r"^\[label\] worker (\S+) pid=(\d+) ")

    def workers():
        found = [m.groups() for m in map(worker_line.match, list(run.lines)) if m]
        return found if len(found) == 2 else None

    # The victim (the first worker line: the first actor) is given the first prompt shard; asserted below by the
    # pool's line for part-00000's failed attempt.
    try:
        (victim, pid), _ = run.wait_for(workers, 240, "the two worker lines")
        run.wait_for(lambda: pid in hook_pids(held), 240, "the victim held on its first prompt")
        shards_at_kill = len(list_shards(labels))
        victims_done = (labels / "part-00000.parquet").exists()
        os.kill(int(pid), signal.SIGKILL)
        open(held["BP_RELEASE"], "w").close()  # the other actor, and the victim once Ray has restarted it, go on
        rc = run.wait(300)
    finally:
        run.kill() if run.proc.poll() is None else run.reap()
    print(f"[fault] label actor {victim} pid={pid} SIGKILLed with {shards_at_kill}/4 shards written; run exit {rc};"
          f" Ray said: {[x[:120] for x in run.lines if 'worker died' in x][:1]}")
    assert rc == 0, run.tail()
    # The victim's own shard was in flight, not finished (the other worker may have finished some of its own by then:
    # 2 of 4 on a loaded CI machine)
    assert not victims_done, shards_at_kill
    assert any("worker died or was killed while executing a task" in x for x in run.lines), run.tail()  # as Ray saw it
    assert "FAILED" not in run.output and "failed after retries" not in run.output, run.tail()
    # The pool, not Ray, retries the killed actor's shard (one attempt spent): on the victim once Ray has restarted
    # it, or on the other worker if the victim is not back within RayActorPool.rejoin_wait_s (a restart loads the
    # models and profiles again, which on a busy machine takes longer).
    assert re.search(rf"part-00000\.parquet attempt 1/\d+ failed: worker {re.escape(victim)} lost", run.output), \
        run.tail()
    assert not run.left and not marked_pids(run.marker), run.left  # Ray's own shutdown left nothing
    assert_complete_and_like_reference(out, reference, fault_row, "one actor SIGKILLed mid-shard")


@pytest.mark.faults
def test_train_killed_mid_way_resumes_from_its_checkpoint(reference, tmp_path, fault_row):
    out = tmp_path / "run"
    shutil.copytree(reference / "labels", out / "labels")
    metrics = out / "train" / "metrics.jsonl"
    args = ["train", f"output_dir={out}", *SMALL, "train.epochs=15", "train.hidden=32", "progress=true"]

    def lines():
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    run = Run([PYTHON, "-m", "stages.cli", *args], FAST_TRAIN_POLL)
    run.wait_for(lines, 300, "3 lines in train/metrics.jsonl")
    run.kill(signal.SIGKILL)
    assert_no_ray_left(run)
    at_kill = len(metrics.read_text().splitlines())
    assert at_kill < 15 and not is_complete(out / "train")

    # The rerun through the CLI's entry point on the session's Ray: the Ray Train worker's output (its "resuming"
    # line, and Ray Train's per-report lines had they not been quieted) is read from the session's worker logs.
    rerun = blockpilot_here(*args)
    assert rerun.rc == 0, rerun.tail()
    m = re.search(r"\[train\] resuming from the checkpoint of epoch (\d+)", rerun.workers)
    assert m, rerun.workers[-3000:]
    # At most the last epoch metrics.jsonl held at the kill (epoch at_kill - 1), or the next one when the kill fell
    # between that epoch's checkpoint report and rank 0's rewrite of metrics.jsonl (stages/train.py: report first).
    assert 0 <= int(m.group(1)) <= at_kill
    print(f"[fault] train group SIGKILLed with {at_kill} epochs in metrics.jsonl; escaped the group (killed by "
          f"pid): {sorted(run.escaped.values())}; rerun: {m.group(0)!r}")
    history = [json.loads(x) for x in metrics.read_text().splitlines()]
    fault_row("driver process group SIGKILLed, rerun (rows: epochs)", "train", range(15),
              [h["epoch"] for h in history])
    assert [h["epoch"] for h in history] == list(range(15))  # each epoch exactly once
    # A log a person can follow: the driver shows every 3rd epoch of 15 once, Ray Train's per-report dumps stay out.
    epochs_shown = [int(e) for e in re.findall(r"^\[train\] epoch (\d+)/15 ", rerun.output, re.M)]
    assert epochs_shown and len(epochs_shown) == len(set(epochs_shown)) and all(e % 3 == 0 for e in epochs_shown), \
        epochs_shown
    for said in (rerun.output, rerun.workers):
        assert "Reporting training result" not in said and "Checkpoint successfully created" not in said
    assert json.loads((out / "train" / "summary.json").read_text())["epochs"] == 15
    assert is_complete(out / "train")


@pytest.mark.parametrize("stage", ["prepare", "label", "train"])
def test_unwritable_output_folder_fails_fast_and_clearly(stage, prepared, reference, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    if stage == "label":
        shutil.copytree(prepared / "prompts", out / "prompts")
    if stage == "train":
        shutil.copytree(reference / "labels", out / "labels")
    folder = {"prepare": "prompts", "label": "labels", "train": "train"}[stage]
    (out / folder).write_text("a regular file where the stage's folder should be\n")
    marker, ray_tmp = uuid.uuid4().hex, short_tmpdir("bpit-")
    try:
        r = subprocess.run([PYTHON, "-m", "stages.cli", stage, f"output_dir={out}", *SMALL], cwd=REPO,
                           capture_output=True, text=True, timeout=120, start_new_session=True,
                           env=base_env(marker, RAY_TMPDIR=str(ray_tmp)))
        started = ray_sessions(ray_tmp)
    finally:
        left = reap(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(f"[fault] {stage} with {folder}/ a regular file: exit {r.returncode}: {r.stderr.strip()}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "not writable" in r.stderr and str(out / folder) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    # It failed before any work: no Ray started (none left a session in its temp dir), and the file in the folder's
    # place is untouched.
    assert started == [], started
    assert "Loading weights" not in r.stderr and "Loading checkpoint" not in r.stderr, r.stderr
    assert (out / folder).read_text() == "a regular file where the stage's folder should be\n"
    assert not left


@pytest.mark.faults
def test_train_killed_after_its_last_checkpoint_completes_from_it(reference, tmp_path, fault_row, monkeypatch):
    """Killed between the last epoch's checkpoint and the closing (summary.json, _SUCCESS): the rerun resumes at
    the end, runs no epoch, and must still find the checkpoint to export from. Were Ray Train's result to carry no
    checkpoint then, train would refuse with "training produced no checkpoint": this is that refusal's one real
    trigger, and it must not fire. No process is killed here (the kill is what the two files' absence stands for),
    so both runs go through the CLI's entry point on the session's Ray (a local Ray start-up and an interpreter less
    each); the Ray Train worker's "resuming" line is read from the session's worker logs."""
    for key, value in FAST_TRAIN_POLL.items():  # Ray Train propagates it from the driver to its controller
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    shutil.copytree(reference / "labels", out / "labels")
    args = ["train", f"output_dir={out}", *SMALL, "train.epochs=4", "train.hidden=32", "progress=true"]
    first = blockpilot_here(*args)
    assert first.rc == 0, first.tail()
    policy = (out / "train" / "policy" / "model.safetensors").read_bytes()
    metrics = (out / "train" / "metrics.jsonl").read_bytes()
    for name in ("_SUCCESS", "summary.json"):  # what a kill after the last checkpoint leaves undone
        (out / "train" / name).unlink()
    rerun = blockpilot_here(*args)
    assert rerun.rc == 0 and "no checkpoint" not in rerun.output, rerun.tail()
    assert "[train] resuming from the checkpoint of epoch 3" in rerun.workers, rerun.workers[-3000:]
    assert (out / "train" / "metrics.jsonl").read_bytes() == metrics  # no epoch trained (or reported) again
    history = [json.loads(x) for x in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    fault_row("train killed after its last checkpoint, rerun (rows: epochs)", "train", range(4),
              [h["epoch"] for h in history])
    assert [h["epoch"] for h in history] == list(range(4)) and is_complete(out / "train")
    assert (out / "train" / "policy" / "model.safetensors").read_bytes() == policy  # the same weights, exported again
