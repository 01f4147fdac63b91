"""One writer per stage folder (issue #25, item 3): the lease.

The first writer is a real second process running the real driver on the toy stage of test_driver.py; it stops
inside a shard with a temp file of its own in the folder (as a writer mid-write has) and waits for the test's go.
While it lives, a run of the same folder refuses, naming it, and its temp file stays; killed, its lease is taken
over and the log says why. An owner on another host cannot exist here, so that lease is a file written by the
test; its heartbeat decides. The same against the S3 test server (conditional PUTs).
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.executor.driver import run_stage
from pipeline.executor.lease import EXPIRY_SECONDS, Lease, LeaseHeld
from pipeline.executor.local import LocalExecutor
from pipeline.io.exclusive import exclusive_file
from pipeline.io.layout import LEASE, LEASE_LOCK
from pipeline.io.shards import is_complete, list_shards
from pipeline.io.storage import location

from test_driver import Squares, cfg_for, inputs, make_inputs, run  # noqa: F401 - inputs is a fixture

UNIT = Path(__file__).resolve().parent
LIVE_TMP = ".part-00001.parquet.tmp-11ve0001"  # the first writer's temp file, named as write_parquet_atomic names

# The first writer: the driver on the toy stage, held inside shard part-00001 until the test says go.
WRITER = """
import sys, time
from pathlib import Path
from pipeline.io.storage import location
from test_driver import Squares, cfg_for, run

inputs, out, signals = sys.argv[1], sys.argv[2], Path(sys.argv[3])

