"""tune reads a bounded amount of the label set into the driver (issue #66, 6): read_traced keeps at most
tune.max_rows rows of each split, a fixed random subset by a hash of the prompt id, makes Python objects of those
rows alone, and without a cap reads every traced row in the shards' order as it always did."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.evaluation.rule_search as rule_search
from pipeline.evaluation.rule_search import read_traced, row_rank
from pipeline.policy.blocksize import split_of

VAL, CALIB = 0.3, 0.15


def label_shards(tmp_path, shards: int = 4, rows: int = 25):
    """Label shards with a trace on every row but each seventh (null trace columns, as a row without one)."""
    paths = []
    for s in range(shards):
        recs = []
        for i in range(rows):
            n = s * rows + i
            traced = n % 7 != 3
            recs.append({"prompt_id": f"p{n}", "source": "code", "prompt_tokens": 10 + n, "candidates": [2, 3, 4],
                         "steps": [9, 8, 7], "trace_block_size": 4 if traced else None,
                         "trace_stopped": False if traced else None, "trace_match": [1, 2, 0] if traced else None,
                         "trace_confidence": [[0.9, 0.5, 0.1]] * 3 if traced else None})
        paths.append(tmp_path / f"part-{s:05d}.parquet")
        pq.write_table(pa.Table.from_pylist(recs), paths[-1])
    return paths


def ids_in(split, traced=True):
    every = [f"p{n}" for n in range(100) if (n % 7 != 3) == traced]
    return [p for p in every if (split_of(p, VAL, CALIB) == "val") == (split == "val")]


def test_a_cap_below_the_val_rows_keeps_a_fixed_random_subset_and_makes_objects_of_it_alone(tmp_path, monkeypatch):
    paths = label_shards(tmp_path)
    made = []
    real = rule_search.TracedRow
    monkeypatch.setattr(rule_search, "TracedRow", lambda *a: made.append(a[0]) or real(*a))
    got = read_traced(paths, VAL, CALIB, max_rows=5)
    for split in ("val", "train"):
        everyone = ids_in(split)
        assert len(everyone) > 5
        kept = set(sorted(everyone, key=row_rank)[:5])  # the least hashes: the same on every run
        assert [r.prompt_id for r in got[split]] == [p for p in everyone if p in kept]  # in the shards' order
        assert got["counts"]["traced"][split] == len(everyone) and got["counts"]["used"][split] == 5
    assert sorted(made) == sorted(r.prompt_id for s in ("val", "train") for r in got[s])  # nothing else made
    assert got["counts"]["label_rows"] == 100 and got["counts"]["max_rows"] == 5
    assert all(r.trace.block_size == 4 and r.steps == [9, 8, 7] for r in got["val"])


def test_without_a_cap_every_traced_row_is_read_in_the_shards_order(tmp_path):
    paths = label_shards(tmp_path, shards=3)
    got = read_traced(paths, VAL, CALIB)
    want = {s: [p for p in ids_in(s) if int(p[1:]) < 75] for s in ("val", "train")}
    assert {s: [r.prompt_id for r in got[s]] for s in ("val", "train")} == want
    assert got["counts"]["used"] == got["counts"]["traced"] == {s: len(want[s]) for s in ("train", "val")}
    assert read_traced(paths, VAL, CALIB, max_rows=1000)["val"] == got["val"]  # a cap above them: the same rows
    assert read_traced([], VAL, CALIB)["val"] == []


def test_the_cap_is_a_config_key_that_refuses_zero():
    from pipeline.runtime.checks import ConfigError
    from pipeline.runtime.config import load_config

    assert load_config([]).tune.max_rows == 2000 and load_config(["tune.max_rows=null"]).tune.max_rows is None
    with pytest.raises(ConfigError, match="config key 'tune.max_rows'"):
        load_config(["tune.max_rows=0"])
