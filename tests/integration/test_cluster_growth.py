"""A cluster as it comes up, on this machine: a head without a GPU (as a RayJob's head: the jobs' drivers run there)
and worker nodes with one logical GPU each (no GPU exists: ``model.device=cpu`` runs the models on the CPU, and Ray
places one actor per GPU as on GPU pods).

The label job starts with one GPU node (A). Then, event by event (never a sleep deciding a race):

1. A's actor is frozen (SIGSTOP) on its first shard, so that the work cannot end before the nodes below join;
2. node B joins: the job gives it an actor (``label.num_workers: null`` = every GPU, as it comes), whose model load
   is killed every time it starts (as the kernel's OOM killer does on a node short of host memory): the pool drops
   it and starts another worker on any node but B, which waits for one;
3. node C joins: that worker starts there, and takes shards;
4. A goes on (SIGCONT).

Checked: the job succeeds; every prompt is labelled exactly once; the shards come from A's and C's workers, none from
B's; the log says B's setup failed and why. Then train, and evaluate with its pass at load: the driver has no GPU,
and the pass runs in a task on a GPU node (``load.json``'s ``where``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest

from conftest import FAST

from .conftest import BLOCKPILOT, REPO
from .ray_cluster import Cluster, cmdline as _cmdline, job_ok as _ok

pytestmark = pytest.mark.faults

# 16 prompts in 8 shards of 2: shards enough to go round three workers.
SMALL = [*FAST, "train.epochs=2", "prepare.shard_size=2", "label.num_workers=null", "evaluate.per_step=false",
         "evaluate.concurrency=[1,4]", "evaluate.num_workers=1"]


# Node B's Python processes import this (its PYTHONPATH): a label actor that loads its models there dies by SIGKILL
# at that moment, as one the kernel's OOM killer ends, after noting its pid. No process outside B is touched, and
# nothing polls for the moment: the load itself is the event.
KILL_LABEL_LOADS = """
import importlib.abc, importlib.util, os, signal, sys


class KillLabelLoads(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "pipeline.decoding.models":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            load = module.load_models

            def load_models(*args, **kwargs):
                with open("/proc/self/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::StageActor[label].setup"):
                        with open(os.environ["BP_KILLED"], "a") as log:
                            log.write(f"{os.getpid()}\\n")
                        os.kill(os.getpid(), signal.SIGKILL)
                return load(*args, **kwargs)

            module.load_models = load_models

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, KillLabelLoads())
"""


def _on_a_shard(pid: int) -> bool:
    """Whether the actor process ``pid`` runs a shard (its process title; one file read, no /proc scan)."""
    return _cmdline(pid).startswith("ray::StageActor[label].process")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(head_gpus=0, head_cpus=2)
    try:
        c.start()
        yield c
    finally:
        if c.head is not None:
            c.shutdown()


def test_label_grows_onto_joining_nodes_and_moves_off_a_node_that_cannot_load(cluster, tmp_path, fault_row):
    out = tmp_path / "run"
    _ok(cluster.submit("jobs/prepare.py", f"output_dir={out}", *SMALL), "prepare job")
    a = cluster.add_node("gpu-a", gpus=1, cpus=2)
    job = cluster.submit("jobs/label.py", f"output_dir={out}", *SMALL, wait=False)
    inject, killed = tmp_path / "inject", tmp_path / "killed.txt"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(KILL_LABEL_LOADS)
    try:
        # A's worker says its pid when it is set up; it is frozen once on its first shard (its process title)
        found = job.wait_for(lambda: re.search(rf"^\[label\] worker {a.node_id[:12]}\S* pid=(\d+)", job.output, re.M),
                             600, "A's worker to set up")
        frozen = int(found.group(1))
        job.wait_for(lambda: _on_a_shard(frozen), 600, "A's actor on a shard", poll=0.5)
        os.kill(frozen, signal.SIGSTOP)
        b = cluster.add_node("gpu-b", gpus=1, cpus=2, env={"PYTHONPATH": str(inject), "BP_KILLED": str(killed)})
        job.wait_for(lambda: re.search(rf"worker {b.node_id[:12]}\S* on node {b.node_id[:12]} could not set up",
                                       job.output), 600, "B's worker to fail its setup", poll=0.5)
        c = cluster.add_node("gpu-c", gpus=1, cpus=2)
        job.wait_for(lambda: re.search(rf"^\[label\] worker {c.node_id[:12]}\S* pid=\d+", job.output, re.M), 600,
                     "a worker set up on C", poll=0.5)
        os.kill(frozen, signal.SIGCONT)
        rc = job.wait(600)
    finally:
        if job.proc.poll() is None:
            job.kill()
    assert rc == 0, job.tail(80)
    assert killed.is_file() and killed.read_text().split(), "B's model load was never seen"
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
    v = subprocess.run([BLOCKPILOT, "validate", str(labels)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert v.returncode == 0, v.stdout + v.stderr

    # The driver (on the head) has no GPU: evaluate's pass at load runs in a task on a GPU node.
    _ok(cluster.submit("jobs/train.py", f"output_dir={out}", *SMALL, timeout=600), "train job")
    ev = cluster.submit("jobs/evaluate.py", f"output_dir={out}", *SMALL, timeout=900)
    _ok(ev, "evaluate job")
    load = json.loads((out / "eval" / "load.json").read_text())
    assert load["where"]["node_id"] in {a.node_id, b.node_id, c.node_id} and load["where"]["gpu_ids"], load["where"]
    assert "4" in load["loads"] and load["loads"]["4"]["methods"]["AR"]["throughput"] > 0
