"""A failing object store (#25, item 6): a fault-injecting proxy (tests/fault_proxy.py) on 127.0.0.1 between the
stages and the S3 test server (moto, tests/conftest.py). It answers 5xx (503 SlowDown, 500 InternalError), resets
connections (before and halfway through a PUT body), stalls requests past the client's read timeout, loses the
answer to a PUT the server did, and cuts an upload halfway, each for a bounded count, and counts what it injected:
every test asserts that each of its faults fired as often as it was set to, so a test whose faults never fire fails.

* prepare, label and train complete through such faults, retried by the storage client, and lose nothing;
* a store that stays down (503 for everything, or its port closed) fails the stage with one line naming the store
  and the folder, and a rerun once it is back completes with the rows of a fault-free run;
* a label shard whose upload is cut halfway and whose writer is then killed leaves no object that resume would take
  for complete: the rerun redoes that shard alone;
* a lost answer to one of the lease's conditional PUTs (retried by the client, refused on the run's own write) keeps
  the lease.

The storage client is s3fs's (pipeline/io/storage.py): botocore retries 5xx, resets and timeouts (5 attempts), s3fs
retries throttling and timeouts on top, with a 15 s read timeout. The tests keep those retries but shorten the read
timeout to READ_TIMEOUT, so that a stall costs seconds: through fsspec's own configuration, which every UPath the
stages make picks up (``fsspec.config.conf`` in this process, ``FSSPEC_S3`` in the environment of a subprocess and
of the Ray workers it starts). Prepare and label run in this process (the driver and LocalExecutor: the same stage,
driver and storage code as a Ray actor runs, without Ray's start-up), train as the CLI with its own local Ray.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import uuid
from collections import Counter

import fsspec.config
import pyarrow as pa
import pytest

from pipeline.data.validate import validate_dataset
from pipeline.executor.driver import run_stage
from pipeline.io.shards import is_complete, list_shards
from pipeline.io.storage import location, read_table
from pipeline.runtime.config import load_config
from stages.label import LabelStage
from stages.prepare import PrepareStage

from fault_proxy import FaultProxy

from conftest import ONE_SOURCE

from .conftest import PYTHON, REPO, Run, blockpilot
from .test_faults import FAST_TRAIN_POLL, MEASURED_COLUMNS

READ_TIMEOUT = 3  # seconds: the client's read timeout here (s3fs's default is 15); a stall must outlast it
SHARDS, PROMPTS = 2, 8
SMALL = ["progress=false", "decode.max_new_tokens=16", "prepare.shard_size=4", f"prepare.limit={PROMPTS}",
         "label.k=2", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
         "profile.context_lengths=[16]", *ONE_SOURCE]
TRAIN = ["ray.address=local", "train.model=mlp", "train.epochs=2", "train.hidden=32", "train.batch_size=4",
         "train.use_gpu=false", "train.checkpoint_every=1"]
# The label stage's driver in a process of its own, to be killed mid-upload (LocalExecutor: no Ray to start).
LABEL_SCRIPT = ("import sys, torch; torch.set_num_threads(1); from pipeline.runtime.config import load_config; "
                "from pipeline.executor.driver import run_stage; from stages.label import LabelStage; "
                "run_stage(LabelStage(load_config(sys.argv[1:])))")


# ---- helpers ---------------------------------------------------------------------------------------------------------

def use_store(mp: pytest.MonkeyPatch, server, endpoint: str, **config) -> None:
    """Point this process and its subprocesses at ``endpoint`` (the proxy, or moto itself) with the test's client
    settings. The endpoint goes into fsspec's config too: it is then part of the filesystem's cache key, so no
    s3fs instance made earlier for another endpoint is reused."""
    for k, v in server.env.items():
        mp.setenv(k, v)
    mp.setenv("AWS_ENDPOINT_URL", endpoint)
    conf = {"endpoint_url": endpoint, "config_kwargs": {"read_timeout": READ_TIMEOUT, **config}}
    mp.setitem(fsspec.config.conf, "s3", conf)
    mp.setenv("FSSPEC_S3", json.dumps(conf))


def in_process(out: str, *stages) -> list:
    import torch

    cfg = load_config([f"output_dir={out}", *SMALL])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny pair gains nothing from more threads; on a busy 2-core box they spin
    try:
        return [run_stage(stage(cfg)) for stage in stages]
    finally:
        torch.set_num_threads(threads)


def table(folder) -> pa.Table:
    return pa.concat_tables([read_table(p) for p in list_shards(folder)])


def ids(folder) -> list:
    """Every row's prompt_id, in shard order, duplicates kept."""
    return table(folder)["prompt_id"].to_pylist()


