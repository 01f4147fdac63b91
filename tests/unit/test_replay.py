"""Exact greedy replay (label.mode=replay) against exhaustive labelling, prompt by prompt (CPU, fp32)."""

import pytest
import torch

from pipeline.engine import Engine
from pipeline.labeling import candidate_block_sizes, label_prompt, replay_label_prompt
from pipeline.replay import PROPOSERS, walk
from random_pair import EOS_ID, make_pair, prompt

MAX_NEW = 24


def _compare(engine, ids, candidates, max_new, stats):
    ref = label_prompt(engine, ids, candidates, max_new)
    for proposer in PROPOSERS:
        rep = replay_label_prompt(engine, ids, candidates, max_new, proposer=proposer)
        assert rep.tau == ref.tau, f"tau differs ({proposer})"
        assert rep.steps == ref.steps and rep.new_tokens == ref.new_tokens
        assert rep.label_index == ref.label_index and rep.label_block_size == ref.label_block_size
    stats["prompts"] += 1
    stats["accepting"] += any(t > 1 for t in ref.tau)
    stats["max_new"] += ref.new_tokens[0] == max_new
    stats["stopped"] += ref.new_tokens[0] < max_new
    stats["distinct_labels"].add(ref.label_block_size)


def test_replay_equals_exhaustive_on_random_pairs():
    stats = {"prompts": 0, "accepting": 0, "max_new": 0, "stopped": 0, "distinct_labels": set()}
    for seed in range(4):
        for B in (4, 6):
            target, draft = make_pair(seed, block_size=B)
            cands = candidate_block_sizes(B, 2 if B > 3 else 1)
            free = Engine(target, draft)
            for p in range(3):
                ids = prompt(seed * 10 + p, length=8 + p)
                # A stop token that the greedy continuation reaches mid-way: both modes must cut there.
                g = free.decode(free.prefill(ids), block_size=B, max_new_tokens=MAX_NEW).new_ids.tolist()
                stop = g[min(len(g) - 1, 9 + p)]
                for stops in ([EOS_ID], [stop]):
                    _compare(Engine(target, draft, stops), ids, cands, MAX_NEW, stats)
    assert stats["prompts"] == 48
    # The comparison must have covered the interesting cases, not only trivial ones.
    assert stats["accepting"] > 10 and stats["max_new"] > 5 and stats["stopped"] > 5
    assert len(stats["distinct_labels"]) >= 2


def test_walk_clips_like_the_engine():
    g = [0, 0, 5, 6, 7, 8, 9]  # prompt of 2, then 5 new tokens
    always_right = lambda s, vs: g[s + 1:s + vs]  # noqa: E731
    assert walk(g, 2, 7, 4, always_right, []) == [4]  # 3 accepted + bonus: the 4 tokens after the first
    assert walk(g, 2, 7, 3, always_right, []) == [3, 1]  # the last step is clipped at max_length
    assert walk(g, 2, 7, 4, always_right, [7]) == [2]  # the stop token ends the step at itself
    assert walk(g, 2, 7, 1, always_right, []) == [1, 1, 1, 1]
    never = lambda s, vs: [-1] * (vs - 1)  # noqa: E731
    assert walk(g, 2, 7, 4, never, []) == [1, 1, 1, 1]
    assert walk([0, 0, 9], 2, 7, 4, never, [9]) == []  # first token is a stop token: no step


def test_replay_refuses_sampling():
    target, draft = make_pair(0)
    with pytest.raises(ValueError, match="temperature 0"):
        replay_label_prompt(Engine(target, draft), prompt(0), [3, 4, 5], 10, temperature=0.8)


def test_replay_equals_exhaustive_on_the_tiny_pair():
    """The shipped pair (fp32, CPU) on 52 held-out prompts: half stop at a newline token (stop-token clipping),
    half run to max_new_tokens. With the 48 random-pair prompts above: 100 prompts in all."""
    from pipeline.config import ModelConfig, load_config
    from pipeline.models import load_models
    from pipeline.sources import build_prompts

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    rows, _, _ = build_prompts(load_config().prepare.sources, m.tokenizer, 1024, limit=52)
    newline = m.tokenizer("\n", add_special_tokens=False)["input_ids"]
    stats = {"prompts": 0, "accepting": 0, "max_new": 0, "stopped": 0, "distinct_labels": set()}
    for i, row in enumerate(rows):
        stops = m.stop_token_ids if i % 2 else m.stop_token_ids + newline[-1:]
        ids = torch.tensor(row["input_ids"])[None]
        _compare(Engine(m.target, m.draft, stops), ids, candidate_block_sizes(8, 2), 48, stats)
    assert stats["prompts"] == 52 and stats["accepting"] > 20
    assert stats["max_new"] >= 10 and stats["stopped"] >= 10
