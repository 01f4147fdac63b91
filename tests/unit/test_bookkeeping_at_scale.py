"""The driver's bookkeeping at 1M prompts (issue #66, items 2-4): 15,625 shards on S3 at 20-50 ms a request.

* Shard names of any width: ``shard_name`` writes part-100000 from the 100,000th shard on, and every reader sees it,
  after part-99999.
* Skip-if-complete and resume keep a shard from one listing of its folder (its size and stamp equal the ones its
  sidecar or manifest recorded) without reading its bytes; only a shard that changed is read. What that cannot see
  (a flipped byte whose mtime is set back) is named by ``blockpilot validate``, which still hashes every shard.
* Planning, the to-do check and the manifest make a fixed number of listings and existence checks whatever the
  number of shards, and at most one read of each shard's sidecar; the rows of an input folder come from its manifest.

Real driver, real Parquet files; the file-system calls are counted, never timed.
"""

import json
import os
import shutil
import threading
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

import pipeline.executor.manifest as manifest_mod
import pipeline.executor.stage as stage_mod
import pipeline.io.shards as shards_mod
import pipeline.io.storage as storage_mod
from pipeline.data.validate import validate_dataset
from pipeline.executor.folder import StageFolder
from pipeline.executor.stage import tasks_from_shards
from pipeline.io.shards import file_sha256, list_shards, read_sidecar, shard_name, write_parquet_atomic
from pipeline.io.storage import listing, location

from test_bookkeeping import StatSquares
from test_driver import SCHEMA, cfg_for, inputs, make_inputs, run  # noqa: F401 - inputs is a fixture
from test_resume_checksum import flip_a_data_byte


