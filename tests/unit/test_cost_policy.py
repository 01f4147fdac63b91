"""The cost model (pipeline/policy/cost.py) on the real tiny pair, and the speed policy's fallback rule and calibration."""

import json

import numpy as np
import pytest
import torch

from pipeline.io import layout
from pipeline.runtime.config import ConfigError, ModelConfig, load_config
from pipeline.policy.cost import FORMAT, CostProfile, fit_affine, measure_profile
from pipeline.decoding.engine import Engine
from pipeline.decoding.models import load_models
from pipeline.policy.blocksize import (SPEED_SCORE, BlockSizeMLP, BlockSizePolicy, calibrate_margin, speed_gain,
                             speed_targets, split_of)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    m = load_models(ModelConfig())
    return m, Engine(m.target, m.draft, m.stop_token_ids)


def test_profile_times_draft_and_verify_apart_keeps_raw_points_and_round_trips(tiny, tmp_path):
    m, engine = tiny
    stops = engine.stop_token_ids
    p = measure_profile(engine, [1, 2, 16], m.vocab_size, context_lengths=(32, 96), steps=8, min_repeats=3,
                        max_repeats=3, meta={"target": "t"})
    assert engine.stop_token_ids == stops  # restored
    assert sorted(p.seconds) == [1, 2, 16] and p.meta["rounds"] == 3 and p.meta["target"] == "t"
    # b = 1 is autoregressive decoding: its cost is the measured one, not the fit's.
    assert p.cost(1) == p.seconds[1] == p.measured[1]["total"]
    assert p.measured[2]["draft"] > 0 and p.measured[16]["draft"] > 0
    # Every timed decode ran about the asked steps (the token budget comes from the warm-up's own acceptance; the
    # last block may be cut short, which changes the draft's proposals there).
    assert len(p.raw) == 3 * (4 + 2 + 2) * 2 and all(8 <= r["steps"] <= 9 for r in p.raw if r["b"] >= 2)
    # b = 1 (cheap steps that warm up over the first several) runs 4x as many, 4 times a round and context.
    assert p.meta["settings"]["ar_steps"] == 32 and all(r["steps"] == 32 for r in p.raw if r["b"] == 1)
    assert sum(r["b"] == 1 for r in p.raw) == 3 * 4 * 2
    # Version 2: the rule's own work timed at the smallest and largest b >= 2 (on decodes that verify the whole
    # block), and each decode's first step apart (the per-decode term); the fit of both is kept.
    ruled = [r for r in p.raw if r["rule"]]
    assert p.meta["rule_block_sizes"] == [2, 16] and sorted({r["b"] for r in ruled}) == [2, 16]
    assert all(0 < r["rule_seconds"] < r["draft_seconds"] for r in ruled) and p.rule_seconds(16) > 0
    assert all(r["first_draft_seconds"] > 0 and r["first_verify_seconds"] > 0 for r in p.raw if r["b"] >= 2)
    assert p.fit["rule"]["slope"] >= 0 and set(p.fit["first_step"]) == {"speculative", "autoregressive"}
    # The fit is affine and never falls with b (a longer block never costs less). How MUCH a b = 16 step costs
    # over a b = 2 step is timing, not asserted: on a short probe of the tiny pair it measured 1.06x to 1.3x on
    # quiet machines (a `> 1.1x` assert failed CI once). The fit must be the one of the measured medians.
    assert p.fit["draft"]["slope"] >= 0 and p.fit["verify"]["slope"] >= 0 and p.cost(16) >= p.cost(2)
    for k in ("draft", "verify"):  # the line through the two medians, by hand; flat through their mean if it falls
        y2, y16 = p.measured[2][k], p.measured[16][k]
        slope = (y16 - y2) / (16 - 2)
        line = {"intercept": y2 - 2 * slope, "slope": slope} if slope >= 0 else \
            {"intercept": (y2 + y16) / 2, "slope": 0.0}
        assert p.fit[k] == pytest.approx(line, rel=1e-9, abs=1e-12), (k, p.fit[k], line)
    # b between the measured ones: the fit's line through the measured medians (from the medians, not from cost())
    assert p.cost(9) == pytest.approx(sum(p.measured[2][k] + 7 / 14 * (p.measured[16][k] - p.measured[2][k])
                                          for k in ("draft", "verify")))
    p.save(tmp_path / layout.COST_PROFILE)
    d = json.loads((tmp_path / layout.COST_PROFILE).read_text())
    assert d["format"] == FORMAT and set(d["seconds"]) == {"1", "2", "16"} and len(d["raw"]) == 48
    for key in ("hardware", "device", "dtype", "spread", "fit", "context_lengths", "settings", "stable",
                "rule_block_sizes"):
        assert key in d, key
    again = CostProfile.load(tmp_path / layout.COST_PROFILE)
    assert again.costs([1, 2, 16]) == p.costs([1, 2, 16]) and again.raw == p.raw
    with pytest.raises(KeyError):
        CostProfile({1: 0.1}).cost(5)


