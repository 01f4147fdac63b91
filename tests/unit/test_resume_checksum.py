"""Resume proves what it keeps (issue #25, item 2): a shard whose footer reads but whose data page has one flipped
byte is redone alone on a rerun, whether the folder was complete (its manifest holds the sha256) or interrupted
before any manifest (the shard's checksum sidecar, written with it, holds it); validate names the file.

Real driver, real Parquet files; the damage is one byte inside a column chunk's data, the footer left intact (the
test asserts that the footer-only check still passes on it, so the damage is the kind that check missed).
"""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.data.validate import validate_dataset
from pipeline.io.layout import CHECKSUMS_DIR
from pipeline.io.shards import file_sha256, shard_intact

from test_driver import Squares, cfg_for, inputs, mtimes, run  # noqa: F401 - inputs is a fixture


def flip_a_data_byte(path: Path) -> None:
    """Flip the last byte of the first column chunk (its data page's payload): the footer still reads."""
    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    offset = start + col.total_compressed_size - 1  # the chunk's last byte: inside its last data page
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def fingerprint_of(folder: Path) -> str:
    return json.loads((folder / "manifest.json").read_text())["fingerprint_sha256"]


def ids(folder: Path) -> list:
    return [i for p in sorted(folder.glob("part-*.parquet")) for i in pq.read_table(p)["prompt_id"].to_pylist()]


@pytest.mark.faults
def test_a_flipped_byte_in_a_complete_folder_is_redone_alone(tmp_path, inputs, fault_row):
    out = tmp_path / "squares"
    run(Squares(cfg_for(), inputs, out))
    bad = out / "part-00001.parquet"
    original, original_sha = pq.read_table(bad).to_pylist(), file_sha256(bad)
    original_ids = ids(out)
    flip_a_data_byte(bad)
    assert shard_intact(bad, 2, fingerprint_of(out))  # the footer-only check keeps it
    others = {k: v for k, v in mtimes(out).items() if k in ("part-00000.parquet", "part-00002.parquet")}
    again = Squares(cfg_for(), inputs, out)
    summary = run(again)
    fault_row("a flipped byte in a data page, complete folder", "squares (synthetic)", original_ids, ids(out))
    assert again.calls == ["part-00001.parquet"]  # redone alone
    assert file_sha256(bad) == original_sha and pq.read_table(bad).to_pylist() == original
    assert {k: v for k, v in mtimes(out).items() if k in others} == others
    assert summary["rows"] == 7 and (out / "_SUCCESS").exists()


@pytest.mark.faults
def test_a_flipped_byte_before_any_manifest_is_caught_by_the_shards_own_checksum(tmp_path, inputs, fault_row):
    """A run killed before its manifest: only the checksum written with each shard can prove it."""
    out = tmp_path / "squares"
    with pytest.raises(RuntimeError, match="part-00002.parquet"):
        run(Squares(cfg_for(), inputs, out, fail={"part-00002.parquet"}))
    fp = fingerprint_of(out)
    (out / "manifest.json").unlink()  # as if killed before the driver wrote it
    sidecar = json.loads((out / CHECKSUMS_DIR / "part-00000.json").read_text())
    shard = (out / "part-00000.parquet").stat()
    assert sidecar == {"file": "part-00000.parquet", "sha256": file_sha256(out / "part-00000.parquet"),
                       "bytes": shard.st_size, "rows": 3, "stats": None, "fingerprint_sha256": fp,
                       "stamp": str(shard.st_mtime_ns)}  # the stamp: written once the shard was published
    flip_a_data_byte(out / "part-00000.parquet")
    assert shard_intact(out / "part-00000.parquet", 3, fp)
    rerun = Squares(cfg_for(), inputs, out)
    run(rerun)
    run(Squares(cfg_for(), inputs, tmp_path / "reference"))
    fault_row("a flipped byte in a data page, no manifest yet", "squares (synthetic)", ids(tmp_path / "reference"),
              ids(out))
    assert ids(out) == ids(tmp_path / "reference")
    assert rerun.calls == ["part-00000.parquet", "part-00002.parquet"]  # part-00001 kept: its bytes check out
    assert pq.read_table(out / "part-00000.parquet")["square"].to_pylist() == [1, 4, 9]


def test_validate_names_the_shard_with_a_flipped_byte(real_labels, tmp_path):
    folder = Path(shutil.copytree(real_labels, tmp_path / "labels"))
    assert validate_dataset(str(folder)).ok
    flip_a_data_byte(folder / "part-00001.parquet")
    report = validate_dataset(str(folder))
    assert not report.ok
    assert all(p.startswith("part-00001.parquet: ") for p in report.problems), report.problems
    assert "part-00001.parquet: sha256 differs from the manifest (file changed or corrupted)" in report.problems