class Calls:
    """Counts calls by name (from the driver's reader threads too) and keeps the paths that were hashed."""

    def __init__(self, monkeypatch):
        self.mp, self.n, self.hashed, self.lock = monkeypatch, Counter(), [], threading.Lock()

    def count(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def counted(*args, **kwargs):
            with self.lock:
                self.n[name] += 1
                if name == "sha256":
                    self.hashed.append(Path(str(args[0])).name)
            return original(*args, **kwargs)

        self.mp.setattr(owner, attr, counted)

    def shard_reads(self) -> None:
        """Every way the driver reads a shard's bytes or footer."""
        for mod in (shards_mod, manifest_mod):
            self.count(mod, "file_sha256", "sha256")
            self.count(mod, "parquet_file", "footer")
        self.count(storage_mod, "parquet_file", "footer")
        self.count(storage_mod, "read_table", "table")


# ---- item 1: shard names of any width --------------------------------------------------------------------------------

def test_shards_past_part_99999_are_seen_after_it(tmp_path):
    t = pa.Table.from_pylist([{"prompt_id": "p", "source": "toy", "x": 1}], schema=SCHEMA)
    for i in (100000, 99999, 1):
        write_parquet_atomic(t, tmp_path / shard_name(i))
    (tmp_path / "part-1.parquet").write_bytes(b"")  # not a shard name: fewer than five digits
    want = ["part-00001.parquet", "part-99999.parquet", "part-100000.parquet"]
    assert shard_name(100000) == "part-100000.parquet"
    assert [p.name for p in list_shards(tmp_path)] == want  # a 5-digit glob misses the last; a name sort puts it 2nd
    assert [task.name for task in tasks_from_shards(tmp_path)] == want


# ---- item 2: kept without reading ------------------------------------------------------------------------------------

def test_a_complete_folder_is_skipped_without_reading_a_shard(tmp_path, inputs, monkeypatch):
    out = tmp_path / "squares"
    run(StatSquares(cfg_for(), inputs, out))
    calls = Calls(monkeypatch)
    calls.shard_reads()
    again = StatSquares(cfg_for(), inputs, out)
    summary = run(again)
    assert summary["skipped"] is True and again.calls == []
    assert calls.n == Counter()  # the code before hashed every shard the manifest lists to skip the stage


def test_a_resume_after_a_kill_hashes_no_kept_shard(tmp_path, inputs, monkeypatch):
    out = tmp_path / "squares"
    with pytest.raises(RuntimeError, match="part-00002.parquet"):
        run(StatSquares(cfg_for(), inputs, out, fail={"part-00002.parquet"}))
    (out / "manifest.json").unlink()  # as if killed before the driver wrote it: only the sidecars record the shards
    calls = Calls(monkeypatch)
    calls.shard_reads()
    rerun = StatSquares(cfg_for(), inputs, out)
    assert run(rerun)["rows"] == 7
    assert rerun.calls == ["part-00002.parquet"]
    # Hashed: only the redone shard's temporary file, as it is written; the code before hashed the two kept shards.
    assert all(name.startswith(".part-00002.parquet.tmp-") for name in calls.hashed), calls.hashed
    assert calls.n["footer"] == 0


def test_a_changed_shard_is_read_and_then_recorded_as_it_is(tmp_path, inputs, monkeypatch):
    """The listing only decides which shards to read: one rewritten with the same bytes (a new mtime) is hashed,
    kept, and recorded with its new stamp, so the next run reads it no more; one with a flipped byte is redone."""
    out = tmp_path / "squares"
    run(StatSquares(cfg_for(), inputs, out))
    same, other = out / "part-00000.parquet", out / "part-00002.parquet"
    same.write_bytes(same.read_bytes())
    flip_a_data_byte(other)
    calls = Calls(monkeypatch)
    calls.shard_reads()
    again = StatSquares(cfg_for(), inputs, out)
    run(again)
    assert again.calls == ["part-00002.parquet"]
    # Each hashed by the skip check, which fails on part-00002, then by the to-do check.
    assert sorted(n for n in calls.hashed if not n.startswith(".")) == ["part-00000.parquet"] * 2 + \
        ["part-00002.parquet"] * 2
    calls.hashed.clear()
    assert run(StatSquares(cfg_for(), inputs, out))["skipped"] is True
    assert calls.hashed == []


def test_a_shard_redone_with_the_same_bytes_leaves_the_manifest_byte_for_byte_the_same(tmp_path, inputs):
    """label fingerprints prepare's manifest.json: a prepare rerun that redoes a lost shard (same rows, same bytes)
    must write the same manifest, or label refuses its own folder. The stamps (a new mtime on every write) live in
    _stamps.json beside it; with them in the manifest's entries this failed."""
    out = tmp_path / "squares"
    run(StatSquares(cfg_for(), inputs, out))
    manifest, stamps = (out / "manifest.json").read_bytes(), json.loads((out / "_stamps.json").read_text())
    (out / "part-00001.parquet").unlink()
    again = StatSquares(cfg_for(), inputs, out)
    run(again)
    assert again.calls == ["part-00001.parquet"]
    assert (out / "manifest.json").read_bytes() == manifest
    now = json.loads((out / "_stamps.json").read_text())
    assert sorted(now) == sorted(stamps) and now["part-00001.parquet"] != stamps["part-00001.parquet"]


def test_in_s3_the_stamp_is_the_etag_and_a_resume_hashes_no_kept_shard(s3_bucket, monkeypatch):
    """The same in object storage: the sidecar's stamp (a HEAD after the PUT) is the ETag the folder's listing
    gives, shard names of any width are listed in index order, and a resume after a kill reads no kept shard."""
    inputs = make_inputs(location(s3_bucket) / "inputs", shards=((1, 2, 3), (4, 5), (6,)))
    out = location(s3_bucket) / "squares"
    with pytest.raises(RuntimeError, match="part-00002.parquet"):
        run(StatSquares(cfg_for(), inputs, out, fail={"part-00002.parquet"}))
    listed = listing(out)
    side = read_sidecar(out / "_checksums" / "part-00000.json")
    assert side["stamp"] == listed["part-00000.parquet"]["stamp"] and side["stamp"].strip('"')  # the ETag
    (out / "manifest.json").unlink()
    calls = Calls(monkeypatch)
    calls.shard_reads()
    rerun = StatSquares(cfg_for(), inputs, out)
    assert run(rerun)["rows"] == 6 and rerun.calls == ["part-00002.parquet"]
    assert calls.hashed == [] and calls.n["footer"] == 0
    t = pa.Table.from_pylist([{"prompt_id": "p", "source": "toy", "x": 1}], schema=SCHEMA)
    for i in (100000, 99999):
        write_parquet_atomic(t, inputs / shard_name(i))
    assert [p.name for p in list_shards(inputs)][-2:] == ["part-99999.parquet", "part-100000.parquet"]


def test_a_flipped_byte_with_its_mtime_set_back_is_kept_and_validate_names_it(real_labels, tmp_path):
    """What the listing check cannot see, precisely: a data byte flipped in place (same size) and the file's mtime
    set back to the one recorded. Skip-if-complete keeps the label folder as it is (the damaged shard too, unread);
    `blockpilot validate` hashes every shard and names it."""
    folder = Path(shutil.copytree(real_labels, tmp_path / "labels"))  # copy2 keeps each file's mtime: stamps hold
    bad = folder / "part-00001.parquet"
    before = bad.stat()
    flip_a_data_byte(bad)
    os.utime(bad, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (bad.stat().st_size, bad.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    fingerprint = json.loads((folder / "fingerprint.json").read_text())
    manifest = json.loads((folder / "manifest.json").read_text())
    assert file_sha256(bad) != next(f["sha256"] for f in manifest["files"] if f["file"] == bad.name)
    assert StageFolder(folder, "label").previous_summary(fingerprint) is not None  # kept: the stamp matches
    report = validate_dataset(str(folder))
    assert "part-00001.parquet: sha256 differs from the manifest (file changed or corrupted)" in report.problems
    assert all(p.startswith("part-00001.parquet: ") for p in report.problems), report.problems


# ---- item 3: a fixed number of listings, one sidecar read a shard ----------------------------------------------------

class Echo(StatSquares):
    """Its shards are its input's rows: an input folder with a manifest, for the next stage to plan from."""

    def process_shard(self, input, rejects):
        self.calls.append(Path(str(input)).name)
        return storage_mod.read_table(input)

    def shard_stats(self, table):
        return {"rows": table.num_rows}

    def merge_stats(self, stats):
        return {}


def resume_calls(root: Path, monkeypatch, n: int) -> Counter:
    """The file-system calls of a rerun of a stage of ``n`` one-row shards killed before its manifest (every shard
    kept): planning (from the input's manifest), the to-do check, the manifest, the summary and _SUCCESS."""
    raw = make_inputs(root, shards=[(i,) for i in range(n)])
    echoed = root / "echo"
    run(Echo(cfg_for(), raw, echoed))
    out = root / "squares"
    run(StatSquares(cfg_for(), echoed, out))
    (out / "manifest.json").unlink()
    (out / "_SUCCESS").unlink()
    with monkeypatch.context() as mp:
        calls = Calls(mp)
        calls.shard_reads()
        calls.count(stage_mod, "parquet_file", "footer")
        calls.count(Path, "exists", "exists")
        calls.count(Path, "is_file", "exists")
        calls.count(Path, "read_text", "read")
        calls.count(Path, "read_bytes", "read")
        calls.count(Path, "glob", "listing")
        calls.count(os, "scandir", "listing")
        stage = StatSquares(cfg_for(), echoed, out)
        summary = run(stage)
    assert stage.calls == [] and summary["rows"] == n and summary["sum_of_squares"] == sum(i * i for i in range(n))
    return calls.n


def test_the_bookkeeping_makes_a_fixed_number_of_listings_and_one_sidecar_read_a_shard(tmp_path, monkeypatch):
    small, large = resume_calls(tmp_path / "small", monkeypatch, 20), resume_calls(tmp_path / "large", monkeypatch, 200)
    # No call per shard to see whether a file is there: listings, as many for 200 shards as for 20.
    assert large["exists"] == small["exists"] and large["listing"] == small["listing"], (small, large)
    # One read per shard, its sidecar (by the to-do check; the manifest reuses it); empty reject files are not read.
    assert large["read"] - small["read"] == 180, (small, large)
    # No footer, no hash: the input's row counts come from its manifest, the kept shards from their stamps.
    assert large["footer"] == large["sha256"] == large["table"] == 0, large