def test_fit_affine_recovers_a_line():
    f = fit_affine([2, 4, 8], [0.5 + 0.25 * b for b in (2, 4, 8)])
    assert f["intercept"] == pytest.approx(0.5) and f["slope"] == pytest.approx(0.25)
    # Timing noise that slopes down is fitted flat (a longer block never costs less), through the mean.
    f = fit_affine([2, 16], [0.0101, 0.0100])
    assert f == {"intercept": pytest.approx(0.01005), "slope": 0.0}


def test_speed_targets_and_gain():
    tau = np.array([[2.0, 3.0, 3.5], [2.0, 2.0, 2.0]])
    costs = np.array([1.0, 1.2, 1.5])
    t = speed_targets(tau, costs, 1)
    assert t[:, 1] == pytest.approx([0, 0]) and t[0, 2] == pytest.approx(np.log(3.5 / 1.5) - np.log(3.0 / 1.2))
    # Time per token = cost / tau; choosing b index 0 on row 1 saves time there.
    fb = np.array([1, 1])
    g = speed_gain(tau, costs, np.array([1, 0]), fb)
    assert g == pytest.approx((1.2 / 3 + 1.2 / 2) / (1.2 / 3 + 1.0 / 2) - 1)
    assert speed_gain(tau, costs, fb, fb) == 0


def test_calibrated_margin_switches_only_where_predictions_pay():
    rng = np.random.default_rng(0)
    n, costs = 400, np.array([1.0, 1.0, 1.0])
    tau = np.full((n, 3), 3.0)
    good = rng.random(n) < 0.3
    tau[good, 2] = 3.6  # the last candidate really is faster on 30 % of the rows, slower on the others
    tau[~good, 2] = 2.7
    pred_gain = np.where(good, 0.2, 0.0) + rng.normal(0, 0.02, n)  # informative predictions
    best = np.full(n, 2)
    cal = calibrate_margin(pred_gain, best, tau, costs, 0)
    assert cal["margin"] is not None and 0.03 < cal["calibration_gain"] <= speed_gain(
        tau, costs, np.where(good, 2, 0), np.zeros(n, dtype=int)) + 1e-9
    assert 0.04 < cal["margin"] < 0.16 and abs(cal["calibration_switched"] - good.sum()) <= 3
    # Predictions that carry nothing: switching never pays, so the policy always answers the fallback.
    tau_bad = np.full((n, 3), 3.0)
    tau_bad[:, 2] = 2.5
    cal = calibrate_margin(rng.normal(0, 0.1, n), best, tau_bad, costs, 0)
    assert cal["margin"] is None and cal["calibration_gain"] == 0