def deterministic(t: pa.Table) -> dict:
    """Every column but the measured ones (wall seconds, the worker, the cost-aware label), logits included."""
    return {n: t[n].to_pylist() for n in t.column_names if n not in MEASURED_COLUMNS}


def objects(server, prefix: str) -> dict:
    """key -> ETag of every object under ``prefix`` ("bucket/key-prefix"), straight from moto (not the proxy)."""
    import boto3

    bucket, key = prefix.split("/", 1)
    s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="testing",
                      aws_secret_access_key="testing", region_name="us-east-1")
    found = s3.list_objects_v2(Bucket=bucket, Prefix=key + "/").get("Contents", [])
    return {o["Key"][len(key) + 1:]: o["ETag"] for o in found}


def assert_fired_and_retried(proxy: FaultProxy, fault) -> None:
    """The fault fired exactly its count, and every request it hit was retried until the server answered 2xx."""
    assert fault.fired == fault.count, (fault, proxy.log)
    for hit in set(fault.targets):
        method, target = hit.split(" ", 1)
        answers = [o for m, t, o in proxy.log if m == method and t == target]
        assert answers and answers[-1].isdigit() and 200 <= int(answers[-1]) < 300, (fault, hit, answers)
    if fault.kind == "stall":  # the client gave up on each stall (its read timeout), not the proxy
        assert fault.timed_out == fault.fired, fault


def shard_attempts_failed(caplog) -> list:
    return [r.getMessage() for r in caplog.records if "attempt" in r.getMessage() and "failed" in r.getMessage()]


