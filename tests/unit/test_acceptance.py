"""The learned acceptance model (pipeline/policy/acceptance.py), the per-step oracle (pipeline.policy.simulate.
per_step_oracle) and tune's offline search (pipeline/evaluation/rule_search.py), on synthetic traces drawn from a
known acceptance process: the fit recovers it, the reliability table catches a miscalibrated model, the oracle is
the brute-force optimum and beats every rule, and the search picks the rule the sums say."""

import itertools

import numpy as np
import pytest

from pipeline.evaluation.rule_search import TracedRow, search
from pipeline.policy.acceptance import FEATURES, AcceptanceModel, fit_acceptance, reliability
from pipeline.policy.cost import CostProfile
from pipeline.policy.simulate import per_step_oracle, simulate
from pipeline.policy.step_rules import ConfidenceThreshold, Full, LearnedVerify
from pipeline.policy.trace import Trace

B_MAX = 8


def _true_hazard(conf):
    return 1 / (1 + np.exp(-(0.5 + 3.0 * np.log(conf))))  # accepted slots follow the draft's confidence


def _traces(n, seed, new=40):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        conf, match = [], []
        for i in range(new - 1):
            w = min(B_MAX, new - i) - 1
            c = rng.beta(4, 1.5, size=w)
            acc = rng.random(w) < _true_hazard(c)
            conf.append(c.astype(np.float32).tolist())
            match.append(int(np.argmin(acc)) if not acc.all() else w)
        out.append(Trace(B_MAX, match, conf, False))
    return out


def _profile(verify_slope=0.002):
    fit = {"from_block_size": 2, "draft": {"intercept": 0.004, "slope": 0.0002},
           "verify": {"intercept": 0.006, "slope": verify_slope}}
    seconds = {b: 0.004 + 0.0002 * b + 0.006 + verify_slope * b for b in range(2, 2 * B_MAX + 1)}
    return CostProfile({1: 0.005, **seconds}, fit=fit)


def test_the_fit_recovers_the_process_and_the_reliability_table_catches_a_bad_model():
    model = fit_acceptance(_traces(200, 0))
    assert model.features == FEATURES and model.block_size == B_MAX
    held = _traces(200, 1)
    good = reliability(model, held)
    assert good["samples"] > 5000 and len(good["table"]) == 10
    assert good["max_abs_gap"] < 0.08 and good["log_loss"] < good["base_rate_log_loss"]
    # The same model shifted: every prediction too high. The table must show it.
    bad = AcceptanceModel(model.intercept + 2.0, model.weights, model.means, model.scales, FEATURES, B_MAX)
    assert reliability(bad, held)["max_abs_gap"] > 0.15
    with pytest.raises(ValueError, match="no trace step"):
        fit_acceptance([])
    restored = AcceptanceModel.from_dict(model.to_dict())
    assert restored.weights == model.weights and restored.intercept == model.intercept


def test_the_per_step_oracle_is_the_brute_force_optimum_and_no_rule_beats_it():
    costs = [1.0 + 0.2 * k for k in range(1, B_MAX)]
    rules = [Full(), ConfidenceThreshold(0.3), LearnedVerify(fit_acceptance(_traces(20, 2)), tuple(costs))]
    for t in _traces(6, 3, new=9):
        best = min(_all_paths(t), key=lambda v: sum(costs[k - 1] for k in v))
        oracle = per_step_oracle(t, costs)
        assert sum(costs[k - 1] for k in oracle) == pytest.approx(sum(costs[k - 1] for k in best))
        for rule in rules:
            assert sum(costs[k - 1] for k in oracle) <= sum(costs[k - 1] for k in simulate(t, rule)[0]) + 1e-12


def _all_paths(t, i=0):
    end = t.new_tokens - 1
    if i >= end:
        yield []
        return
    for k in range(1, len(t.confidence[i]) + 1):
        step = min(min(t.match[i], k) + 1, end - i)
        for rest in _all_paths(t, i + step):
            yield [k] + rest


