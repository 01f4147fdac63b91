"""Labelling's target continuation decoded speculatively (pipeline/labelling/continuation.py): the same labels as the
one-token greedy decode, and the per-batch choice between the two by the cost profile (CPU, fp32, 1 thread)."""

import pytest
import torch

from pipeline.decoding.engine import Engine
from pipeline.labelling.batched import batched_replay_label_prompts
from pipeline.labelling.continuation import ContinuationChoice, speculative_continuations
from pipeline.labelling.greedy import greedy_continuations
from pipeline.labelling.labels import candidate_block_sizes
from pipeline.policy.cost import CostProfile
from random_pair import EOS_ID, make_pair, prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_speculative_continuation_labels_equal_greedy_on_the_tiny_pair():
    """The shipped pair on real prompts of mixed length, stopping on newlines for some: g, tau at every candidate,
    steps, labels and the policy's feature are those of the one-token greedy decode."""
    from pipeline.data.sources import build_prompts
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig, load_config

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=4)
    prompts = [r["input_ids"] for r in rows][:16]
    newline = m.tokenizer("\n", add_special_tokens=False)["input_ids"][-1:]
    engine = Engine(m.target, m.draft, m.stop_token_ids + newline)
    cands = candidate_block_sizes(8, 3)
    greedy = batched_replay_label_prompts(engine, prompts, cands, 32, trace_block_size=10)
    spec = batched_replay_label_prompts(engine, prompts, cands, 32, trace_block_size=10, continuation_block_size=8)
    for a, b in zip(greedy, spec, strict=True):
        assert (a.tau, a.steps, a.new_tokens, a.label_index) == (b.tau, b.steps, b.new_tokens, b.label_index)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    assert any(o.new_tokens[0] < 32 for o in spec) and any(o.new_tokens[0] == 32 for o in spec)
    assert len({o.label_block_size for o in spec}) >= 2


@pytest.mark.parametrize("block_size", [2, 5])
def test_speculative_g_and_features_equal_greedy_on_a_random_pair(block_size):
    """g, the prefill logits and every context feature the draft can read, against greedy_continuations, with a stop
    token that cuts some continuations and prompts of 1 to 31 tokens. A feature one position off fails."""
    target, draft = make_pair(2)
    engine = Engine(target, draft, [EOS_ID])
    prompts = [prompt(i, length=n).tolist()[0] for i, n in enumerate((1, 31, 5, 18, 9))]
    g, ctx, logits, _ = greedy_continuations(target, prompts, 16, [EOS_ID], layer_ids=draft.target_layer_ids)
    g2, ctx2, logits2, _ = speculative_continuations(engine, prompts, 16, block_size)
    assert g == g2
    torch.testing.assert_close(logits, logits2, rtol=1e-4, atol=1e-5)
    for i, (p, c) in enumerate(zip(prompts, g)):
        n = len(p) + len(c) - 1  # positions 0 .. len(prompt + g) - 2
        torch.testing.assert_close(ctx[i, :n], ctx2[i, :n], rtol=1e-4, atol=1e-5)


def _profile(ar_ms, spec_ms, B=8):
    """A cost profile whose load grid (c = 4, 16) prices b = 1 at ar_ms and b = B at spec_ms, flat in c and width."""
    fit = {"draft": {"intercept": spec_ms / 2e3, "slope": 0.0}, "verify": {"intercept": spec_ms / 2e3, "slope": 0.0}}
    load = {str(c): {"seconds": {"1": ar_ms / 1e3, str(B): spec_ms / 1e3}, "fit": fit} for c in (4, 16)}
    return CostProfile({1: ar_ms / 1e3, B: spec_ms / 1e3}, fit=fit, meta={"load": load, "concurrency": [1, 4, 16]},
                       version=3)


