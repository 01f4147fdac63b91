"""Each folder loads as itself (issue #25, item 1): `datasets.load_dataset(DIR)` keys its cache on what the card's
front matter declares and on the folder's base name, never on the files; every run names its folders alike
(`labels/`, `prompts/`), so two runs' folders once shared one cache entry and the second load returned the first
folder's rows. The card now carries the folder's content hash.

Both folders of each pair are written by the real stages through the real driver: prompts by two prepare runs of
different sizes; labels by the session's real label set (8 rows) and by a copy of its run whose second prompt shard
was dropped, relabelled by the label stage (a resume that keeps the proven first shard: 4 rows, no decoding).
"""

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.runtime.config import load_config
from conftest import ONE_SOURCE


def folder_ids(folder: Path) -> list:
    return sorted(pa.concat_tables([pq.read_table(p, columns=["prompt_id"]) for p in
                                    sorted(folder.glob("part-*.parquet"))])["prompt_id"].to_pylist())


def load_ids(folder: Path, cache: Path) -> list:
    import datasets

    return sorted(datasets.load_dataset(str(folder), cache_dir=str(cache))["train"]["prompt_id"])


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local folders: nothing may come from the network


def test_two_prompt_folders_load_as_themselves_from_one_cache(tmp_path):
    from stages.prepare import PrepareStage

    folders = []
    for run, limit in (("runA", 8), ("runB", 4)):
        cfg = load_config([f"output_dir={tmp_path / run}", "progress=false", "prepare.shard_size=4",
                           f"prepare.limit={limit}", *ONE_SOURCE])
        run_stage(PrepareStage(cfg), LocalExecutor())
        folders.append(tmp_path / run / "prompts")
    a, b = (folder_ids(f) for f in folders)
    assert len(a) == 8 and len(b) == 4  # two different folders, both named prompts/
    cache = tmp_path / "hf-cache"
    assert load_ids(folders[0], cache) == a
    assert load_ids(folders[1], cache) == b  # not A's 8 rows from the shared cache entry
    assert load_ids(folders[0], cache) == a


def test_two_label_folders_load_as_themselves_from_one_cache(real_labels, tmp_path):
    from stages.label import LabelStage

    run_a = Path(shutil.copytree(real_labels.parent, tmp_path / "runA"))
    run_b = Path(shutil.copytree(real_labels.parent, tmp_path / "runB"))
    # Run B labelled only the first prompt shard: drop the second one and let the label stage resume the folder.
    (run_b / "prompts" / "part-00001.parquet").unlink()
    (run_b / "labels" / "part-00001.parquet").unlink()
    # The label set's own resolved config (its config.yaml), in run B's folder: the same fingerprint, so no drift.
    cfg = load_config([f"output_dir={run_b}"], config_file=str(run_b / "labels" / "config.yaml"))
    summary = run_stage(LabelStage(cfg), LocalExecutor())
    assert summary["rows"] == 4 and summary["shards"] == 1
    a, b = folder_ids(run_a / "labels"), folder_ids(run_b / "labels")
    assert len(a) == 8 and b == sorted(pq.read_table(run_a / "labels" / "part-00000.parquet")["prompt_id"].to_pylist())
    cache = tmp_path / "hf-cache"
    assert load_ids(run_a / "labels", cache) == a
    assert load_ids(run_b / "labels", cache) == b  # 4 rows, its own, not A's 8
