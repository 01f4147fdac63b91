"""The memory plan at the stages (pipeline/executor/memory_checks.py), without Ray: the label worker's preflight check against a
budget, label.batch_size=auto labelling at the batch its plan fits, and evaluate's pass at load bounded by it."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from conftest import ONE_SOURCE
from pipeline.executor.driver import run_stage
from pipeline.executor.local import LocalExecutor
from pipeline.executor.preflight import device_facts
from pipeline.io.shards import decode_metadata
from pipeline.runtime.config import load_config
from stages.label import LabelStage
from pipeline.executor.memory_checks import GiB, label_check
from stages.prepare import PrepareStage

BASE = ["progress=false", "decode.max_new_tokens=16", "prepare.shard_size=4", "prepare.limit=8", "label.k=2",
        "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1", "profile.context_lengths=[16]",
        "profile.concurrency=[1]", "evaluate.concurrency=[1]", "model.device=cpu", *ONE_SOURCE]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    out = tmp_path_factory.mktemp("mem")
    run_stage(PrepareStage(load_config([f"output_dir={out}", *BASE])), LocalExecutor())
    return out


def test_a_batch_over_the_budget_is_refused_naming_the_key_and_auto_fits_it(prompts):
    stage = LabelStage(load_config([f"output_dir={prompts}", *BASE, "label.batch_size=64", "label.memory_gb=0.05"]))
    facts = device_facts("cpu")
    got = label_check(stage, facts, torch.float32)
    assert got["key"] == "label.batch_size" and got["have"] == int(0.05 * GiB) and got["need"] > got["have"], got
    assert "label.batch_size=64 plans" in got["detail"] and "set label.batch_size=auto (it would take" in got["detail"]
    auto = LabelStage(load_config([f"output_dir={prompts}", *BASE, "label.batch_size=auto", "label.memory_gb=0.05"]))
    fit = label_check(auto, facts, torch.float32)
    assert fit["need"] <= fit["have"] and 1 <= fit["batch"] < 64, fit
    bigger = LabelStage(load_config([f"output_dir={prompts}", *BASE, "label.batch_size=auto", "label.memory_gb=0.2"]))
    assert label_check(bigger, facts, torch.float32)["batch"] > fit["batch"]  # more budget, a larger batch


def test_label_batch_size_auto_labels_at_the_batch_the_plan_fits(prompts, tmp_path, one_thread):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(prompts / "prompts", out / "prompts")
    cfg = load_config([f"output_dir={out}", *BASE, "label.batch_size=auto", "label.memory_gb=0.05"])
    expected = label_check(LabelStage(cfg), device_facts("cpu"), torch.float32)["batch"]
    summary = run_stage(LabelStage(cfg), LocalExecutor())
    assert summary["rows"] == 8
    shards = sorted((out / "labels").glob("part-*.parquet"))
    meta = [decode_metadata(pq.read_schema(p).metadata) for p in shards]
    assert {m["label_batch_size"] for m in meta} == {expected}, meta
    # the batching counts reach the summary: every shard's batches, none failed
    batching = json.loads((out / "labels" / "summary.json").read_text())["batching"]
    assert batching["batches"] == sum(-(-4 // expected) for _ in shards) and batching["batches_failed"] == 0


def test_a_batch_out_of_memory_is_halved_until_it_fits_and_counted():
    """ShardBatches with a labeller that runs out of memory above 2 prompts (as a GPU's allocator says it): the
    batch of 4 is halved into two batches of 2 that fit (not four of one), every prompt is labelled, and the counts
    say what the batching cost."""
    from pipeline.labelling.batched import ShardBatches

    def label(batch):
        if len(batch) > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [sum(p) for p in batch]

    ids = [f"p{i}" for i in range(6)]
    batches = ShardBatches(ids, [[i] * (i + 1) for i in range(6)], 4, label)
    got = [batches({"prompt_id": i}) for i in ids]
    assert got == [i * (i + 1) for i in range(6)]
    assert batches.counts() == {"batches": 4, "batches_failed": 1, "batches_out_of_memory": 1,
                                "prompts_retried_alone": 0}
    seen = []  # batch sizes, in order: 4 ran out of memory, its halves fit; then the last 2
    ShardBatches(ids, [[i] * (i + 1) for i in range(6)], 4, lambda b: seen.append(len(b)) or label(b))(
        {"prompt_id": "p0"})
    assert seen == [4, 2, 2]


def test_a_batch_out_of_memory_above_one_prompt_halves_down_to_one():
    """Out of memory above 1 prompt: 8 -> 4 -> 2 -> 1, every prompt labelled alone in the end; a prompt that
    does not fit even alone gets the out-of-memory error for its row (each_prompt: an out_of_memory reject)."""
    from pipeline.labelling.batched import ShardBatches

    sizes = []

    def label(batch):
        sizes.append(len(batch))
        if len(batch) > 1 or batch[0] == [7]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [sum(batch[0])]

    batches = ShardBatches([f"p{i}" for i in range(8)], [[i] for i in range(8)], 8, label)
    got = []
    for i in range(8):
        try:
            got.append(batches({"prompt_id": f"p{i}"}))
        except RuntimeError as err:
            got.append(str(err)[:18])
    assert got == [0, 1, 2, 3, 4, 5, 6, "CUDA out of memory"]
    assert sizes == [8, 4, 2, 1, 1, 2, 1, 1, 4, 2, 1, 1, 2, 1, 1]
    assert batches.counts()["batches_out_of_memory"] == 8  # 8, 4, 2, 4, 2, 2, 2 and p7 alone


def test_a_failed_batchs_frames_are_gone_before_the_cache_is_emptied(monkeypatch):
    """The exception of a batch that ran out of memory holds the batch's tensors in its frames: they must be
    released before torch.cuda.empty_cache runs, else the allocator cannot give that memory back. Here a
    weak-referenced object stands for the tensors, and the cache emptying checks it is gone."""
    import weakref

    from pipeline.labelling import batched

    class Activations:  # what the failed forward held
        pass

    refs, alive_at_empty = [], []

    def label(batch):
        held = Activations()
        refs.append(weakref.ref(held))
        if len(batch) > 1 or batch[0] == [3]:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [sum(batch[0])]

    monkeypatch.setattr(batched, "_free_cuda", lambda kind: alive_at_empty.append(
        (kind, sum(r() is not None for r in refs))))
    b = batched.ShardBatches([f"p{i}" for i in range(4)], [[i] for i in range(4)], 4, label)
    for i in range(3):
        b({"prompt_id": f"p{i}"})
    with pytest.raises(RuntimeError, match="out of memory") as err:
        b({"prompt_id": "p3"})
    assert [k for k, _ in alive_at_empty] == ["memory"] * 4  # the 4, then (p0, p1), (p2, p3) and p3 alone
    assert all(n == 0 for _, n in alive_at_empty), alive_at_empty


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                                                "can't allocate memory: you tried to allocate 8589934592 bytes."),
                                   MemoryError()])
def test_every_out_of_memory_is_counted_as_one_and_a_prompt_failing_alone_is_its_own_error(error):
    """The allocators' three ways of saying it (CUDA's, the CPU allocator's, Python's) count as out of memory; a
    prompt that fails alone too gets its own error for its row, and its batch-mates are labelled."""
    from pipeline.labelling.batched import ShardBatches

    def label(batch):
        if len(batch) > 2:
            raise error
        if [5] * 6 in batch:  # p5 fails on its own as well
            raise ValueError("p5 is broken")
        return [sum(p) for p in batch]

    ids = [f"p{i}" for i in range(6)]
    batches = ShardBatches(ids, [[i] * (i + 1) for i in range(6)], 4, label)
    got = []
    for i in ids:
        try:
            got.append(batches({"prompt_id": i}))
        except ValueError as err:
            got.append(str(err))
    assert got == [0, 2, 6, 12, 20, "p5 is broken"]
    # the batch of 4 ran out of memory and its halves fit; the batch of 2 (p4, p5) failed on p5's own error, not
    # counted as memory, and was retried prompt by prompt
    assert batches.counts() == {"batches": 4, "batches_failed": 2, "batches_out_of_memory": 1,
                                "prompts_retried_alone": 2}


def test_a_failure_that_is_not_memory_is_not_counted_as_out_of_memory():
    from pipeline.labelling.batched import ShardBatches

    def label(batch):
        if len(batch) > 2:
            raise RuntimeError("shape mismatch in the draft's block")
        return [sum(p) for p in batch]

    batches = ShardBatches([f"p{i}" for i in range(4)], [[i] for i in range(4)], 4, label)
    assert [batches({"prompt_id": f"p{i}"}) for i in range(4)] == [0, 1, 2, 3]
    assert batches.counts() == {"batches": 1, "batches_failed": 1, "batches_out_of_memory": 0,
                                "prompts_retried_alone": 4}
