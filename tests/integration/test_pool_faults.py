"""A fault costs only itself (issue #67), on real actors on the session's local Ray (tests/conftest.py::ray_session:
2 logical GPUs, so 2 actors) with a tiny synthetic stage (no models; the label stage's own cases are in
test_broken_device.py):

* a worker that hangs on its second shard: the shard is taken back past its deadline, done by the other worker,
  the hung worker restarted in a fresh process; the stage ends on its own;
* a worker whose shard writes fail: each of its shards is retried on the other worker, and it is taken out once its
  shard errors run far above the other's;
* one worker of two failing its preflight: with workers.min_fraction=0.5 the stage goes on without it, naming it and
  why in summary.json; with the default 0.9 it refuses, as before.

Each ends with every shard done, the cost named in summary.json's ``faults`` and the closing line, and a rerun that
changes nothing. The bad worker is the first to claim a file (an exclusive create), so that exactly one is bad.
"""

import json
import os
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray.cloudpickle

from conftest import fault_cost
from pipeline.executor.driver import run_stage
from pipeline.executor.folder import mark_complete
from pipeline.executor.stage import Plan, Resources, ShardStage, tasks_from_shards
from pipeline.io.shards import is_complete, list_shards, shard_name, write_parquet_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config
from pipeline.executor.ray.pool import RayActorPool

pytestmark = pytest.mark.integration

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors unpickle the stages from here

SCHEMA = pa.schema([("prompt_id", pa.string()), ("x", pa.int64())])
SHARDS = 6


