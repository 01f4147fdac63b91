"""Every failure path of the Ray actor pool (pipeline/executor/ray/pool.py::RayActorPool) against LocalExecutor's, with real
actors on the session's local Ray (tests/conftest.py::ray_session: 2 fake GPUs, so 2 actors):

* a shard whose process_shard raises is retried up to ``max_retries`` and failed after it, exactly as LocalExecutor
  does it (same shards done and failed, same attempts, same logged attempts, same error);
* an actor that dies (``os._exit`` in process_shard) more than ``max_restarts`` times is dropped, its shard fails,
  the other actor carries on;
* every actor gone for good: the shards not done fail with "no worker left", each named in the user's error.

A tiny synthetic stage (no models): each attempt appends a line to a file per shard, so attempts are counted across
the actors' processes, and its outcome is scripted per shard.
"""

import os
import re
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import ray.cloudpickle

from pipeline.executor.driver import run_stage
from pipeline.executor.folder import mark_complete
from pipeline.executor.local import LocalExecutor
from pipeline.executor.stage import Plan, Resources, ShardStage, tasks_from_shards
from pipeline.io.shards import is_complete, list_shards, shard_name, write_parquet_atomic
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config
from pipeline.executor.ray.pool import RayActorPool

pytestmark = pytest.mark.integration

# The actors unpickle the stage class: this test module is not importable there (tests/ is no package).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = pa.schema([("prompt_id", pa.string()), ("x", pa.int64())])
SHARDS = [shard_name(i) for i in range(4)]


class Scripted(ShardStage):
    """Doubles integers; ``raises[shard]`` = how many of its first attempts raise, ``crash`` = shards whose every
    attempt kills the worker process."""

    name = "scripted"

    def __init__(self, cfg, inputs: Path, folder: Path, attempts: Path, retries: int, raises=None, crash=(),
                 setup_error=None):
        super().__init__(cfg, folder)
        self.inputs, self.attempts, self.retries = inputs, attempts, retries
        self.raises, self.crash, self.setup_error = dict(raises or {}), set(crash), setup_error

    def setup(self, worker):
        if self.setup_error:  # what a hub error or an out-of-memory while loading looks like to the pool
            raise OSError(self.setup_error)

    def fingerprint(self):
        return {"double": True}

    def plan(self):
        return Plan(tasks_from_shards(self.inputs))

    workers = 2

    def resources(self):
        return Resources(actors=True, num_workers=self.workers, cpus_per_worker=0.5, max_retries=self.retries,
                         workers_key="scripted.num_workers")

    def process_shard(self, input, rejects):
        name = Path(input).name
        with open(self.attempts / name, "a") as f:  # closed (on disk) before a crash below
            f.write(f"{os.getpid()}\n")
        attempt = len((self.attempts / name).read_text().splitlines())
        if name in self.crash:
            os._exit(1)
        if attempt <= self.raises.get(name, 0):
            raise OSError(f"disk on fire while writing {name}")
        rows = read_table(input).to_pylist()
        return pa.table({"prompt_id": [r["prompt_id"] for r in rows], "x": [2 * r["x"] for r in rows]},
                        schema=SCHEMA)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pool-inputs")
    for i, name in enumerate(SHARDS):
        rows = [{"prompt_id": f"p{i}-{j}", "x": 10 * i + j} for j in range(2)]
        write_parquet_atomic(pa.Table.from_pylist(rows, schema=SCHEMA), folder / name)
    mark_complete(folder)
    return folder


def run_scripted(root: Path, inputs: Path, executor_for, progress=False, **script):
    """Run the stage through the real driver; returns (error message or None, attempts per shard, output)."""
    out, attempts = root / "out", root / "attempts"
    attempts.mkdir(parents=True)
    stage = Scripted(load_config([f"progress={str(progress).lower()}"]), inputs, out, attempts, **script)
    try:
        run_stage(stage, executor_for(stage))
        error = None
    except RuntimeError as err:
        error = str(err)
    counts = {n: len((attempts / n).read_text().splitlines()) if (attempts / n).exists() else 0 for n in SHARDS}
    return error, counts, out


def pool(stage):
    return RayActorPool(stage.cfg.ray)


def rows(out: Path):
    return {p.name: read_table(p).to_pylist() for p in list_shards(out)}


def attempt_lines(caplog):
    return sorted(r.getMessage() for r in caplog.records if " attempt " in r.getMessage())


