"""Every common reader reads a real label set (schema v3), and they all see the same values, the per-step trace's
nested lists (list<list<float32>>) included.

pyarrow, polars (lazy scan), pandas, Hugging Face `datasets` (`load_dataset(DIR)` through the card's front matter,
nothing else from the folder) and DuckDB. Spark is not in the matrix: no local Spark runs on these machines' 2
cores within a test's budget (pyspark needs a JVM start-up of its own).
"""

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.schemas import LABELS_SCHEMA_VERSION

from pipeline.io.shards import decode_metadata


@pytest.fixture(scope="module")
def reference(real_labels):
    """What pyarrow reads, ordered by prompt_id: the values every other reader must return."""
    t = pa.concat_tables([pq.read_table(p) for p in sorted(real_labels.glob("part-*.parquet"))])
    t = t.sort_by("prompt_id")
    logits = np.stack(t.column("logits").to_numpy(zero_copy_only=False)).astype(np.float32)
    return {"ids": t.column("prompt_id").to_pylist(), "logits": logits, "tau": t.column("tau").to_pylist(),
            "labels": t.column("label_block_size").to_pylist(), "match": t.column("trace_match").to_pylist(),
            "confidence": t.column("trace_confidence").to_pylist()}


def check(ref, ids, logits, tau, labels, match, confidence):
    order = np.argsort(ids)
    assert [ids[i] for i in order] == ref["ids"]
    assert np.array_equal(np.stack([np.asarray(logits[i], dtype=np.float32) for i in order]), ref["logits"])
    assert np.allclose(np.array([list(map(float, tau[i])) for i in order]), np.array(ref["tau"]), rtol=1e-6)
    assert [int(labels[i]) for i in order] == ref["labels"]
    assert [[int(m) for m in match[i]] for i in order] == ref["match"]
    # float32 values: every reader returns the stored ones exactly (as Python floats or float32 arrays)
    assert [[[float(x) for x in c] for c in confidence[i]] for i in order] == ref["confidence"]


COLUMNS = "prompt_id, logits, tau, label_block_size, trace_match, trace_confidence"


def test_the_set_is_schema_v3_with_float16_precision(real_labels, reference):
    meta = decode_metadata(pq.read_schema(real_labels / "part-00000.parquet").metadata)
    assert meta["schema_version"] == LABELS_SCHEMA_VERSION == "4"
    assert any(len(c) and len(c[0]) == 9 for c in reference["confidence"])  # b_max = B + B // 4 = 10: 9 drafted slots
    assert pq.read_schema(real_labels / "part-00000.parquet").field("logits").type.value_type == pa.float32()
    x = reference["logits"]
    assert np.array_equal(x.astype(np.float16).astype(np.float32), x)  # float16 values, nothing lost against v1
    assert len(reference["ids"]) == 8


def test_polars_lazy_scan(real_labels, reference):
    import polars as pl

    lf = pl.scan_parquet(str(real_labels / "part-*.parquet"))
    V = reference["logits"].shape[1]
    assert lf.collect_schema()["logits"] == pl.Array(pl.Float32, V)
    df = lf.select(*COLUMNS.split(", ")).collect()
    check(reference, df["prompt_id"].to_list(), df["logits"].to_numpy(), df["tau"].to_list(),
          df["label_block_size"].to_list(), df["trace_match"].to_list(), df["trace_confidence"].to_list())


def test_pandas(real_labels, reference):
    import pandas as pd

    df = pd.concat([pd.read_parquet(p) for p in sorted(real_labels.glob("part-*.parquet"))])
    check(reference, df["prompt_id"].tolist(), list(df["logits"]), list(df["tau"]), df["label_block_size"].tolist(),
          list(df["trace_match"]), list(df["trace_confidence"]))


def test_duckdb_reads_the_logits(real_labels, reference):
    import duckdb

    rows = duckdb.sql(f"SELECT {COLUMNS} FROM read_parquet('{real_labels}/part-*.parquet')").fetchall()
    check(reference, *([r[i] for r in rows] for i in range(6)))


def test_hf_load_dataset_on_the_folder_as_is(real_labels, reference, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder: nothing may come from the network
    folder = Path(shutil.copytree(real_labels, tmp_path / "labels"))
    assert (folder / "_SUCCESS").exists() and (folder / "manifest.json").exists()  # not data, and not read
    ds = datasets.load_dataset(str(folder), cache_dir=str(tmp_path / "cache"))["train"]
    check(reference, ds["prompt_id"], ds["logits"], ds["tau"], ds["label_block_size"], ds["trace_match"],
          ds["trace_confidence"])
    assert set(ds.column_names) == set(pq.read_schema(folder / "part-00000.parquet").names)
