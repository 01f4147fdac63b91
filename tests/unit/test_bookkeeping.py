"""The driver's closing bookkeeping reads no shard again (issue #25, item 10): each shard's sidecar carries its
sha256, size, rows and the stage's statistics (ShardStage.shard_stats, computed by the worker as it writes), and the
manifest is built from them; a shard without them (written before sidecars carried rows) is still read. Label's
merged statistics equal those of the whole table."""

import json

import pyarrow as pa
import pytest

import pipeline.executor.manifest as manifest_mod
from pipeline.io.layout import CHECKSUMS_DIR
from pipeline.io.shards import file_sha256
from pipeline.labelling.summary import label_shard_stats, merge_label_stats

from test_driver import Squares, cfg_for, inputs, run  # noqa: F401 - inputs is a fixture


class StatSquares(Squares):
    """Squares whose summary comes from per-shard statistics."""

    def shard_stats(self, table):
        return {"sum": sum(table["square"].to_pylist()), "rows": table.num_rows}

    def merge_stats(self, stats):
        return {"sum_of_squares": sum(s["sum"] for s in stats)}


def _no_shard_reads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the closing bookkeeping read a shard again")

    monkeypatch.setattr(manifest_mod, "file_sha256", refuse)
    monkeypatch.setattr(manifest_mod, "parquet_file", refuse)


def test_the_manifest_is_built_from_the_sidecars_without_reading_a_shard(tmp_path, inputs, monkeypatch):
    _no_shard_reads(monkeypatch)
    out = tmp_path / "squares"
    summary = run(StatSquares(cfg_for(), inputs, out))
    monkeypatch.undo()
    m = json.loads((out / "manifest.json").read_text())
    assert m["summary"] == {"sum_of_squares": 1 + 4 + 9 + 16 + 36 + 49 + 64} and summary["rows"] == 7
    for f in m["files"]:  # the sidecar's values are the shard's own
        assert f["sha256"] == file_sha256(out / f["file"]) and f["bytes"] == (out / f["file"]).stat().st_size
    assert [f["rows"] for f in m["files"]] == [3, 2, 2]


def test_a_stage_without_stats_or_an_old_sidecar_falls_back_to_reading(tmp_path, inputs, monkeypatch):
    out = tmp_path / "squares"
    run(Squares(cfg_for(), inputs, out))  # no shard_stats: summarize reads the shards
    assert json.loads((out / "manifest.json").read_text())["summary"] == {"sum_of_squares": 179}
    out2 = tmp_path / "stat"
    run(StatSquares(cfg_for(), inputs, out2))
    side = out2 / CHECKSUMS_DIR / "part-00001.json"
    old = json.loads(side.read_text())
    side.write_text(json.dumps({k: old[k] for k in ("file", "sha256", "bytes")}))  # a sidecar of before this change
    (out2 / "_SUCCESS").unlink()
    _no_shard_reads(monkeypatch)
    with pytest.raises(AssertionError, match="read a shard again"):  # the old sidecar's shard is read, as it must be
        run(StatSquares(cfg_for(), inputs, out2))


def test_label_stats_merged_over_shards_equal_the_whole_tables():
    rows = [{"candidates": [4, 5, 6], "tau": [2.0 + i % 3, 2.5, 3.0 + i % 2], "label_block_size": [4, 5, 6][i % 3],
             "label_speedup_block_size": [4, 6][i % 2]} for i in range(11)]
    t = pa.Table.from_pylist(rows)
    whole = merge_label_stats([label_shard_stats(t)])
    parts = merge_label_stats([label_shard_stats(t.slice(0, 4)), label_shard_stats(t.slice(4, 0)),
                               label_shard_stats(t.slice(4))])
    assert parts == whole
    assert whole["label_histogram"] == {4: 4, 5: 4, 6: 3} and whole["speedup_label_histogram"] == {4: 6, 5: 0, 6: 5}
    assert whole["mean_tau"][4] == pytest.approx(sum(2.0 + i % 3 for i in range(11)) / 11, abs=1e-4)