def test_a_raising_shard_is_retried_to_the_limit_like_local(inputs, tmp_path, ray_session, caplog):
    # part-00001 raises once then succeeds; part-00002 raises on every attempt.
    script = dict(retries=2, raises={"part-00001.parquet": 1, "part-00002.parquet": 99})
    caplog.set_level("WARNING", logger="blockpilot")
    local = run_scripted(tmp_path / "local", inputs, lambda s: LocalExecutor(s.resources().max_retries), **script)
    local_lines = attempt_lines(caplog)
    caplog.clear()
    ray_run = run_scripted(tmp_path / "pool", inputs, pool, **script)
    pool_lines = attempt_lines(caplog)

    expected_error = ("scripted: 1 shard(s) failed after retries: "
                      "part-00002.parquet: OSError: disk on fire while writing part-00002.parquet")
    expected_attempts = {"part-00000.parquet": 1, "part-00001.parquet": 2, "part-00002.parquet": 3,
                         "part-00003.parquet": 1}
    for error, counts, out in (local, ray_run):
        assert error == expected_error
        assert counts == expected_attempts
        assert [p.name for p in list_shards(out)] == ["part-00000.parquet", "part-00001.parquet",
                                                      "part-00003.parquet"]
        assert not is_complete(out)
    assert rows(ray_run[2]) == rows(local[2])
    assert len(pool_lines) == 4 and pool_lines == local_lines, (pool_lines, local_lines)
    assert "part-00002.parquet attempt 3/3 failed: OSError: disk on fire while writing part-00002.parquet" \
        in pool_lines


def test_an_actor_past_its_restarts_is_dropped_and_the_other_carries_on(inputs, tmp_path, ray_session, caplog):
    caplog.set_level("WARNING", logger="blockpilot")
    error, counts, out = run_scripted(tmp_path, inputs, pool, retries=1, crash={"part-00001.parquet"})
    # One start and max_restarts=1 restart ran the shard, each killed its actor; then the actor was gone.
    assert counts == {"part-00000.parquet": 1, "part-00001.parquet": 2, "part-00002.parquet": 1,
                      "part-00003.parquet": 1}
    assert error is not None and re.fullmatch(
        r"scripted: 1 shard\(s\) failed after retries: part-00001\.parquet: ActorDiedError: .*", error), error
    assert [p.name for p in list_shards(out)] == ["part-00000.parquet", "part-00002.parquet", "part-00003.parquet"]
    assert rows(out)["part-00003.parquet"] == [{"prompt_id": "p3-0", "x": 60}, {"prompt_id": "p3-1", "x": 62}]
    dropped = [r.getMessage() for r in caplog.records if "no restart left" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].startswith("part-00001.parquet failed: worker ") and \
        dropped[0].endswith("(max_restarts=1); dropped, 1 worker(s) left"), dropped


def test_no_worker_left_names_every_shard_not_done(inputs, tmp_path, ray_session, caplog):
    # Every shard kills its actor and there is no restart: the two actors die on the first two shards.
    caplog.set_level("INFO", logger="blockpilot")
    error, counts, out = run_scripted(tmp_path, inputs, pool, progress=True, retries=0, crash=set(SHARDS))
    assert counts == {"part-00000.parquet": 1, "part-00001.parquet": 1, "part-00002.parquet": 0,
                      "part-00003.parquet": 0}
    prefix = "scripted: 4 shard(s) failed after retries: "
    assert error is not None and error.startswith(prefix), error
    failed = dict(f.split(": ", 1) for f in error[len(prefix):].split("; "))  # shard -> why, for every shard
    assert sorted(failed) == SHARDS, error
    assert failed["part-00000.parquet"].startswith("ActorDiedError: ")
    assert failed["part-00001.parquet"].startswith("ActorDiedError: ")
    for name in ("part-00002.parquet", "part-00003.parquet"):
        assert failed[name] == "not run: no worker left (2 dropped, their restarts used up)", error
    assert list_shards(out) == [] and not is_complete(out)
    # Each shard not done got its FAILED progress line too (the executor's done callback, as LocalExecutor calls
    # it for every failed shard), so the progress reaches 8/8 rows.
    progress = [r.getMessage() for r in caplog.records if " FAILED: " in r.getMessage()]
    assert sorted(re.search(r"(part-\d+\.parquet) FAILED", m).group(1) for m in progress) == SHARDS, progress
    assert progress[-1].startswith("8/8 rows ") and progress[-1].endswith(
        " FAILED: not run: no worker left (2 dropped, their restarts used up)"), progress