def claim(path: str) -> bool:
    """True for the first caller across every process (an exclusive create)."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Faulty(ShardStage):
    """Doubles integers. ``fault``: "hang" (the first worker to set up sleeps an hour on its second shard, once),
    "write" (the first worker to set up fails every shard it is given, as a node whose storage broke) or "preflight"
    (the first worker to be checked fails its preflight)."""

    name = "faulty"

    def __init__(self, cfg, inputs: Path, folder: Path, work: Path, fault: str):
        super().__init__(cfg, folder)
        self.inputs, self.work, self.fault = inputs, work, fault

    def fingerprint(self):
        return {"double": True}

    def plan(self):
        return Plan(tasks_from_shards(self.inputs))

    def resources(self):
        return Resources(actors=True, num_workers=2, cpus_per_worker=0.5, max_retries=2,
                         workers_key="faulty.num_workers")

    def __setstate__(self, state):  # in the actor: the preflight fault patches its checks there
        self.__dict__.update(state)
        if self.fault == "preflight":
            import pipeline.executor.preflight as checks

            quick = checks.check_worker

            def check_worker(*a, **k):
                row = quick(*a, **k)
                if claim(str(self.work / "bad-preflight")):
                    row["problems"].append(("model.device", "its GPU's driver does not answer (a test's fault)"))
                return row

            checks.check_worker = check_worker

    def setup(self, worker):
        self.identity, self.done = worker.identity, 0
        self.bad = self.fault in ("hang", "write") and claim(str(self.work / "bad-worker"))
        if self.bad:
            (self.work / "bad-worker").write_text(worker.identity)

    def wait_for_the_bad_workers_second_shard(self) -> None:
        """A healthy worker holds its shard until the bad one has taken two (a condition, not a pause): else it
        could do every shard while the bad one sets up, and the fault would never be met. Bounded: a minute, then
        the test fails on its own assertions instead of hanging."""
        tries = self.work / "bad-tries"
        for _ in range(1200):
            if tries.exists() and len(tries.read_text().splitlines()) >= 2:
                return
            time.sleep(0.05)

    def process_shard(self, input, rejects):
        name = Path(input).name
        with open(self.work / "tries", "a") as f:
            f.write(f"{name} {self.identity} {os.getpid()}\n")
        self.done += 1
        if self.bad:
            with open(self.work / "bad-tries", "a") as f:
                f.write(f"{name}\n")
        elif self.fault in ("hang", "write"):
            self.wait_for_the_bad_workers_second_shard()
        if self.fault == "hang" and self.bad and self.done == 2 and claim(str(self.work / "hung")):
            time.sleep(3600)
        if self.fault == "write" and self.bad:
            raise OSError(f"[Errno 5] Input/output error: writing {name}")
        rows = read_table(input).to_pylist()
        return pa.table({"prompt_id": [r["prompt_id"] for r in rows], "x": [2 * r["x"] for r in rows]},
                        schema=SCHEMA)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("faults-inputs")
    for i in range(SHARDS):
        rows = [{"prompt_id": f"p{i}-{j}", "x": 10 * i + j} for j in range(2)]
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=SCHEMA), folder / shard_name(i))
    mark_complete(folder)
    return folder


def run(tmp_path, inputs, fault, *overrides, floor_s=None):
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    stage = Faulty(load_config(["progress=false", *overrides]), inputs, tmp_path / "out", work, fault)
    pool = RayActorPool(stage.cfg.ray, stage.cfg.workers.wait_s, stage.cfg.workers.check_timeout_s)
    if floor_s is not None:
        pool.shard_floor_s = floor_s
    return run_stage(stage, pool), stage


def all_rows_done(out: Path) -> None:
    rows = sorted((r["prompt_id"], r["x"]) for p in list_shards(out) for r in read_table(p).to_pylist())
    assert rows == sorted((f"p{i}-{j}", 2 * (10 * i + j)) for i in range(SHARDS) for j in range(2)), rows
    assert is_complete(out)


def rerun_changes_nothing(tmp_path, inputs, fault, *overrides) -> None:
    out = tmp_path / "out"
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in list_shards(out)}
    summary, _ = run(tmp_path, inputs, fault, *overrides)
    assert summary["skipped"] is True, summary
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in list_shards(out)} == before


def closing_faults(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("faults cost: ")]


def ids(out: Path) -> list:
    return [r["prompt_id"] for p in list_shards(out) for r in read_table(p, columns=["prompt_id"]).to_pylist()]


EXPECTED = [f"p{i}-{j}" for i in range(SHARDS) for j in range(2)]


@pytest.mark.faults
def test_a_worker_that_hangs_on_its_second_shard_loses_that_shard_to_the_other_and_is_restarted(
        inputs, tmp_path, ray_session, caplog, fault_row):
    caplog.set_level("INFO", logger="blockpilot")
    # The deadline: 3 x the shards' median time, at least 5 s (the default's floor is 300 s)
    summary, _ = run(tmp_path, inputs, "hang", "workers.shard_timeout_factor=3", floor_s=5.0)
    all_rows_done(tmp_path / "out")
    bad = (tmp_path / "work" / "bad-worker").read_text()
    faults = summary["faults"]
    assert [t["worker"] for t in faults["taken_back"]] == [bad] and faults["taken_back"][0]["seconds"] >= 5, faults
    assert [r["worker"] for r in faults["restarted"]] == [bad] and "hung" in faults["restarted"][0]["why"], faults
    assert "retired" not in faults, faults  # one hang, one restart: the GPU stays
    hung = faults["taken_back"][0]["shard"]
    tries = [line.split() for line in (tmp_path / "work" / "tries").read_text().splitlines()]
    # the hung shard was tried twice: by the hung worker, then by a process that is not the hung one's
    on_hung = [(w, pid) for name, w, pid in tries if name == hung]
    assert len(on_hung) == 2 and on_hung[0][0] == bad and on_hung[1] != on_hung[0], tries
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["faults"] == faults
    lines = closing_faults(caplog)
    assert len(lines) == 1 and f"1 shard(s) taken back past their deadline ({hung} from {bad} after " in lines[0] \
        and f"1 worker restart(s) ({bad})" in lines[0], lines
    rerun_changes_nothing(tmp_path, inputs, "hang")
    fault_row("one worker of 2 hangs on its second shard (no one kills it)", "faulty (synthetic)", EXPECTED,
              ids(tmp_path / "out"), fault_cost(summary))


@pytest.mark.faults
def test_a_worker_whose_shard_writes_fail_is_taken_out_and_the_other_does_its_shards(inputs, tmp_path, ray_session,
                                                                                    caplog, fault_row):
    caplog.set_level("INFO", logger="blockpilot")
    summary, _ = run(tmp_path, inputs, "write")
    all_rows_done(tmp_path / "out")
    bad = (tmp_path / "work" / "bad-worker").read_text()
    tries = [line.split() for line in (tmp_path / "work" / "tries").read_text().splitlines()]
    failed_on_bad = [name for name, w, _ in tries if w == bad]
    # two shard errors take it out (the other worker has none); every shard it failed was done by the other
    assert len(failed_on_bad) == 2, tries
    assert all(any(n == name and w != bad for n, w, _ in tries) for name in failed_on_bad), tries
    retired = summary["faults"]["retired"]
    assert [r["worker"] for r in retired] == [bad], retired
    assert retired[0]["why"].startswith("taken out: 2 of its 2 shards failed (reading or writing them), the other "
                                        "workers 0 of "), retired
    assert summary["rejects"] == 0 and summary["rows"] == 2 * SHARDS
    lines = closing_faults(caplog)
    assert len(lines) == 1 and f"1 worker(s) retired ({bad}: taken out: 2 of its 2 shards failed" in lines[0], lines
    rerun_changes_nothing(tmp_path, inputs, "write")
    fault_row("one worker of 2 fails every shard write", "faulty (synthetic)", EXPECTED, ids(tmp_path / "out"),
              fault_cost(summary))


@pytest.mark.faults
def test_one_worker_failing_its_preflight_is_left_out_when_enough_others_pass(inputs, tmp_path, ray_session, caplog,
                                                                              fault_row):
    from pipeline.executor.ray.preflight import PreflightRefused

    # the default workers.min_fraction (0.9): 1 of 2 is not enough, the preflight refuses before any work
    with pytest.raises(PreflightRefused, match="its GPU's driver does not answer"):
        run(tmp_path / "strict", inputs, "preflight")
    assert list_shards(tmp_path / "strict" / "out") == []

    caplog.set_level("INFO", logger="blockpilot")
    summary, _ = run(tmp_path, inputs, "preflight", "workers.min_fraction=0.5")
    all_rows_done(tmp_path / "out")
    left_out = summary["faults"]["left_out"]
    assert len(left_out) == 1 and left_out[0]["why"] == \
        "model.device: its GPU's driver does not answer (a test's fault)", left_out
    statuses = [w.get("status", "") for w in summary["workers"]]
    assert sum(s.startswith("left out by the preflight: model.device: its GPU's driver") for s in statuses) == 1
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("preflight: 1 of 2 workers passed")]
    assert len(warned) == 1 and "workers.min_fraction=0.5" in warned[0], warned
    lines = closing_faults(caplog)
    assert len(lines) == 1 and "1 worker(s) left out by the preflight (" in lines[0], lines
    rerun_changes_nothing(tmp_path, inputs, "preflight", "workers.min_fraction=0.5")
    fault_row("one worker of 2 fails its preflight (workers.min_fraction=0.5)", "faulty (synthetic)", EXPECTED,
              ids(tmp_path / "out"), fault_cost(summary))
