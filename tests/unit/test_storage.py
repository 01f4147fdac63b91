"""Stage folders in object storage: the driver, the shard primitives and validate against a real S3-compatible
server (moto in server mode on 127.0.0.1, started by tests/conftest.py), through the same code as local folders."""

import hashlib
import json

import pyarrow as pa
import pytest

from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.io.shards import (
    SUCCESS,
    file_sha256,
    is_complete,
    list_shards,
    read_jsonl,
    shard_intact,
    write_json_atomic,
    write_parquet_atomic,
)
from pipeline.io.storage import is_remote, location, parquet_file, read_table, rmtree, size

from test_driver import SCHEMA, Squares, cfg_for, make_inputs


def objects(uri: str) -> dict:
    """Every object under ``uri``: key -> ETag (changes when the object is rewritten)."""
    root = location(uri)
    return {info["name"][len(root.path) + 1:]: info["ETag"]
            for info in root.fs.find(root.path, detail=True).values()}


def test_location_is_pathlib_locally_and_upath_for_uris(tmp_path):
    assert location(tmp_path) == tmp_path and not is_remote(tmp_path)
    assert str(location(f"file://{tmp_path}")) == str(tmp_path)
    s3 = location("s3://bucket/run/labels")
    assert is_remote(s3) and str(s3) == "s3://bucket/run/labels" and (s3 / "part-00000.parquet").name == \
        "part-00000.parquet"
    assert location(s3) is s3


def test_shard_primitives_on_s3(s3_bucket):
    folder = location(s3_bucket) / "run" / "labels"
    table = pa.Table.from_pylist([{"prompt_id": "a", "source": "s", "x": 1}], schema=SCHEMA)
    write_parquet_atomic(table.replace_schema_metadata({b"blockpilot.fingerprint_sha256": b"\"f\""}),
                         folder / "part-00000.parquet")
    write_json_atomic({"k": 1}, folder / "manifest.json")
    (folder / "README.md").write_text("card")
    (folder / "_rejects" / "part-00000.jsonl").write_text('{"reason": "r"}\n')
    assert [p.name for p in list_shards(folder)] == ["part-00000.parquet"]  # only shards match the glob
    assert read_table(folder / "part-00000.parquet").to_pylist() == table.to_pylist()
    assert parquet_file(folder / "part-00000.parquet").metadata.num_rows == 1
    assert shard_intact(folder / "part-00000.parquet", 1, "f") and not shard_intact(folder / "part-00000.parquet", 2, "f")
    assert json.loads((folder / "manifest.json").read_text()) == {"k": 1}
    assert read_jsonl(folder / "_rejects" / "part-00000.jsonl") == [{"reason": "r"}]
    assert read_jsonl(folder / "_rejects" / "missing.jsonl") == []
    assert size(folder / "part-00000.parquet") == len((folder / "part-00000.parquet").read_bytes())
    assert file_sha256(folder / "part-00000.parquet") == hashlib.sha256(
        (folder / "part-00000.parquet").read_bytes()).hexdigest()
    rmtree(folder / "_rejects")
    assert not (folder / "_rejects" / "part-00000.jsonl").exists()


def test_a_failed_write_publishes_nothing(s3_bucket):
    """Remote writes serialise first and upload once: a writer that fails never leaves a partial object."""
    path = location(s3_bucket) / "part-00000.parquet"
    with pytest.raises(Exception):
        write_parquet_atomic(pa.table({"x": [1]}), path, compression="no-such-codec")
    assert not path.exists() and objects(s3_bucket) == {}


def test_the_driver_runs_a_stage_into_s3_and_resumes_it(tmp_path, s3_bucket):
    """The driver's whole bookkeeping in object storage: shards, rejects, manifest, card, _SUCCESS last; a rerun
    of a complete folder touches nothing; a deleted shard is redone alone."""
    inputs = make_inputs(location(s3_bucket) / "inputs")  # input shards in the bucket too
    out = f"{s3_bucket}/squares"
    summary = run_stage(Squares(cfg_for(), inputs, out), LocalExecutor())
    assert summary["rows"] == 7 and summary["rejects"] == 1 and is_complete(out)
    stored = objects(out)
    assert {"part-00000.parquet", "part-00001.parquet", "part-00002.parquet", "manifest.json", "summary.json",
            "README.md", "rejects.jsonl", SUCCESS, "_rejects/part-00001.jsonl", "config.yaml"} <= set(stored)
    assert not [k for k in stored if ".tmp-" in k]  # no temp-and-rename in object storage
    manifest = json.loads((location(out) / "manifest.json").read_text())
    assert [f["rows"] for f in manifest["files"]] == [3, 2, 2]
    assert manifest["files"][1]["sha256"] == file_sha256(location(out) / "part-00001.parquet")

    again = Squares(cfg_for(), inputs, out)
    assert run_stage(again, LocalExecutor())["skipped"] and again.calls == [] and objects(out) == stored

    (location(out) / "part-00001.parquet").unlink()
    redo = Squares(cfg_for(), inputs, out)
    assert run_stage(redo, LocalExecutor())["rows"] == 7
    assert redo.calls == ["part-00001.parquet"]
    now = objects(out)
    assert now["part-00000.parquet"] == stored["part-00000.parquet"]  # untouched
    assert is_complete(out)


def test_drift_is_refused_in_s3_too(s3_bucket):
    inputs = make_inputs(location(s3_bucket) / "inputs")
    out = f"{s3_bucket}/squares"
    run_stage(Squares(cfg_for(), inputs, out), LocalExecutor())
    with pytest.raises(FileExistsError, match="changed: power"):
        run_stage(Squares(cfg_for(), inputs, out, power=3), LocalExecutor())
    assert run_stage(Squares(cfg_for("force=true"), inputs, out, power=3), LocalExecutor())["sum_of_squares"] == \
        1 + 8 + 27 + 64 + 216 + 343 + 512