def test_the_margin_lies_midway_between_predictions_so_no_calibration_row_sits_on_it():
    """A margin equal to a calibration row's own prediction decided that row by the last bit: the same logits scored
    in another batch shape or in float32 (serving; test_stages' recomputation) could land on either side. The
    margin is midway between the last prediction left on the fallback and the first switched; a prediction that
    moved by float32 noise (1e-7) is decided as on the calibration rows."""
    n, costs = 40, np.array([1.0, 1.0])
    pred = np.repeat([0.1, 0.2, 0.3, 0.4], n // 4)
    tau = np.full((n, 2), 3.0)
    tau[pred >= 0.3, 1] = 4.0  # switching pays exactly where the prediction is 0.3 or more, and loses below
    tau[pred < 0.3, 1] = 2.0
    cal = calibrate_margin(pred, np.ones(n, dtype=int), tau, costs, 0)
    assert cal["margin"] == pytest.approx(0.25) and cal["calibration_switched"] == n // 2
    for p in (0.2, 0.3):
        for noise in (-1e-7, 1e-7):
            assert (p + noise > cal["margin"]) == (p > cal["margin"])
    # Every row switched (all predictions pay): the margin sits below the lowest, by half the first gap.
    tau[:, 1] = 4.0
    assert calibrate_margin(pred, np.ones(n, dtype=int), tau, costs, 0)["margin"] == pytest.approx(0.05)


def speed_policy(vocab, margin, fallback=8):
    torch.manual_seed(0)
    info = {"score": SPEED_SCORE, "fallback_block_size": fallback, "margin": margin, "score_scale": 1.0}
    return BlockSizePolicy(BlockSizeMLP(vocab, 5, hidden=64, n_layers=2), [6, 7, 8, 9, 10], vocab, "none", info)


def test_choose_falls_back_unless_the_predicted_gain_beats_the_margin(tiny, tmp_path):
    m, engine = tiny
    x = torch.randn(64, m.vocab_size, generator=torch.Generator().manual_seed(1)) * 3  # whatever ran before
    pol = speed_policy(m.vocab_size, margin=0.0)
    s = pol.scores(x)
    gain = (s.max(-1).values - s[:, 2]).numpy()
    margin = float(np.median(gain[gain > 0]))
    pol = speed_policy(m.vocab_size, margin=margin)
    chosen = pol.choose_batch(x)
    argmax = [pol.candidates[i] for i in s.argmax(-1).tolist()]
    for c, a, g in zip(chosen, argmax, gain):
        assert c == (a if g > margin else 8)
    assert 8 in chosen and set(chosen) - {8}  # both branches taken
    assert set(speed_policy(m.vocab_size, margin=None).choose_batch(x)) == {8}  # no margin: always the fallback
    # Exported in policy.json, reloaded, and the folded form makes the same choices from the hidden state.
    pol.save_pretrained(tmp_path / "p")
    meta = json.loads((tmp_path / "p" / layout.POLICY_META).read_text())
    assert meta["fallback_block_size"] == 8 and meta["margin"] == margin
    again = BlockSizePolicy.from_pretrained(tmp_path / "p")
    assert again.choose_batch(x) == chosen
    ids = torch.randint(0, m.vocab_size, (1, 40))
    state = engine.prefill(ids)
    from pipeline.decoding.adaptive import AdaptiveDecoder

    folded = again.fold(m.target.lm_head)
    assert folded.fallback_block_size == 8 and folded.margin == margin
    assert AdaptiveDecoder(engine, folded).choose(state)[0] == AdaptiveDecoder(engine, again).choose(state)[0]


def test_splits_are_disjoint_and_keep_val_as_before():
    from pipeline.policy.blocksize import is_val

    ids = [f"p{i}" for i in range(2000)]
    splits = [split_of(i, 0.1, 0.15) for i in ids]
    assert all((s == "val") == is_val(i, 0.1) for i, s in zip(ids, splits))
    share = {k: splits.count(k) / len(ids) for k in ("train", "calib", "val")}
    assert abs(share["calib"] - 0.15) < 0.03 and abs(share["val"] - 0.1) < 0.03


def test_config_keys_of_the_cost_model_and_the_objective_fail_fast():
    cfg = load_config()
    assert cfg.train.objective == "speed" and cfg.train.cost_profile is None and cfg.profile.steps >= 8
    for bad, key in (("train.objective=argmax", "train.objective"), ("profile.min_repeats=9", "profile.min_repeats"),
                     ("train.calibration_fraction=0.95", "train.calibration_fraction"),
                     ("train.checkpoint_every=0", "train.checkpoint_every")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config([bad])
    assert load_config(["train.objective=paper", "train.model=mlp"]).train.objective == "paper"
    with pytest.raises(ConfigError, match="'train.model'"):  # ridge regresses the speed targets only
        load_config(["train.objective=paper"])
    for bad in ("train.rules=[learned]", "train.rules=[threshold:x]"):  # rule actions are static rules
        with pytest.raises(ConfigError, match=r"'train.rules\[0\]'"):
            load_config([bad])


def test_adaptive_decoder_replaces_the_fallback_b_with_the_tuned_rule_and_deviates_only_past_its_gain(tiny):
    """pipeline.decoding.adaptive: where the policy answers its fallback b, the tuned per-step rule decodes instead (exactly:
    same output as plain greedy); the policy leaves the rule only where it predicts more than the rule's gain; a rule
    that lost on held-out label prompts is never used."""
    from pipeline.decoding.adaptive import AdaptiveDecoder, RuleFallback
    from pipeline.decoding.engine import greedy_reference

    m, engine = tiny
    assert RuleFallback.from_tune({"rule": "threshold:0.05", "max_block_size": 12, "gain": -0.01}) is None
    rf = RuleFallback.from_tune({"rule": "threshold:0.05", "max_block_size": 12, "gain": 0.03})
    assert rf.min_gain == pytest.approx(np.log(1.03))
    ids = torch.randint(0, m.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    state = engine.prefill(ids)
    ref = greedy_reference(m.target, ids, 24, engine.stop_token_ids)
    out = AdaptiveDecoder(engine, speed_policy(m.vocab_size, margin=None), rf).generate(ids, 24, state=state)
    assert (out.policy_block_size, out.block_size, out.step_rule) == (8, 12, "threshold:0.05")
    assert out.decode.step_rule is not None and max(out.decode.verified) <= 12
    assert torch.equal(out.decode.output_ids, ref)
    # Without a rule the same policy decodes its fallback b with whole-block verifies.
    plain = AdaptiveDecoder(engine, speed_policy(m.vocab_size, margin=None)).generate(ids, 24, state=state)
    assert (plain.block_size, plain.step_rule) == (8, None) and torch.equal(plain.decode.output_ids, ref)
    # A deviating policy: it leaves the fallback only where its predicted gain beats max(margin, log(1 + rule gain)).
    x = torch.randn(64, m.vocab_size, generator=torch.Generator().manual_seed(1)) * 3  # whatever ran before
    pol = speed_policy(m.vocab_size, margin=0.0)
    gain = pol.predicted_gain(pol.scores(x)).numpy()
    mid = float(np.median(gain[gain > 0]))
    big = RuleFallback("threshold:0.05", 12, float(np.expm1(mid)))
    chosen = pol.choose_batch(x, min_gain=big.min_gain)
    assert all((c != 8) <= (g > mid) for c, g in zip(chosen, gain)) and 8 in chosen and set(chosen) - {8}
    # A classifier (no fallback b) never takes the rule.
    clf = BlockSizePolicy(BlockSizeMLP(m.vocab_size, 5, hidden=64, n_layers=2), [6, 7, 8, 9, 10], m.vocab_size)
    assert AdaptiveDecoder(engine, clf, rf).rule_fallback is None


def test_the_profile_reaches_the_largest_b_the_run_decodes():
    from pipeline.policy.cost import largest_decoded_block_size
    from pipeline.runtime.config import load_config

    cands = list(range(4, 13))  # B = 8, k = 4
    assert largest_decoded_block_size(load_config([]), 8, cands) == 12  # the default: the candidates alone
    assert largest_decoded_block_size(load_config(["evaluate.fixed_block_sizes=null"]), 8, cands) == 16  # 2B
    assert largest_decoded_block_size(load_config(["label.trace_block_size=14"]), 8, cands) == 14
    assert largest_decoded_block_size(load_config(["evaluate.fixed_block_sizes=[20]"]), 8, cands) == 20
