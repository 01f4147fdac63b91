"""The Ray actor pool's hand-back and timeout paths (pipeline/executor/ray/pool_run.py::PoolRun), each pinned to the path it
takes, with real actors on the session's local Ray (tests/conftest.py::ray_session: 2 fake GPUs, so 2 actors):

* a lost actor's shard is kept for it while Ray restarts it, and goes to the other actor once the lost one is gone
  for good: its restarts used up (``PoolRun.on_lost``), or its restart failed (``PoolRun.on_ping``);
* a restart not back within ``rejoin_wait_s``: its shard goes to the other actor (``PoolRun.on_timeout``);
* no live actor and only restarts pending: the pool waits ``rejoin_wait_s``, then fails what is not done
  (``PoolRun.finished``).

The tests of tests/integration/test_pool_failures.py accept either recovery of a lost shard; these say which one
happened: the pool's own lines (which hand-back, and why), and which process ran each attempt (every attempt
appends its pid to a file per shard). A restart's timing is never raced: a slow restart (its ``setup``) waits for
the event it must come after (the other actor's attempt at its shard), never for a fixed time; its deadline is only
reached by a pool that is broken.
"""

import os
import re
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray.cloudpickle

from pipeline.executor.driver import run_stage
from pipeline.executor.folder import mark_complete
from pipeline.executor.stage import Plan, Resources, ShardStage, tasks_from_shards
from pipeline.io.shards import list_shards, shard_name, write_parquet_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config
from pipeline.executor.ray.pool import RayActorPool

pytestmark = pytest.mark.integration

# The actors unpickle the stage class: this test module is not importable there (tests/ is no package).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = pa.schema([("prompt_id", pa.string()), ("x", pa.int64())])
SHARDS = [shard_name(i) for i in range(4)]
S0, S1, S2, S3 = SHARDS
BROKEN_POOL_S = 60.0  # how long a scripted wait lasts at most: only a broken pool makes one run out


def wait_until(pred) -> None:
    deadline = time.monotonic() + BROKEN_POOL_S
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)


class Restarts(ShardStage):
    """Doubles integers. Every attempt appends its pid to ``attempts/<shard>``; an actor's crash appends its actor id
    to ``crashes`` (an actor keeps its id across Ray's restarts), then kills its process.

    ``crash_first``: shards whose first attempt kills its actor. ``crash_scarred``: shards that kill an actor that
    has crashed before. ``hold``: shard -> the number of crashes it waits for before it finishes. ``restart``: what a
    restarted actor's setup does: "" (sets up), "fails" (raises), "after-retry" (waits for the second attempt at the
    shard it crashed on), "hangs" (waits until it is killed, or BROKEN_POOL_S)."""

    name = "scripted"

    def __init__(self, cfg, inputs: Path, folder: Path, work: Path, crash_first=(), crash_scarred=(), hold=None,
                 restart=""):
        super().__init__(cfg, folder)
        self.inputs, self.attempts, self.crashes = inputs, work / "attempts", work / "crashes"
        self.crash_first, self.crash_scarred = set(crash_first), set(crash_scarred)
        self.hold, self.restart = dict(hold or {}), restart

    def fingerprint(self):
        return {"double": True}

    def plan(self):
        return Plan(tasks_from_shards(self.inputs))

    def resources(self):
        return Resources(actors=True, num_workers=2, cpus_per_worker=0.5, max_retries=1)

    def crashed(self) -> list:
        return self.crashes.read_text().splitlines() if self.crashes.exists() else []

    def tried(self, name: str) -> list:
        return (self.attempts / name).read_text().splitlines() if (self.attempts / name).exists() else []

    def setup(self, worker):
        me = ray.get_runtime_context().get_actor_id()
        if me not in self.crashed():  # a first start
            return
        if self.restart == "fails":
            raise RuntimeError("scripted: this restart fails")
        if self.restart == "after-retry":  # back only once its lost shard's next attempt has begun elsewhere
            shard = [n for n in SHARDS if self.tried(n) and n in self.crash_first][0]
            wait_until(lambda: len(self.tried(shard)) >= 2)
        if self.restart == "hangs":
            wait_until(lambda: False)

    def process_shard(self, input, rejects):
        name, me = Path(input).name, ray.get_runtime_context().get_actor_id()
        with open(self.attempts / name, "a") as f:  # closed (on disk) before a crash below
            f.write(f"{os.getpid()}\n")
        if (name in self.crash_first and len(self.tried(name)) == 1) or \
                (name in self.crash_scarred and me in self.crashed()):
            with open(self.crashes, "a") as f:
                f.write(f"{me}\n")
            os._exit(1)
        if name in self.hold:
            wait_until(lambda: len(self.crashed()) >= self.hold[name])
        rows = read_table(input).to_pylist()
        return pa.table({"prompt_id": [r["prompt_id"] for r in rows], "x": [2 * r["x"] for r in rows]},
                        schema=SCHEMA)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pool-timeout-inputs")
    for i, name in enumerate(SHARDS):
        rows = [{"prompt_id": f"p{i}-{j}", "x": 10 * i + j} for j in range(2)]
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=SCHEMA), folder / name)
    mark_complete(folder)
    return folder


