"""A full disk under ``output_dir``: a tmpfs of a few MB mounted by the test (we run as root; skipped, saying why,
where mount is not permitted), and a synthetic stage through the real driver whose shards are 1 MB each, so the disk
fills mid-stage. The stage must fail naming the folder and "No space left on device", leave no partial shard that
counts as done, and, once space is freed, a rerun completes with the rows of an uninterrupted run.
"""

import json
import re
import subprocess

import numpy as np
import pyarrow as pa
import pytest

from pipeline.executor.driver import run_stage
from pipeline.executor.stage import Plan, ShardStage, numbered_tasks
from pipeline.io.shards import is_complete, list_shards
from pipeline.io.storage import read_table
from pipeline.runtime.config import load_config

pytestmark = pytest.mark.integration

SHARDS, ROWS, ROW_BYTES = 6, 4, 256 * 1024  # 1 MB of incompressible bytes per shard
DISK_MB, FILLER_MB = 8, 4  # room for about 3 shards until the filler is deleted


class Bulk(ShardStage):
    """Rows of seeded random bytes: deterministic, and a shard's size on disk is what it carries."""

    name = "bulk"

    def fingerprint(self):
        return {"shards": SHARDS, "rows": ROWS, "row_bytes": ROW_BYTES}

    def plan(self):
        return Plan(numbered_tasks([list(range(i * ROWS, (i + 1) * ROWS)) for i in range(SHARDS)]))

    def process_shard(self, input, rejects):
        return pa.table({"prompt_id": [f"r{i}" for i in input],
                         "payload": [np.random.default_rng(i).bytes(ROW_BYTES) for i in input]})

    def parquet_options(self, table):
        return {"compression": "none"}  # random bytes do not compress: spare the CPU


def run_bulk(output_dir):
    stage = Bulk(load_config([f"output_dir={output_dir}", "progress=false"]), output_dir / "bulk")
    return stage.folder, run_stage(stage)


def rows(folder):
    return [r for p in list_shards(folder) for r in read_table(p).to_pylist()]


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(disk)],
                           capture_output=True, text=True)
        why = r.stderr.strip() if r.returncode else None
    except FileNotFoundError as err:  # no mount(8) at all
        why = str(err)
    if why is not None:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): {why}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.faults
def test_a_full_disk_fails_clearly_keeps_no_partial_shard_and_a_rerun_completes(small_disk, tmp_path, caplog,
                                                                                 fault_row):
    filler = small_disk / "filler.bin"
    filler.write_bytes(b"\0" * (FILLER_MB << 20))  # tmpfs allocates what is written: this space is really used
    caplog.set_level("INFO", logger="blockpilot")
    folder = small_disk / "bulk"
    with pytest.raises(RuntimeError) as failed:
        run_bulk(small_disk)
    error = str(failed.value)
    print(f"[fault] {DISK_MB} MB disk, {FILLER_MB} MB used: {error[:300]}")
    assert "No space left on device" in error and f"'{folder}/" in error, error
    kept = {p.name: p.stat().st_mtime_ns for p in list_shards(folder)}
    not_done = [f"part-{i:05d}.parquet" for i in range(SHARDS) if f"part-{i:05d}.parquet" not in kept]
    assert 1 <= len(kept) < SHARDS, kept
    # Every shard not done is named in the error with the file it could not write (the shard, or its checksum
    # sidecar when the shard took the last page); nothing half-written is left in the folder.
    for name in not_done:
        assert re.search(rf"{name}: OSError: \[Errno 28\] No space left on device: '{re.escape(str(folder))}/[^']+'",
                         error), (name, error)
    assert sorted(p.name for p in folder.rglob("*") if ".tmp-" in p.name) == []
    assert not is_complete(folder)
    manifest = json.loads((folder / "manifest.json").read_text())  # written on failure too: it describes the disk
    assert [f["file"] for f in manifest["files"]] == sorted(kept) and manifest["rows"] == len(kept) * ROWS

    filler.unlink()
    caplog.clear()
    _, summary = run_bulk(small_disk)
    assert summary["rows"] == SHARDS * ROWS and is_complete(folder)
    # The rerun's done check counted exactly the kept shards: it redid the others and left those untouched.
    assert any(f"{len(not_done)}/{SHARDS} shards ({len(not_done) * ROWS} rows) to do" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert {name: (folder / name).stat().st_mtime_ns for name in kept} == kept

    _, reference = run_bulk(tmp_path / "uninterrupted")
    assert reference["rows"] == summary["rows"]
    fault_row("disk full mid-stage (tmpfs), space freed, rerun", "bulk (synthetic)",
              [r["prompt_id"] for r in rows(tmp_path / "uninterrupted" / "bulk")],
              [r["prompt_id"] for r in rows(folder)])
    assert rows(folder) == rows(tmp_path / "uninterrupted" / "bulk")


def test_a_disk_full_before_the_stage_starts_names_the_folder(small_disk):
    """The stage's first write is its lease (pipeline/io/exclusive.py): on a disk with no page left it must name the
    folder too, and leave nothing behind; once space is freed the stage runs."""
    filler = small_disk / "filler.bin"
    with open(filler, "wb", buffering=0) as fh:  # every page of the disk (unbuffered: close flushes nothing)
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
        except OSError:
            pass
    with open(small_disk / "pad", "wb", buffering=0) as fh:  # and the remainder, a page at a time
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass
    folder = small_disk / "bulk"
    with pytest.raises(OSError) as full:
        run_bulk(small_disk)
    assert full.value.errno == 28 and str(full.value.filename).startswith(f"{folder}/"), full.value
    assert "No space left on device" in str(full.value)
    assert [p.name for p in small_disk.rglob("*") if ".new-" in p.name or ".tmp-" in p.name] == []
    filler.unlink()
    (small_disk / "pad").unlink(missing_ok=True)
    _, summary = run_bulk(small_disk)
    assert summary["rows"] == SHARDS * ROWS and is_complete(folder)