def test_the_search_chooses_by_modelled_time_and_reports_the_oracle():
    profile = _profile()
    traces = _traces(40, 4)
    rows = [TracedRow(f"p{i}", "s", 10, [4, 5, 6], [12, 11, 10], t) for i, t in enumerate(traces)]
    got = search({"train": rows[:30], "val": rows[30:]}, ["full", "threshold:0.2", "threshold:0.6", "learned"],
                 profile, baseline_b=5)
    choice = got["choice"]
    val = [r.trace for r in rows[30:]]
    secs = {}
    for name, rule in (("full", Full()), ("threshold:0.2", ConfidenceThreshold(0.2)),
                       ("threshold:0.6", ConfidenceThreshold(0.6)), ("learned", got["learned"])):
        secs[name] = sum(profile.decode_seconds(simulate(t, rule)[0], B_MAX, rule=True, context=10) for t in val)
    assert choice["rule"] == min(secs, key=secs.get)
    base = sum(11 * profile.cost(5) for _ in val)
    line = {t["rule"]: t for t in choice["table"]}
    assert line["threshold:0.6"]["gain"] == pytest.approx(base / secs["threshold:0.6"] - 1)
    assert choice["families"]["threshold"]["rule"] == min(("threshold:0.2", "threshold:0.6"), key=secs.get)
    oracle = choice["per_step_oracle"]["gain"]
    assert all(t["gain"] <= oracle + 1e-12 for t in choice["table"])
    # The learned rule, on a cost profile where verifying costs something, trims and beats verifying everything.
    assert secs["learned"] < secs["full"]
    assert choice["reliability"]["samples"] > 0 and choice["fitted_on_prompts"] == 30
    assert len(got["rows"]) == 10 * (1 + 4 + 1)
    with pytest.raises(ValueError, match="baseline b=9"):
        search({"train": rows[:30], "val": rows[30:]}, ["full"], profile, baseline_b=9)
    with pytest.raises(ValueError, match="no val-split row"):
        search({"train": rows, "val": []}, ["full"], profile, baseline_b=5)


def test_the_learned_rule_runs_at_the_rate_it_reaches_itself_on_the_train_traces():
    """Dinkelbach's fixed point: the rate tune gives the learned rule is the tokens per modelled second that rule
    reaches on the train traces, and at it the rule is at least as fast there as the per-step ratio (rate 0) and the
    full block; a rate off the fixed point is slower on the same traces."""
    from pipeline.evaluation.rule_search import learned_rule

    profile = _profile()
    rows = [TracedRow(f"p{i}", "s", 10, [4, 5, 6], [12, 11, 10], t) for i, t in enumerate(_traces(40, 4))]
    model = fit_acceptance([r.trace for r in rows])
    rule = learned_rule(model, profile, B_MAX, rows)

    def speed(r):
        sims = [simulate(x.trace, r) for x in rows]
        return (sum(sum(c) for _, c in sims) /
                sum(profile.decode_seconds(v, B_MAX, rule=True, context=10) for v, _ in sims))

    assert rule.rate > 0 and speed(rule) == pytest.approx(rule.rate, rel=1e-6)
    ratio = LearnedVerify.from_profile(model, profile, B_MAX)
    assert speed(rule) >= speed(ratio) - 1e-12 and speed(rule) >= speed(Full()) - 1e-12
    assert speed(rule) > speed(LearnedVerify.from_profile(model, profile, B_MAX, rule.rate * 3))
    # Through its file the rate stays; a version-1 file (no rate) reads as the ratio.
    assert LearnedVerify.from_dict(rule.to_dict()).rate == rule.rate
    old = {k: v for k, v in rule.to_dict().items() if k != "rate"}
    assert LearnedVerify.from_dict({**old, "version": 1}).rate == 0.0


def test_the_isotonic_recalibration_mends_a_misspecified_logistic():
    """Acceptance that jumps with the confidence (a step, which a logistic in log c cannot fit): the recalibrated
    model's reliability gap on held-out traces is well below the raw logistic's, and its map is monotone."""
    rng = np.random.default_rng(7)

    def traces(n):
        out = []
        for _ in range(n):
            conf, match = [], []
            for i in range(29):
                w = min(B_MAX, 30 - i) - 1
                c = rng.random(w)
                acc = rng.random(w) < np.where(c > 0.5, 0.97, 0.15)
                conf.append(c.astype(np.float32).tolist())
                match.append(int(np.argmin(acc)) if not acc.all() else w)
            out.append(Trace(B_MAX, match, conf, False))
        return out

    train, held = traces(300), traces(200)
    calibrated, raw = fit_acceptance(train), fit_acceptance(train, calibrate=False)
    assert not raw.calibration_x and list(calibrated.calibration_y) == sorted(calibrated.calibration_y)
    gap_raw, gap_cal = reliability(raw, held)["max_abs_gap"], reliability(calibrated, held)["max_abs_gap"]
    assert gap_cal < 0.1 and gap_raw > 0.3, (gap_cal, gap_raw)  # deciles that straddle the jump mix a little