def run_restarts(root: Path, inputs: Path, rejoin_wait_s: float, **script):
    """Run the stage through the real driver on a pool with these waits; returns (error or None, the pids of each
    shard's attempts, the pool's warnings, the shards written)."""
    out, work = root / "out", root / "work"
    (work / "attempts").mkdir(parents=True)
    stage = Restarts(load_config(["progress=false"]), inputs, out, work, **script)
    pool = RayActorPool(stage.cfg.ray)
    pool.rejoin_wait_s, pool.poll_s = rejoin_wait_s, 0.1
    try:
        run_stage(stage, pool)
        error = None
    except RuntimeError as err:
        error = str(err)
    pids = {n: [int(p) for p in stage.tried(n)] for n in SHARDS}
    return error, pids, [p.name for p in list_shards(out)]


def warnings(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("blockpilot")]


def handed_back(lines: list) -> list:
    return [re.sub(r"worker \S+ ", "worker W ", x) for x in lines if " goes to another worker: " in x]


def test_a_lost_shard_goes_to_the_other_actor_once_its_own_has_no_restart_left(inputs, tmp_path, ray_session,
                                                                              caplog):
    # Actor A (part-00000's) crashes on part-00000, is restarted and runs it again (the shard was kept for it), then
    # takes part-00002 and crashes again: max_restarts=1 used up. B holds on to part-00001 until that second crash,
    # so A is the one to take part-00002; part-00002 then has an attempt left, and it goes to B.
    caplog.set_level("WARNING", logger="blockpilot")
    error, pids, written = run_restarts(tmp_path, inputs, 120.0, crash_first={S0}, crash_scarred={S2},
                                        hold={S1: 2})
    assert error is None and written == SHARDS, error
    a_first, a_restarted = pids[S0]
    b = pids[S1][0]
    assert a_first != a_restarted and b not in (a_first, a_restarted), pids
    assert pids[S2] == [a_restarted, b], pids  # lost with A's restart, then run by B
    lines = warnings(caplog)
    assert handed_back(lines) == [f"{S2} goes to another worker: worker W is gone for good"], lines
    dropped = [x for x in lines if "no restart left" in x]
    assert len(dropped) == 1 and dropped[0].startswith(f"{S2} lost: worker ") and \
        dropped[0].endswith("(max_restarts=1); dropped, 1 worker(s) left"), dropped


def test_a_lost_shard_goes_to_the_other_actor_when_its_own_restart_fails(inputs, tmp_path, ray_session, caplog):
    # A crashes on part-00000; its restart's setup raises, so Ray gives up on it and A's ping says so (ActorDiedError).
    caplog.set_level("WARNING", logger="blockpilot")
    error, pids, written = run_restarts(tmp_path, inputs, 120.0, crash_first={S0}, restart="fails")
    assert error is None and written == SHARDS, error
    b = pids[S1][0]
    assert pids[S0][1] == b and pids[S0][0] != b and len(pids[S0]) == 2, pids
    lines = warnings(caplog)
    assert handed_back(lines) == [f"{S0} goes to another worker: worker W is gone for good"], lines
    dropped = [x for x in lines if "no restart left" in x]
    assert len(dropped) == 1 and dropped[0].startswith(f"{S0} lost: worker "), dropped


def test_a_restart_not_back_within_rejoin_wait_s_hands_its_shard_to_the_other_actor(inputs, tmp_path, ray_session,
                                                                                   caplog):
    # A crashes on part-00000; its restart is back only once part-00000's second attempt has begun on B, which a
    # pool that kept the shard for A past rejoin_wait_s would never start.
    caplog.set_level("WARNING", logger="blockpilot")
    error, pids, written = run_restarts(tmp_path, inputs, 0.5, crash_first={S0}, restart="after-retry")
    assert error is None and written == SHARDS, error
    a, b = pids[S0][0], pids[S1][0]
    assert a != b and pids[S0] == [a, b], pids
    lines = warnings(caplog)
    assert handed_back(lines) == [f"{S0} goes to another worker: worker W is not back 0.5 s after it was lost"], lines
    assert not [x for x in lines if "no restart left" in x], lines


def test_only_restarts_pending_waits_rejoin_wait_s_then_fails_what_is_not_done(inputs, tmp_path, ray_session,
                                                                            caplog):
    # Both actors crash on their first shards and their restarts never come back: no live actor is left, and the
    # pool ends once both have been lost for rejoin_wait_s, without waiting for their restarts.
    caplog.set_level("WARNING", logger="blockpilot")
    error, pids, written = run_restarts(tmp_path, inputs, 0.5, crash_first={S0, S1}, restart="hangs")
    assert written == [] and [len(pids[n]) for n in SHARDS] == [1, 1, 0, 0], (pids, written)
    prefix = "scripted: 4 shard(s) failed after retries: "
    assert error is not None and error.startswith(prefix), error
    failed = dict(f.split(": ", 1) for f in error[len(prefix):].split("; "))
    assert failed == {n: "not run: no worker left (0 dropped, their restarts used up, 2 not back within 0.5 s of "
                         "a restart)" for n in SHARDS}, error
    lines = warnings(caplog)
    assert not handed_back(lines) and not [x for x in lines if "no restart left" in x], lines