# ---- fixtures --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store(s3_server) -> str:
    return s3_server.bucket(f"store-faults-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def reference(s3_server, store) -> dict:
    """A fault-free prepare + label, straight to moto: the rows every faulted run must end with."""
    out = f"{store}/reference"
    with pytest.MonkeyPatch.context() as mp:
        use_store(mp, s3_server, s3_server.endpoint)
        in_process(out, PrepareStage, LabelStage)
        prompts, labels = table(location(out) / "prompts"), table(location(out) / "labels")
    assert prompts.num_rows == labels.num_rows == PROMPTS and len(set(prompts["prompt_id"].to_pylist())) == PROMPTS
    return {"prompts": prompts, "labels": labels}


# ---- (a) bounded faults: retried, nothing lost -----------------------------------------------------------------------

@pytest.mark.faults
def test_prepare_label_and_train_complete_through_5xx_resets_stalls_and_lost_responses(
        s3_server, store, reference, monkeypatch, caplog, fault_row):
    out = f"{store}/bounded"
    prompts, labels, train = (location(out) / name for name in ("prompts", "labels", "train"))
    caplog.set_level("INFO", logger="blockpilot")
    with FaultProxy(s3_server.endpoint) as proxy:
        use_store(monkeypatch, s3_server, proxy.endpoint)
        faults = [
            proxy.add("status", "PUT", r"/prompts/part-00001\.parquet$", count=2, status=503, code="SlowDown"),
            proxy.add("reset", "PUT", r"/prompts/manifest\.json$", count=2, at=0.5),
            proxy.add("status", "GET", r"/prompts/part-00001\.parquet$", count=2, status=500, code="InternalError"),
            proxy.add("reset", "HEAD", r"/prompts/_SUCCESS$", count=1, at=0.0),
            proxy.add("status", "PUT", r"/labels/part-00000\.parquet$", count=2, status=503, code="SlowDown"),
            proxy.add("reset", "PUT", r"/labels/part-00001\.parquet$", count=2, at=0.5),  # halfway through the body
            proxy.add("stall", "PUT", r"/labels/_checksums/part-00001\.json$", count=1, hold=60),
            proxy.add("lost_response", "PUT", r"/labels/part-00000\.parquet$", count=1),
            proxy.add("lost_response", "PUT", r"/labels/manifest\.json$", count=1),
        ]
        in_process(out, PrepareStage, LabelStage)
        for fault in faults:
            assert_fired_and_retried(proxy, fault)
        # The storage client's own retries absorbed every fault: no shard attempt failed, none was redone.
        assert shard_attempts_failed(caplog) == []
        assert is_complete(prompts) and is_complete(labels)
        assert validate_dataset(str(labels)).ok
        fault_row("S3 5xx, resets, a stall, lost responses (proxy)", "prepare",
                  reference["prompts"]["prompt_id"].to_pylist(), ids(prompts))
        fault_row("S3 5xx, resets, a stall, lost responses (proxy)", "label",
                  reference["labels"]["prompt_id"].to_pylist(), ids(labels))
        assert table(prompts).to_pylist() == reference["prompts"].to_pylist()
        assert deterministic(table(labels)) == deterministic(reference["labels"])  # ids, order, tau, logits, ...
        print(f"[faults] prepare + label: {dict(proxy.injected)} over {len(proxy.log)} requests")

        # train, as the CLI with its own Ray: the driver (validate, checkpoint read, policy export) and the Ray
        # Train worker (checkpoint upload, metrics.jsonl) both meet faults.
        before = dict(proxy.injected)
        faults = [
            proxy.add("status", "GET", r"/labels/part-00001\.parquet$", count=2, status=503, code="SlowDown"),
            proxy.add("reset", "PUT", r"/train/ray/checkpoint_[^/]+/state\.pt$", count=2, at=0.5),
            proxy.add("stall", "PUT", r"/train/metrics\.jsonl$", count=1, hold=60),
            proxy.add("status", "GET", r"/train/ray/checkpoint_[^/]+/state\.pt$", count=2, status=500,
                      code="InternalError"),
            proxy.add("lost_response", "PUT", r"/train/policy/model\.safetensors$", count=1),
        ]
        run = blockpilot("train", f"output_dir={out}", *SMALL, *TRAIN, timeout=400, env=FAST_TRAIN_POLL)
        assert run.proc.returncode == 0, run.tail()
        for fault in faults:
            assert_fired_and_retried(proxy, fault)
        # Retried by the storage client, not by Ray Train: no worker failed and restarted from a checkpoint.
        assert "resuming from the checkpoint" not in run.output, run.tail()
        assert is_complete(train)
        history = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines()]
        fault_row("S3 5xx, resets, a stall, a lost response (proxy) (rows: epochs)", "train", range(2),
                  [h["epoch"] for h in history])
        assert [h["epoch"] for h in history] == [0, 1]  # each epoch once
        summary = json.loads((train / "summary.json").read_text())
        assert summary["train_rows"] + summary["val_rows"] + summary["calibration_rows"] == PROMPTS
        from pipeline.policy.blocksize import BlockSizePolicy

        assert BlockSizePolicy.from_pretrained(train / "policy").candidates == summary["candidates"]
        print(f"[faults] train: {dict(proxy.injected - Counter(before))}")


# ---- (b) the store stays down: one clear line, then a rerun completes ------------------------------------------------

