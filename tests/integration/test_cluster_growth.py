"""A cluster as it comes up, on this machine: a head without a GPU (as a RayJob's head: the jobs' drivers run there)
and worker nodes with one logical GPU each (no GPU exists: ``model.device=cpu`` runs the models on the CPU, and Ray
places one actor per GPU as on GPU pods).

The label job starts with one GPU node (A). Then, event by event (never a sleep deciding a race):

1. A's actor is held on its first shard (a sitecustomize on A alone: its label process waits for a file the test
   writes; its Ray threads run on, so Ray never sees it unresponsive), so that the work cannot end before the nodes
   below join. A SIGSTOP did this until the frozen actor missed Ray's keepalive on a loaded machine and was taken for
   lost;
2. node B joins: the job gives it an actor (``label.num_workers: null`` = every GPU, as it comes), whose model load
   is killed every time it starts (as the kernel's OOM killer does on a node short of host memory): the pool drops
   it and starts another worker on any node but B, which waits for one;
3. node C joins: that worker starts there, and takes shards;
4. A goes on (the file is written).

Checked: the job succeeds; every prompt is labelled exactly once; the shards come from A's and C's workers, none from
B's; the log says B's setup failed and why.

Apart: the driver (on the head) has no GPU, and a decoding stage's one-off task (pipeline.executor.ray.device_task.on_a_worker: what
evaluate's pass at load and tune's load check run in) lands on a GPU node, asked from a job on the head.
"""

from __future__ import annotations

import json
import re
import uuid

import pytest

from conftest import FAST

from .conftest import HOLD_FIRST_PROMPT, hook_pids, inject_hook, validate
from .ray_cluster import Cluster, job_ok as _ok


# 16 prompts in 8 shards of 2: shards enough to go round three workers.
SMALL = [*FAST, "train.epochs=2", "prepare.shard_size=2", "label.num_workers=null", "evaluate.per_step=false",
         "profile.concurrency=[1,4]", "evaluate.concurrency=[1,4]", "evaluate.num_workers=1"]


# B: its label actors' model loads die by SIGKILL, as ones the kernel's OOM killer ends.
KILL_LABEL_LOADS = dict(module="pipeline.decoding.models", func="load_models", title="ray::StageActor[label].setup",
                        action="    os.kill(os.getpid(), signal.SIGKILL)")
@pytest.fixture(scope="module")
def cluster():
    c = Cluster(head_gpus=0, head_cpus=2)
    try:
        c.start()
        yield c
    finally:
        if c.head is not None:
            c.shutdown()


@pytest.mark.faults  # (the other test here injects no fault: not a row of the fault matrix)
def test_label_grows_onto_joining_nodes_and_moves_off_a_node_that_cannot_load(cluster, tmp_path, fault_row):
    out = tmp_path / "run"
    _ok(cluster.submit("jobs/prepare.py", f"output_dir={out}", *SMALL), "prepare job")
    held, killing = inject_hook(tmp_path / "on-a", HOLD_FIRST_PROMPT), inject_hook(tmp_path / "on-b", KILL_LABEL_LOADS)
    a = cluster.add_node("gpu-a", gpus=1, cpus=2, env=held)
    job_id = f"growth-{uuid.uuid4().hex[:8]}"
    job = cluster.submit("jobs/label.py", f"output_dir={out}", *SMALL, wait=False, submission_id=job_id)
    try:
        found = job.wait_for(lambda: re.search(rf"^\[label\] worker {a.node_id[:12]}\S* pid=(\d+)", job.output, re.M),
                             600, "A's worker to set up")
        job.wait_for(lambda: hook_pids(held), 600, "A's actor held on its first prompt", poll=0.5)
        assert hook_pids(held) == [found.group(1)], (hook_pids(held), found.group(0))
        b = cluster.add_node("gpu-b", gpus=1, cpus=2, env=killing)
        job.wait_for(lambda: re.search(rf"worker {b.node_id[:12]}\S* on node {b.node_id[:12]} could not set up",
                                       job.output), 600, "B's worker to fail its setup", poll=0.5)
        c = cluster.add_node("gpu-c", gpus=1, cpus=2)
        job.wait_for(lambda: re.search(rf"^\[label\] worker {c.node_id[:12]}\S* pid=\d+", job.output, re.M), 600,
                     "a worker set up on C", poll=0.5)
        open(held["BP_RELEASE"], "w").close()
        rc = job.wait(600)
    finally:
        if job.proc.poll() is None:  # failed mid-way: the job itself stopped too, or the next test waits on its GPUs
            job.kill()
            cluster.stop_job(job_id)
    assert rc == 0, job.tail(80)
    assert hook_pids(killing), "B's model load was never seen"
    assert re.search(r"a GPU joined the cluster", job.output), job.tail(80)
    for line in job.lines:
        if "could not set up" in line or "joined" in line:
            print("[growth]", line)

    labels = out / "labels"
    manifest = json.loads((labels / "manifest.json").read_text())
    import pyarrow.parquet as pq

    from pipeline.io.shards import list_shards

    prompts = sorted(i for p in list_shards(out / "prompts") for i in pq.read_table(p).column("prompt_id").to_pylist())
    rows = [r for p in list_shards(labels) for r in pq.read_table(p, columns=["prompt_id", "worker"]).to_pylist()]
    fault_row("a GPU node whose every model load is killed; another joins mid-label (multi-node cluster)", "label",
              prompts, [r["prompt_id"] for r in rows])
    assert sorted(r["prompt_id"] for r in rows) == prompts and len(prompts) == 16  # every prompt exactly once
    by_node = {w["identity"][:12] for w in manifest["workers"]}
    assert by_node == {a.node_id[:12], c.node_id[:12]}, manifest["workers"]
    assert {r["worker"][:12] for r in rows} == {a.node_id[:12], c.node_id[:12]}
    v = validate(labels)
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_drivers_one_off_decoding_task_runs_on_a_gpu_node_when_the_head_has_none(cluster, tmp_path):
    gpu = cluster.add_node("gpu-d", gpus=1, cpus=1)
    job = cluster.submit("tests/integration/where_task_runs.py", f"output_dir={tmp_path / 'run'}", *SMALL, timeout=300)
    _ok(job, "the job asking for the task")
    got = json.loads(re.search(r"^WHERE (.*)$", job.output, re.M).group(1))
    assert got["driver"]["gpu_ids"] == [] and got["driver"]["node_id"] not in {n.node_id for n in cluster.nodes}
    assert got["task"]["gpu_ids"] and got["task"]["node_id"] in {n.node_id for n in cluster.nodes}, got
    assert gpu.node_id in {n.node_id for n in cluster.nodes}
