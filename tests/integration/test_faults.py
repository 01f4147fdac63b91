"""Fault injection: kill the pipeline at its worst moments, rerun, and check that nothing is lost or duplicated.

Every run is the real CLI (``python -m stages.cli STAGE ... ray.address=local``) in its own session with its own
local Ray; a fault is a SIGKILL (of the driver's whole process group, or of one label actor), and every test checks
that no Ray process of a killed run outlives it. Faults covered: the label driver killed mid-run, one label actor
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
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import FAST
from pipeline.io.shards import is_complete, list_shards

from .conftest import BLOCKPILOT, PYTHON, REPO, Run, base_env, blockpilot, marked_pids, reap

# 16 prompts in 4 shards of 4, 32 new tokens, 0.5 CPU per actor, each run its own local Ray.
SMALL = [*FAST, "prepare.shard_size=4", "ray.address=local"]
ROW_COLUMNS = ["prompt_id", "tau", "label_block_size"]
# Ray Train V2's controller collects reports every 2 s and a worker's report waits for it once a few are queued,
# which puts a 2 s floor under each epoch; polling faster keeps 30 epochs short.
FAST_TRAIN_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


def label_rows(labels: Path) -> list:
    t = pa.concat_tables([pq.read_table(p, columns=ROW_COLUMNS) for p in list_shards(labels)])
    return sorted(t.to_pylist(), key=lambda r: r["prompt_id"])


def prompt_ids(out: Path) -> list:
    return sorted(i for p in list_shards(out / "prompts") for i in pq.read_table(p, columns=["prompt_id"])["prompt_id"]
                  .to_pylist())


def validate(labels: Path) -> subprocess.CompletedProcess:
    return subprocess.run([BLOCKPILOT, "validate", str(labels)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def assert_no_ray_left(run: Run) -> None:
    """GCS and raylet died with the driver's process group; what escaped it (Ray workers, in sessions of their
    own) was killed by pid; nothing of the run is alive now."""
    assert not set(run.escaped.values()) & {"gcs_server", "raylet"}, run.escaped
    assert not run.left and not marked_pids(run.marker), run.left


def assert_complete_and_like_reference(out: Path, reference: Path) -> None:
    labels = out / "labels"
    v = validate(labels)
    assert v.returncode == 0, v.stdout + v.stderr
    assert is_complete(labels)
    assert [p.name for p in list_shards(labels)] == [p.name for p in list_shards(out / "prompts")]
    rows = label_rows(labels)
    ids = [r["prompt_id"] for r in rows]
    assert len(ids) == len(set(ids)) == 16  # no duplicates
    assert ids == prompt_ids(out)  # exactly one row per accepted prompt
    assert rows == label_rows(reference / "labels")  # T = 0: the same rows as an uninterrupted run


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    run = blockpilot("prepare", f"output_dir={out}", *SMALL, timeout=180)
    assert run.proc.returncode == 0, run.tail()
    assert len(list_shards(out / "prompts")) == 4
    return out


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory) -> Path:
    """One uninterrupted label run over the same prompts."""
    out = tmp_path_factory.mktemp("reference")
    shutil.copytree(prepared / "prompts", out / "prompts")
    run = blockpilot("label", f"output_dir={out}", *SMALL, "label.num_workers=2", timeout=300)
    assert run.proc.returncode == 0, run.tail()
    assert validate(out / "labels").returncode == 0
    return out


def fresh(prepared: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(prepared / "prompts", out / "prompts")
    return out


def test_label_driver_killed_mid_run_then_rerun(prepared, reference, tmp_path):
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
    rerun = blockpilot("label", f"output_dir={out}", *SMALL, "label.num_workers=1", timeout=300)
    assert rerun.proc.returncode == 0, rerun.tail()
    assert f"{4 - len(done)}/4 shards" in rerun.output, rerun.tail()  # only the missing shards are relabelled
    assert {p: (labels / p).stat().st_mtime_ns for p in done} == done  # finished shards untouched
    assert_complete_and_like_reference(out, reference)


def test_label_actor_killed_mid_shard_is_restarted(prepared, reference, tmp_path):
    out = fresh(prepared, tmp_path)
    labels = out / "labels"
    run = Run([PYTHON, "-m", "stages.cli", "label", f"output_dir={out}", *SMALL, "label.num_workers=2",
               "progress=true"])
    worker_line = re.compile(r"^\[label\] worker (\S+) pid=(\d+) ")

    def workers():
        found = [m.groups() for m in map(worker_line.match, list(run.lines)) if m]
        return found if len(found) == 2 else None

    try:
        (victim, pid), _ = run.wait_for(workers, 240, "the two worker lines")
        time.sleep(0.2)  # the driver submits each actor its first shard right after these lines
        shards_at_kill = len(list_shards(labels))
        os.kill(int(pid), signal.SIGKILL)
        rc = run.wait(300)
    finally:
        run.kill() if run.proc.poll() is None else run.reap()
    print(f"[fault] label actor {victim} pid={pid} SIGKILLed with {shards_at_kill}/4 shards written; run exit {rc};"
          f" Ray said: {[x[:120] for x in run.lines if 'worker died' in x][:1]}")
    assert rc == 0, run.tail()
    assert shards_at_kill == 0  # no shard finished yet: the victim had its first shard in flight
    assert "FAILED" not in run.output and "failed after retries" not in run.output, run.tail()
    # The killed actor's shard is retried on the same actor once Ray has restarted it.
    assert re.search(rf"by {re.escape(victim)}$", run.output, re.M), run.tail()
    assert not run.left and not marked_pids(run.marker), run.left  # Ray's own shutdown left nothing
    assert_complete_and_like_reference(out, reference)


def test_train_killed_mid_way_resumes_from_its_checkpoint(reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference / "labels", out / "labels")
    metrics = out / "train" / "metrics.jsonl"
    args = ["train", f"output_dir={out}", *SMALL, "train.epochs=30", "train.hidden=32", "progress=true"]

    def lines():
        return metrics.exists() and len(metrics.read_text().splitlines()) >= 3

    run = Run([PYTHON, "-m", "stages.cli", *args], FAST_TRAIN_POLL)
    run.wait_for(lines, 300, "3 lines in train/metrics.jsonl")
    run.kill(signal.SIGKILL)
    assert_no_ray_left(run)
    at_kill = len(metrics.read_text().splitlines())
    assert at_kill < 30 and not is_complete(out / "train")

    rerun = blockpilot(*args, timeout=400, env=FAST_TRAIN_POLL)
    assert rerun.proc.returncode == 0, rerun.tail()
    m = re.search(r"\[train\] resuming from the checkpoint of epoch (\d+)", rerun.output)
    assert m, rerun.tail()
    assert 0 <= int(m.group(1)) < at_kill
    print(f"[fault] train group SIGKILLed with {at_kill} epochs in metrics.jsonl; escaped the group (killed by "
          f"pid): {sorted(run.escaped.values())}; rerun: {m.group(0)!r}")
    history = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [h["epoch"] for h in history] == list(range(30))  # each epoch exactly once
    # A log a person can follow: the driver shows every 3rd epoch of 30 once, Ray Train's per-report dumps stay out.
    epochs_shown = re.findall(r"^\[train\] epoch (\d+)/30 ", rerun.output, re.M)
    assert epochs_shown and len(epochs_shown) == len(set(epochs_shown)) <= 10, epochs_shown
    assert "Reporting training result" not in rerun.output and "Checkpoint successfully created" not in rerun.output
    assert json.loads((out / "train" / "summary.json").read_text())["epochs"] == 30
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
    marker = uuid.uuid4().hex
    t0 = time.monotonic()
    try:
        r = subprocess.run([PYTHON, "-m", "stages.cli", stage, f"output_dir={out}", *SMALL], cwd=REPO,
                           capture_output=True, text=True, timeout=120, start_new_session=True,
                           env=base_env(marker))
    finally:
        left = reap(marker)
    elapsed = time.monotonic() - t0
    print(f"[fault] {stage} with {folder}/ a regular file: exit {r.returncode} in {elapsed:.1f} s: {r.stderr.strip()}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "not writable" in r.stderr and str(out / folder) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "Started a local Ray instance" not in r.stdout + r.stderr  # it failed before any work
    assert elapsed < 30, elapsed  # before any model or Ray start-up
    assert not left