@pytest.mark.timeout(300)
def test_no_worker_that_can_start_fails_the_stage_with_the_setup_error(inputs, tmp_path, ray_session, caplog):
    # Both actors' setups raise on the one node there is: no other node can take a worker, so the stage fails at
    # once, saying why, and nothing is written. "At once" is not timed: workers.wait_s is an hour here, so a pool
    # that waited it out (for a node that might join) would run into this test's 300 s timeout and fail.
    caplog.set_level("WARNING", logger="blockpilot")
    error, counts, out = run_scripted(tmp_path, inputs, lambda stage: RayActorPool(stage.cfg.ray, wait_s=3600.0),
                                      retries=1, setup_error="hub unreachable: 503")
    assert error is not None and error.startswith("scripted: no worker could start (node "), error
    assert "OSError: hub unreachable: 503" in error, error
    assert sum(counts.values()) == 0 and list_shards(out) == [] and not is_complete(out)
    failed = [r.getMessage() for r in caplog.records if "could not set up" in r.getMessage()]
    assert len(failed) == 2 and all("OSError: hub unreachable: 503" in m for m in failed), failed
    assert all(m.endswith("no other node can take a worker") for m in failed), failed


def test_workers_that_never_start_are_waited_for_then_refused_naming_the_key(inputs, tmp_path, ray_session, caplog):
    # Three workers of one GPU each on a Ray with two (GPUs held elsewhere, pods not joined): the third stays
    # pending; the preflight says so every progress_s and refuses after wait_s, before any shard, naming the key.
    from pipeline.executor.ray.preflight import PreflightRefused

    caplog.set_level("INFO", logger="blockpilot")
    stage = Scripted(load_config(["progress=false"]), inputs, tmp_path / "out", tmp_path, retries=0)
    stage.workers = 3
    # How many of the two that fit are up by a given second depends on the machine's load: the lines may count 0,
    # 1 or 2 of 3, never 3, and the refusal names whichever worker Ray left pending.
    p = RayActorPool(stage.cfg.ray, wait_s=6.0)
    p.progress_s = 1.0
    with pytest.raises(PreflightRefused) as refused:
        run_stage(stage, p)
    # one worker refused, under the key that asks for fewer workers, because it never started within wait_s
    assert [(k, m.split(":")[0]) for _, k, m in refused.value.problems] == \
        [("scripted.num_workers", "not started within workers.wait_s=6 s")], refused.value.problems
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for workers: ")]
    counts = [re.match(r"waiting for workers: (\d)/3 checked, (\d) checking, (\d) not started(?:, (\d) given up)? "
                       r"after \d+ s ", m) for m in waiting]
    assert counts and all(c for c in counts), waiting
    counts = [[int(n or 0) for n in c.groups()] for c in counts]
    # every worker is in exactly one group; the one that cannot start is never "checked": it is still waited for,
    # or, on a machine so loaded that the line falls after wait_s while the others still check, given up on
    assert all(sum(c) == 3 and c[0] < 3 and c[2] + c[3] >= 1 for c in counts), waiting
    assert list_shards(tmp_path / "out") == [] and not any(tmp_path.glob("*.parquet"))


class SlowChecks(Scripted):
    """Scripted, whose workers' preflight checks take a minute (a large local model folder hashed, storage slow):
    the stage, unpickled in the actor, slows the checks there."""

    def __setstate__(self, state):
        self.__dict__.update(state)
        import time

        import pipeline.executor.preflight as checks

        quick = checks.check_worker
        checks.check_worker = lambda *a, **k: time.sleep(60) or quick(*a, **k)


def test_workers_still_checking_are_told_apart_from_workers_not_started(inputs, tmp_path, ray_session, caplog):
    # Both workers start at once (two fake GPUs) and check for a minute; workers.check_timeout_s is 3 s and
    # workers.wait_s an hour: they are refused as still checking, under their own key, well before the hour. Before,
    # one wait clock covered both, and a worker still checking was reported "not started".
    from pipeline.executor.ray.preflight import PreflightRefused

    stage = SlowChecks(load_config(["progress=false"]), inputs, tmp_path / "out", tmp_path, retries=0)
    with pytest.raises(PreflightRefused) as refused:
        run_stage(stage, RayActorPool(stage.cfg.ray, wait_s=3600.0, check_s=3.0))
    problems = [(k, m.split(" (")[0]) for _, k, m in refused.value.problems]
    assert problems == [("workers.check_timeout_s", "started, but its checks did not finish within "
                                                    "workers.check_timeout_s=3 s")], problems  # said once for both
    assert list_shards(tmp_path / "out") == []


def test_probe_reads_that_do_not_answer_are_given_up_on_after_the_check_timeout(ray_session):
    from pipeline.executor.ray.preflight import _reads

    @ray_session.remote
    def read(wait):
        import time

        time.sleep(wait)
        return []

    # a worker process started first: the quick read must not wait for one to start (on a loaded 2-core machine a
    # fresh worker took over the 3 s timeout, and the quick read came back None: a flake, 2026-12-05)
    ray_session.get([read.remote(0), read.remote(0)])
    assert _reads(ray_session, [read.remote(0), read.remote(120)], timeout=3.0) == [[], None]