def test_the_choice_follows_the_predicted_costs():
    # A step 3x an AR step: speculative wins once tau(B) > 3, not before; nothing is predicted before a tau.
    choice = ContinuationChoice("auto", 8, _profile(10, 30))
    assert choice.choose(64, 128) == "greedy" and choice.last["predicted_speculative_seconds"] is None
    choice.observe([2.0, 2.5])
    assert choice.choose(64, 128) == "greedy"
    assert choice.last["predicted_greedy_seconds"] == pytest.approx(128 * 0.010)
    assert choice.last["predicted_speculative_seconds"] == pytest.approx(57 * 0.030)  # ceil(128 / 2.25) steps
    choice.observe([6.0] * 8)
    assert choice.choose(64, 128) == "speculative" and "speculative b=8" in choice.describe()
    shard = choice.drained()  # a shard's batches: their choices and predictions, then the counts from them
    assert choice.counts(shard) == {"continuation_greedy": 2, "continuation_speculative": 1, "continuation_vllm": 0,
                                    "continuation_vllm_fallback": 0}
    assert [r["continuation"] for r in shard] == ["greedy", "greedy", "speculative"]
    assert choice.counts(choice.drained()) == {"continuation_greedy": 0, "continuation_speculative": 0,
                                               "continuation_vllm": 0, "continuation_vllm_fallback": 0}


def test_forced_modes_and_no_profile():
    forced = ContinuationChoice("speculative", 8, None)
    assert forced.choose(4, 16) == "speculative"
    assert ContinuationChoice("auto", 8, None).choose(4, 16) == "greedy"  # nothing to predict with
    with pytest.raises(ValueError, match="label.continuation"):
        ContinuationChoice("fast", 8, None)


def test_the_label_stage_writes_the_same_rows_either_way_and_counts_the_continuations(tmp_path):
    """label.continuation=speculative against greedy through the label stage (LocalExecutor): the same tau, steps
    and labels row by row, and the summary counts which way every batch went."""
    import json
    import shutil

    import pyarrow.parquet as pq

    from conftest import ONE_SOURCE
    from pipeline.executor.driver import run_stage
    from pipeline.executor.local import LocalExecutor
    from pipeline.runtime.config import load_config
    from stages.label import LabelStage
    from stages.prepare import PrepareStage

    base = ["progress=false", "decode.max_new_tokens=16", "prepare.shard_size=4", "prepare.limit=8", "label.k=2",
            "label.batch_size=4", "profile.steps=2", "profile.min_repeats=1", "profile.max_repeats=1",
            "profile.context_lengths=[16]", "profile.concurrency=[1,4]", "evaluate.concurrency=[1,4]", "model.device=cpu",
            *ONE_SOURCE]
    run_stage(PrepareStage(load_config([f"output_dir={tmp_path / 'p'}", *base])), LocalExecutor())
    rows = {}
    for way in ("greedy", "speculative"):
        out = tmp_path / way
        shutil.copytree(tmp_path / "p" / "prompts", out / "prompts")
        summary = run_stage(LabelStage(load_config([f"output_dir={out}", *base, f"label.continuation={way}"])),
                            LocalExecutor())
        assert summary["rows"] == 8
        batching = json.loads((out / "labels" / "summary.json").read_text())["batching"]
        other = "speculative" if way == "greedy" else "greedy"
        assert batching[f"continuation_{way}"] == batching["batches"] > 0 and batching[f"continuation_{other}"] == 0
        from pipeline.io.shards import decode_metadata

        for f in sorted((out / "labels").glob("part-*.parquet")):  # every batch's choice and its predictions
            recorded = decode_metadata(pq.read_schema(f).metadata)["continuations"]
            assert recorded and all(r["continuation"] == way and r["predicted_greedy_seconds"] > 0 for r in recorded)
        t = [r for f in sorted((out / "labels").glob("part-*.parquet"))
             for r in pq.read_table(f, columns=["prompt_id", "tau", "steps", "label_block_size", "trace_match"]).to_pylist()]
        rows[way] = sorted((r["prompt_id"], r["tau"], r["steps"], r["label_block_size"], r["trace_match"]) for r in t)
    assert rows["greedy"] == rows["speculative"]
