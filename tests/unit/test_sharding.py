"""The shard rule (pipeline/executor/sharding.py): every expected label worker gets several shards when the
prompts allow. Before, 2,000 prompts at prepare.shard_size 64 made 32 shards for 64 GPUs: half of them idle."""

import math

import pytest

from pipeline.executor.sharding import MIN_SHARD, shard_size_for


@pytest.mark.parametrize("prompts, workers, max_size, per_worker, size", [
    (2000, 64, 64, 4, 8),    # 250 shards of 8: ~3.9 a worker, every GPU busy (64 a shard: 32 shards, 32 GPUs idle)
    (2000, 8, 64, 4, 63),    # 32 shards of 63: 4 a worker
    (520, 2, 64, 4, 64),     # the default run: 9 shards of 64 already give 2 workers 4 each
    (100000, 64, 64, 4, 64),  # plenty of prompts: the configured size
    (16, 2, 8, 4, 8),        # the tests' runs: never under MIN_SHARD
    (5, 64, 64, 4, 8),       # fewer prompts than MIN_SHARD: one shard of them all
    (2000, 64, 64, 0, 64),   # shards_per_worker 0: the configured size
])
def test_the_rule(prompts, workers, max_size, per_worker, size):
    assert shard_size_for(prompts, workers, max_size, per_worker) == size


def test_every_worker_gets_several_shards_whenever_the_minimum_allows():
    for prompts in (50, 333, 2000, 9999):
        for workers in (1, 8, 64):
            size = shard_size_for(prompts, workers, 64, 4)
            shards = math.ceil(prompts / size)
            # several (at least 3 of the 4 asked: sizes round up) unless the configured size already gives more,
            # or the minimum size caps how many the prompts make
            assert size == 64 or size == MIN_SHARD or shards >= 3 * workers, (prompts, workers, size, shards)
            assert size != MIN_SHARD or shards == math.ceil(prompts / MIN_SHARD)


def test_prepare_cuts_the_label_prompts_for_the_expected_workers(tmp_path):
    """prepare with label.num_workers=4 on 40 prompts: shards of 8 (not one of 40), said in its summary."""
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from pipeline.runtime.config import load_config
    from stages.prepare import PrepareStage

    cfg = load_config([f"output_dir={tmp_path}", "progress=false", "prepare.limit=20", "prepare.shard_size=64",
                       "label.num_workers=4", "prepare.sources=[{name: code, kind: bundled, path: code, "
                       "split: label}, {name: docs, kind: bundled, path: docs, split: label}]"])
    summary = run_stage(PrepareStage(cfg), LocalExecutor())
    assert summary["rows"] == 40 and summary["shards"] == 5 and summary["sharding"] == \
        {"shard_size": 8, "label_workers": 4, "shards_per_worker": 4}, summary
