"""DecodingStage.longest_prompt (issue #66 item 1): every decoding worker sizes its memory plan for the longest
prompt inside its timed preflight, and read every prompt shard's ``prompt_tokens`` for it: 15-30 minutes a worker at
15,625 shards on S3, against workers.check_timeout_s 900. prepare now records it in the prompts' manifest, and
longest_prompt reads that one file; a folder prepared before that is still read shard by shard, said once."""

import json

import pyarrow.parquet as pq

from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.io import storage
from pipeline.io.shards import list_shards
from pipeline.runtime.config import load_config
from stages.decoding import DecodingStage
from stages.prepare import PrepareStage


def prepared(tmp_path):
    """A prompts folder of 24 shards (two prompts each) from two bundled sets."""
    cfg = load_config([f"output_dir={tmp_path}", "progress=false", "prepare.limit=24", "prepare.shard_size=2",
                       "prepare.shards_per_worker=0", "prepare.sources=[{name: code, kind: bundled, path: code}, "
                       "{name: docs, kind: bundled, path: docs}]"])
    run_stage(PrepareStage(cfg), LocalExecutor())
    shards = list_shards(tmp_path / "prompts")
    truth = max(max(pq.read_table(p, columns=["prompt_tokens"]).column(0).to_pylist()) for p in shards)
    return cfg, len(shards), truth


def stage_for(cfg, tmp_path):
    return DecodingStage(cfg, tmp_path / "labels", tmp_path / "prompts", None, "label.num_workers")


def test_the_longest_prompt_is_one_read_of_the_manifest_not_of_every_shard(tmp_path, monkeypatch):
    cfg, shards, truth = prepared(tmp_path)
    manifest = json.loads((tmp_path / "prompts" / "manifest.json").read_text())
    assert shards == 24 and manifest["prompt_tokens"] == {"max": truth, "prompts": manifest["rows"]}

    def refuse(*args, **kwargs):
        raise AssertionError("longest_prompt read a prompt shard")

    monkeypatch.setattr(storage, "read_table", refuse)
    monkeypatch.setattr(storage, "parquet_file", refuse)
    assert stage_for(cfg, tmp_path).longest_prompt == truth


def test_a_folder_prepared_before_the_manifest_recorded_it_is_read_shard_by_shard_and_said_once(tmp_path, caplog):
    cfg, shards, truth = prepared(tmp_path)
    path = tmp_path / "prompts" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["prompt_tokens"]
    path.write_text(json.dumps(manifest))
    caplog.set_level("INFO", logger="blockpilot")
    stage = stage_for(cfg, tmp_path)
    assert stage.longest_prompt == truth and stage.longest_prompt == truth
    said = [r.getMessage() for r in caplog.records if "records no longest prompt" in r.getMessage()]
    assert len(said) == 1 and f"its {shards} shard(s)" in said[0], said


def test_no_prompts_yet_is_the_configured_maximum(tmp_path):
    cfg = load_config([f"output_dir={tmp_path}", "prepare.max_prompt_tokens=321"])
    assert stage_for(cfg, tmp_path).longest_prompt == 321
