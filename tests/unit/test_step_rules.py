"""Per-step verify length (pipeline/policy/step_rules.py) in the engine: still exact at T = 0 (the target's greedy
continuation, stop tokens and the max_new_tokens cut included), a full rule replaying plain sampling draw for draw,
and the rules' own arithmetic. The chi-square test of a cut block's sampling at T > 0 (2,000 draws a case) is
tests/integration/test_step_rule_sampling.py's."""

import pytest
import torch

from pipeline.decoding.engine import Engine, greedy_reference
from pipeline.policy.step_rules import ConfidenceThreshold, Full, RunningAcceptance, parse_rule
from random_pair import EOS_ID, learned_rule, make_pair, prompt

B_MAX = 6
RULES = [ConfidenceThreshold(0.9), ConfidenceThreshold(0.3), ConfidenceThreshold(1.0), RunningAcceptance(0.5, 0.0),
         RunningAcceptance(0.3, 2.0), learned_rule(B_MAX), learned_rule(B_MAX, slope=0.05),
         learned_rule(B_MAX, rate=2.5)]


@pytest.mark.parametrize("seed", [0, 1, 3])
@pytest.mark.parametrize("rule", RULES, ids=lambda r: str(r.describe()))
def test_greedy_with_a_rule_is_the_targets_greedy_continuation(seed, rule):
    target, draft = make_pair(seed, block_size=B_MAX)
    engine = Engine(target, draft, [EOS_ID])
    ids = prompt(seed)
    state = engine.prefill(ids)
    res = engine.decode(state, block_size=B_MAX, max_new_tokens=40, step_rule=rule)
    ref = greedy_reference(target, ids, 40, [EOS_ID])
    assert torch.equal(res.output_ids, ref), f"{rule.describe()}: not the target's greedy continuation"
    assert len(res.verified) == res.steps and all(1 <= v <= B_MAX - 1 for v in res.verified)
    assert all(c <= v + 1 for c, v in zip(res.committed, res.verified))  # never commits more than it verified
    assert res.step_rule == rule.describe()


def test_rules_actually_cut_and_full_is_plain_decoding():
    target, draft = make_pair(0, block_size=B_MAX)
    engine = Engine(target, draft, [EOS_ID])
    state = engine.prefill(prompt(0))
    plain = engine.decode(state, block_size=B_MAX, max_new_tokens=40)
    full = engine.decode(state, block_size=B_MAX, max_new_tokens=40, step_rule=Full())
    assert torch.equal(full.output_ids, plain.output_ids) and full.committed == plain.committed
    assert full.verified == plain.verified  # plain decoding records what it verified too
    cut = engine.decode(state, block_size=B_MAX, max_new_tokens=40, step_rule=ConfidenceThreshold(1.0))
    assert set(cut.verified) == {1}  # nothing is certain: one drafted token per step
    assert sum(cut.verified) < sum(plain.verified)


def test_sampling_with_full_rule_replays_plain_sampling_draw_for_draw():
    target, draft = make_pair(1, block_size=B_MAX)
    engine = Engine(target, draft, [EOS_ID])
    state = engine.prefill(prompt(1))
    kw = dict(block_size=B_MAX, max_new_tokens=30, temperature=1.0, top_k=20, seed=5)
    a, b = engine.decode(state, **kw), engine.decode(state, step_rule=Full(), **kw)
    assert torch.equal(a.output_ids, b.output_ids) and a.committed == b.committed


@pytest.mark.parametrize("rule", [ConfidenceThreshold(0.5), RunningAcceptance(0.5, 0.0), learned_rule(B_MAX, 0.05)],
                         ids=["threshold", "ema", "learned"])