@pytest.mark.faults
@pytest.mark.parametrize("down", ["503", "refused"])
def test_a_store_that_stays_down_fails_in_one_line_naming_it_and_a_rerun_completes(
        down, s3_server, store, reference, monkeypatch, caplog, fault_row):
    out = f"{store}/down-{down}"
    prompts = location(out) / "prompts"
    first = r"/prompts/part-00000\.parquet$"
    with FaultProxy(s3_server.endpoint) as proxy:
        # Two retries per request instead of botocore's four: the store stays down, more only make the failure slower.
        use_store(monkeypatch, s3_server, proxy.endpoint, retries={"max_attempts": 2})
        # Once the first shard is in, the store is down: every request answered 503, or the port closed (by the
        # proxy itself as it answers that PUT: a test that polled for the answer and then closed the port raced the
        # client's next PUTs).
        if down == "503":
            outage = proxy.add("status", count=None, status=503, code="ServiceUnavailable", after=("PUT", first))
        else:
            proxy.refuse_after("PUT", first)
        # One shard written at a time, so that the outage falls between two (with prepare.write_threads the second
        # may be in flight already, and then both are kept).
        proc = subprocess.Popen([PYTHON, "-m", "stages.cli", "prepare", f"output_dir={out}", *SMALL,
                                 "prepare.write_threads=1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            stdout, stderr = proc.communicate(timeout=240)  # it must give up on a store that stays down
        finally:
            if proc.poll() is None:
                proc.kill()  # by pid: prepare starts no Ray, it is the only process
                proc.communicate()
        print(f"[fault] store {down}: exit {proc.returncode}; stderr: {stderr.strip()[-600:]}")
        assert proc.returncode == 1, stdout + stderr
        assert "Traceback" not in stdout + stderr, stderr
        errors = [line for line in stderr.splitlines() if line.startswith("blockpilot prepare: error: ")]
        assert len(errors) == 1, stderr
        assert proxy.endpoint in errors[0] and out in errors[0], errors[0]  # names the store and the folder
        if down == "503":
            assert outage.fired >= 1 and proxy.injected["status"] == outage.fired, outage
            assert "(503)" in errors[0], errors[0]
        else:
            assert "Could not connect to the endpoint URL" in errors[0], errors[0]
        stored = objects(s3_server, out[len("s3://"):] + "/prompts")  # straight from moto: the proxy is down
        kept = {k: v for k, v in stored.items() if k.startswith("part-")}
        assert "part-00000.parquet" in kept and len(kept) < SHARDS and "_SUCCESS" not in stored, sorted(stored)

        # The store is back: a rerun (same proxy, no fault) redoes only what is missing.
        proxy.clear()
        proxy.accept()
        caplog.set_level("INFO", logger="blockpilot")
        in_process(out, PrepareStage)
        messages = [r.getMessage() for r in caplog.records]
        todo = SHARDS - len(kept)
        assert any(f"{todo}/{SHARDS} shards ({todo * 4} prompts) to do" in m for m in messages), messages
        assert any("took over the lease" in m for m in messages), messages  # the dead run could not give it back
        now = objects(s3_server, out[len("s3://"):] + "/prompts")
        assert {k: now[k] for k in kept} == kept  # the shards written before the outage are untouched
        fault_row(f"S3 down ({down}) mid-stage, rerun once back", "prepare",
                  reference["prompts"]["prompt_id"].to_pylist(), ids(prompts))
        assert is_complete(prompts) and table(prompts).to_pylist() == reference["prompts"].to_pylist()


# ---- (c) an upload cut halfway, its writer killed -----------------------------------------------------------------

@pytest.mark.faults
def test_a_label_shard_killed_mid_upload_leaves_no_object_that_resume_keeps(
        s3_server, store, reference, monkeypatch, caplog, fault_row):
    out = f"{store}/killed"
    labels = location(out) / "labels"
    with FaultProxy(s3_server.endpoint) as proxy:
        use_store(monkeypatch, s3_server, proxy.endpoint)
        in_process(out, PrepareStage)
        # Half of part-00001.parquet's body reaches the server; then the proxy holds the rest until the writer dies.
        cut = proxy.add("cut", "PUT", r"/labels/part-00001\.parquet$", count=1, at=0.5, hold=120)
        run = Run([PYTHON, "-c", LABEL_SCRIPT, f"output_dir={out}", *SMALL])
        try:
            run.wait_for(cut.applied.is_set, 240, "half of labels/part-00001.parquet sent to the server")
        finally:
            run.kill(signal.SIGKILL)
        assert not run.left, run.left
        deadline = time.monotonic() + 30  # the proxy records the cut once it has seen the writer's socket close
        while not (outcome := [o for o in proxy.outcomes("PUT", cut.path) if o.startswith("cut")]):
            assert time.monotonic() < deadline, proxy.log
            time.sleep(0.05)
        assert cut.fired == 1 and proxy.injected["cut"] == 1 and len(outcome) == 1, (cut, proxy.log)
        assert int(outcome[0].split()[2]) > 0 and outcome[0].endswith("(client gone)"), outcome
        stored = objects(s3_server, out[len("s3://"):] + "/labels")
        # The shard before is in; the cut one is not, though its checksum sidecar (written just before it) is.
        assert "part-00000.parquet" in stored and "part-00001.parquet" not in stored, sorted(stored)
        assert "_checksums/part-00001.json" in stored, sorted(stored)
        assert not is_complete(labels) and not validate_dataset(str(labels)).ok

        proxy.clear()
        caplog.set_level("INFO", logger="blockpilot")
        in_process(out, LabelStage)
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"1/{SHARDS} shards (4 prompts) to do" in m for m in messages), messages  # that shard alone
        now = objects(s3_server, out[len("s3://"):] + "/labels")
        assert now["part-00000.parquet"] == stored["part-00000.parquet"]  # the shard done before: untouched
        fault_row("S3 upload cut halfway, writer killed, rerun", "label",
                  reference["labels"]["prompt_id"].to_pylist(), ids(labels))
        assert is_complete(labels) and validate_dataset(str(labels)).ok
        assert deterministic(table(labels)) == deterministic(reference["labels"])


# ---- the lease's conditional writes, when an answer is lost -----------------------------------------------------

def test_a_lost_answer_to_a_lease_write_keeps_the_lease(s3_server, store, monkeypatch, caplog):
    """The lease (pipeline/executor/lease.py) is taken with a PUT If-None-Match and renewed with a PUT If-Match. When
    the server did such a PUT and its answer is lost, the client retries it, and the retry's precondition fails on
    the run's own write (412): that must not read as another run holding the folder, or one dropped answer to a
    heartbeat would stop a long run just before it marks its folder complete."""
    from pipeline.executor.lease import Lease

    folder = f"{store}/lease"
    caplog.set_level("INFO", logger="blockpilot")
    with FaultProxy(s3_server.endpoint) as proxy:
        use_store(monkeypatch, s3_server, proxy.endpoint)
        lease_file = r"/lease/_lease\.json$"
        create = proxy.add("lost_response", "PUT", lease_file, count=1)
        lease = Lease(folder, "label", heartbeat_s=0.2).acquire()
        try:
            beat = proxy.add("lost_response", "PUT", lease_file, count=1)
            assert beat.applied.wait(30), proxy.log
            deadline = time.monotonic() + 30  # two more heartbeats after the lost one
            while proxy.outcomes("PUT", lease_file)[-2:] != ["200", "200"]:
                assert lease.lost is None and time.monotonic() < deadline, (lease.lost, proxy.log)
                time.sleep(0.05)
            assert create.fired == 1 and beat.fired == 1 and proxy.injected["lost_response"] == 2
            puts = proxy.outcomes("PUT", lease_file)
            # Each lost answer was retried and refused on the run's own write: what the lease must see through.
            assert puts[:2] == ["lost_response (server said 200)", "412"] and puts.count("412") == 2, puts
            lease.check()  # still ours: the run may publish
            assert not [r for r in caplog.records if "lease" in r.getMessage()], caplog.records  # no takeover
        finally:
            lease.release()
        assert "_lease.json" not in objects(s3_server, folder[len("s3://"):])