class Held(Squares):
    def process_shard(self, input, rejects):
        if location(input).name == "part-00001.parquet":
            tmp = location(out) / "{tmp}"
            tmp.write_bytes(b"half a shard")  # a write in progress
            (signals / "ready").write_text("")
            deadline = time.monotonic() + 120
            while not (signals / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            tmp.unlink()
        return super().process_shard(input, rejects)

run(Held(cfg_for(), inputs, out))
""".replace("{tmp}", LIVE_TMP)


class Writer:
    def __init__(self, inputs, out, signals: Path):
        signals.mkdir()
        self.signals = signals
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(UNIT), str(UNIT.parents[1])])}
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(inputs), str(out), str(signals)], env=env,
                                     cwd=UNIT.parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120  # a bound for a broken writer, not a timing assert
        while not (signals / "ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"the first writer never reached its shard:\n{self.proc.communicate()[0]}")
            time.sleep(0.02)

    def finish(self) -> int:
        (self.signals / "go").write_text("")
        output, _ = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, output
        return self.proc.returncode

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)  # our own child, by pid
        self.proc.communicate(timeout=60)


def owner_line(pid: int) -> str:
    return f"squares run pid {pid} on host {socket.gethostname()}"


@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_a_second_run_refuses_naming_the_owner_and_leaves_its_temp_file(tmp_path, inputs):
    out = tmp_path / "squares"
    writer = Writer(inputs, out, tmp_path / "signals")
    lease = json.loads((out / LEASE).read_text())
    assert (lease["host"], lease["pid"], lease["stage"]) == (socket.gethostname(), writer.proc.pid, "squares")
    assert lease["started"] <= lease["heartbeat"]
    second = Squares(cfg_for(), inputs, out)
    with pytest.raises(LeaseHeld, match=owner_line(writer.proc.pid)):
        run(second)
    assert second.calls == [] and (out / LIVE_TMP).exists()  # the live writer's temp file is still there
    writer.finish()
    assert is_complete(out) and not (out / LEASE).exists()  # it completed, and gave the lease back
    assert run(Squares(cfg_for(), inputs, out))["skipped"]


@pytest.mark.faults
@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_a_dead_owners_lease_is_taken_over_and_the_log_says_so(tmp_path, inputs, caplog, fault_row):
    out = tmp_path / "squares"
    writer = Writer(inputs, out, tmp_path / "signals")
    pid = writer.proc.pid
    writer.kill()  # SIGKILL inside a shard: its lease and its temp file stay behind
    assert json.loads((out / LEASE).read_text())["pid"] == pid and (out / LIVE_TMP).exists()
    again = Squares(cfg_for(), inputs, out)
    with caplog.at_level(logging.WARNING, logger="blockpilot"):
        summary = run(again)
    took = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
    assert len(took) == 1 and took[0].startswith(f"took over the lease of {out} from {owner_line(pid)} (started ")
    assert took[0].endswith(f": pid {pid} is not running on {socket.gethostname()}")
    run(Squares(cfg_for(), inputs, tmp_path / "reference"))
    fault_row("the writer SIGKILLed holding its lease, rerun", "squares (synthetic)",
              *([i for f in sorted(d.glob("part-*.parquet")) for i in pq.read_table(f)["prompt_id"].to_pylist()]
                for d in (tmp_path / "reference", out)))
    assert again.calls == ["part-00001.parquet", "part-00002.parquet"]  # the dead writer's first shard is kept
    assert summary["rows"] == 7 and not (out / LIVE_TMP).exists() and not (out / LEASE).exists()


def foreign_lease(folder, heartbeat_age: float) -> None:
    """The lease of a run on another host (which cannot exist in a test), last heard of ``heartbeat_age`` ago."""
    now = time.time()
    location(folder).mkdir(parents=True, exist_ok=True)
    data = json.dumps({
        "host": "other-host.example", "pid": 4242, "process_start": "1", "stage": "squares", "token": "t" * 32,
        "started": now - heartbeat_age - 60, "heartbeat": now - heartbeat_age, "folder": str(folder)}).encode()
    # Written as another run writes it: created, or swapped in under the lease lock. A plain write beside a live
    # heartbeat could land between its read and its replace and be overwritten (the heartbeat then never notices).
    store = exclusive_file(location(folder) / LEASE, LEASE_LOCK)
    while True:
        held = store.read()
        if (store.create(data) if held is None else store.replace(data, held[1])) is not None:
            return


def test_another_hosts_lease_holds_while_it_beats_and_is_taken_over_once_expired(tmp_path, inputs, caplog):
    out = tmp_path / "squares"
    foreign_lease(out, heartbeat_age=1.0)
    with pytest.raises(LeaseHeld, match="squares run pid 4242 on host other-host.example"):
        run(Squares(cfg_for(), inputs, out))
    assert not list_shards(out)
    foreign_lease(out, heartbeat_age=EXPIRY_SECONDS + 60)
    with caplog.at_level(logging.WARNING, logger="blockpilot"):
        assert run(Squares(cfg_for(), inputs, out))["rows"] == 7
    took = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
    assert len(took) == 1 and "pid 4242 on host other-host.example" in took[0] and "no heartbeat for" in took[0]


def read_lease(folder) -> dict:
    return json.loads((location(folder) / LEASE).read_text())


def test_the_heartbeat_renews_the_lease_and_notices_when_it_is_lost(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    lease = Lease(folder, "squares", heartbeat_s=0.02).acquire()
    first = read_lease(folder)
    deadline = time.monotonic() + 60
    while read_lease(folder)["heartbeat"] == first["heartbeat"] and time.monotonic() < deadline:
        time.sleep(0.01)
    now = read_lease(folder)
    assert now["heartbeat"] > first["heartbeat"] and now["token"] == first["token"] and now["started"] == \
        first["started"]
    lease.check()  # still ours
    foreign_lease(folder, heartbeat_age=0.0)  # another run took it over (as after an expiry)
    while lease.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(LeaseHeld, match="lost its lease.*other-host.example"):
        lease.check()
    lease.release()
    assert read_lease(folder)["host"] == "other-host.example"  # a lost lease is not deleted: it is the other's


# ---- object storage: the same through conditional PUTs on the S3 test server ---------------------------------------

HOLDER = """
import sys
from pipeline.executor.lease import Lease
Lease(sys.argv[1], "squares").acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes it or kills us
"""


@pytest.mark.integration  # the integration layer: a fresh interpreter of its own (tests/conftest.py)
def test_the_lease_on_s3_refuses_a_second_writer_and_is_taken_over_from_a_dead_one(s3_bucket, caplog):
    inputs = make_inputs(location(s3_bucket) / "inputs")
    out = f"{s3_bucket}/squares"
    env = {**os.environ, "PYTHONPATH": str(UNIT.parents[1])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, out], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.communicate(timeout=60)[0]
        assert read_lease(out)["pid"] == holder.pid
        second = Squares(cfg_for(), inputs, out)
        with pytest.raises(LeaseHeld, match=owner_line(holder.pid)):
            run_stage(second, LocalExecutor())
        assert second.calls == [] and not list_shards(out)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # our own child, by pid: its lease stays in the bucket
        holder.communicate(timeout=60)
    assert read_lease(out)["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="blockpilot"):
        assert run_stage(Squares(cfg_for(), inputs, out), LocalExecutor())["rows"] == 7
    took = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
    assert len(took) == 1 and f"pid {holder.pid} is not running" in took[0]
    assert is_complete(out) and not (location(out) / LEASE).exists()


def test_the_lease_on_s3_is_created_exclusively(s3_bucket):
    folder = f"{s3_bucket}/f"
    foreign_lease(folder, heartbeat_age=1.0)
    store = Lease(folder, "squares").store
    assert store.create(b"{}") is None  # If-None-Match: * refused: the object exists
    data, etag = store.read()
    assert json.loads(data)["host"] == "other-host.example"
    assert store.replace(b"{}", '"0123456789abcdef0123456789abcdef"') is None  # If-Match on a stale ETag refused
    assert json.loads(store.read()[0])["host"] == "other-host.example"
    new = store.replace(b'{"host": "me"}', etag)
    assert new is not None and new != etag and store.read() == (b'{"host": "me"}', new)
    assert not store.delete(etag) and store.delete(new) and store.read() is None