def test_stop_token_mid_block_and_max_new_tokens_cut(rule):
    target, draft = make_pair(0, block_size=B_MAX)
    ids = prompt(0)
    free = greedy_reference(target, ids, 30)[0, ids.shape[1]:].tolist()
    stop = free[7]  # a token the greedy continuation reaches mid-way
    res = Engine(target, draft, [stop]).decode(Engine(target, draft, [stop]).prefill(ids), block_size=B_MAX,
                                                max_new_tokens=30, step_rule=rule)
    assert torch.equal(res.output_ids, greedy_reference(target, ids, 30, [stop])) and res.stopped
    for n in (1, 2, 5, 11):
        cut = Engine(target, draft).decode(Engine(target, draft).prefill(ids), block_size=B_MAX, max_new_tokens=n,
                                           step_rule=rule)
        assert cut.new_ids.tolist() == free[:n]


def test_rule_arithmetic_and_parsing():
    conf = torch.tensor([0.9, 0.8, 0.5, 0.99])
    assert ConfidenceThreshold(0.7).verify_length(conf, []) == 2  # 0.9, 0.72 | 0.36
    assert ConfidenceThreshold(0.95).verify_length(conf, []) == 1  # at least one
    assert ConfidenceThreshold(0.95, min_tokens=3).verify_length(conf, []) == 3
    assert ConfidenceThreshold(0.0).verify_length(conf, []) == 4
    ema = RunningAcceptance(alpha=0.5, slack=1.0)
    assert ema.verify_length(conf, []) == 4  # no history: the whole block
    assert ema.verify_length(conf, [3]) == 3  # accepted 2, + 1 slack
    assert ema.verify_length(conf, [3, 1]) == 2  # ema 1.0 + 1
    assert ema.verify_length(conf, [9, 9]) == 4  # clipped to the block
    assert parse_rule("threshold:0.6") == ConfidenceThreshold(0.6)
    assert parse_rule("threshold:0.6:2") == ConfidenceThreshold(0.6, 2)
    assert parse_rule("ema:0.3:1.5") == RunningAcceptance(0.3, 1.5) and parse_rule("full") == Full()
    for bad in ("threshold", "threshold:1.5", "ema:0", "speed:1", "threshold:x"):
        with pytest.raises(ValueError, match="step rule"):
            parse_rule(bad)


def test_a_rule_needs_a_block_to_cut():
    target, draft = make_pair(0, block_size=B_MAX)
    engine = Engine(target, draft)
    with pytest.raises(ValueError, match="block_size >= 2"):
        engine.decode(engine.prefill(prompt(0)), block_size=1, max_new_tokens=4, step_rule=Full())


def test_the_learned_rule_round_trips_through_its_file_and_the_rule_fallback(tmp_path):
    """tune writes verify_model.json; load_rule and RuleFallback (what AdaptiveDecoder runs) read it back as the same
    rule, and the engine decodes the target's greedy continuation with it."""
    import json

    from pipeline.decoding.adaptive import RuleFallback
    from pipeline.io.layout import VERIFY_MODEL
    from pipeline.policy.step_rules import LearnedVerify, load_rule

    rule = learned_rule(B_MAX, slope=0.05)
    (tmp_path / VERIFY_MODEL).write_text(json.dumps(rule.to_dict()))
    loaded = load_rule("learned", tmp_path)
    assert isinstance(loaded, LearnedVerify) and loaded.step_seconds == rule.step_seconds
    assert loaded.model.weights == rule.model.weights
    fallback = RuleFallback.from_tune({"rule": "learned", "max_block_size": B_MAX, "gain": 0.01}, tmp_path)
    assert fallback.step_rule() == loaded and RuleFallback.from_tune({"rule": "learned", "max_block_size": B_MAX,
                                                                      "gain": -0.01}, tmp_path) is None
    target, draft = make_pair(1, block_size=B_MAX)
    engine = Engine(target, draft, [EOS_ID])
    ids = prompt(1)
    res = engine.decode(engine.prefill(ids), block_size=B_MAX, max_new_tokens=30, step_rule=fallback.step_rule())
    assert torch.equal(res.output_ids, greedy_reference(target, ids, 30, [EOS_ID]))
    assert len(set(res.verified)) > 1  # it cut at more than one length
    with pytest.raises(ValueError, match="fitted by blockpilot tune"):
        parse_rule("learned")
    with pytest.raises(ValueError, match="needs the folder"):
        load_rule("learned")
