"""#24 items 2-3 in the product: the ridge policy (pipeline/training/ridge.py) and the per-request rule actions (a
per-step rule at the trace b_max as one more action, valued from the label rows' traces: pipeline/training/problem.py),
with the real tiny pair: the value train learns equals what decoding the rule gives, and the decoder runs a chosen
rule action exactly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.decoding.adaptive import AdaptiveDecoder
from pipeline.decoding.engine import Engine, greedy_reference
from pipeline.decoding.models import load_models
from pipeline.io.shards import write_parquet_atomic
from pipeline.labelling.labels import replay_label_prompt
from pipeline.policy.blocksize import (SPEED_SCORE, BlockSizePolicy, LinearPolicyModel, calibrate_margin, speed_gain,
                                       speed_targets)
from pipeline.policy.cost import CostProfile
from pipeline.policy.step_rules import parse_rule
from pipeline.runtime.config import ModelConfig
from pipeline.training.problem import rule_action_columns
from pipeline.training.ridge import fit_ridge, leave_one_out

B_MAX, NEW = 10, 24
RULES = ["threshold:0.01", "threshold:0.2"]
PROFILE = CostProfile({b: 0.010 + 0.002 * b for b in range(1, 13)})  # no fit: a step at v sent costs cost(v + 1)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    m = load_models(ModelConfig())
    return m, Engine(m.target, m.draft, m.stop_token_ids)


def _prompts(m, n=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, m.vocab_size, (1, 20 + 5 * i), generator=g) for i in range(n)]


def test_a_rule_actions_value_is_the_decoded_rules_modelled_speed(tiny, tmp_path):
    """Equivalent tau / cost(b_max) = committed tokens / modelled seconds of the rule's steps, as the engine decodes
    it (the simulator's answer from the trace equals the decode's, for every rule)."""
    m, engine = tiny
    rows, decoded = [], {}
    for i, ids in enumerate(_prompts(m)):
        state = engine.prefill(ids)
        t = replay_label_prompt(engine, ids, [B_MAX], NEW, trace_block_size=B_MAX).trace
        rows.append({"prompt_id": f"p{i}", "trace_block_size": t.block_size, "trace_match": t.match,
                     "trace_confidence": [list(c) for c in t.confidence], "trace_stopped": t.stopped})
        for rule in RULES:
            res = engine.decode(state, block_size=B_MAX, step_rule=parse_rule(rule), max_new_tokens=NEW)
            decoded[(f"p{i}", rule)] = sum(res.committed) / sum(PROFILE.step_seconds(B_MAX, v) for v in res.verified)
    write_parquet_atomic(pa.Table.from_pylist(rows), tmp_path / "part-00000.parquet")
    actions, tau = rule_action_columns([tmp_path / "part-00000.parquet"], RULES, PROFILE)
    assert actions == [{"rule": r, "max_block_size": B_MAX} for r in RULES]
    for pid, values in tau.items():
        for rule, v in zip(RULES, values):
            assert v / PROFILE.cost(B_MAX) == pytest.approx(decoded[(pid, rule)], rel=1e-12)
    # A set with an untraced row is refused, naming it; no rules, no columns.
    write_parquet_atomic(pa.Table.from_pylist([*rows, {**rows[0], "prompt_id": "bare", "trace_block_size": None}]),
                         tmp_path / "part-00000.parquet")
    with pytest.raises(ValueError, match="bare has no per-step trace"):
        rule_action_columns([tmp_path / "part-00000.parquet"], RULES, PROFILE)
    assert rule_action_columns([tmp_path / "part-00000.parquet"], [], PROFILE) == ([], {})


def test_ridge_is_the_closed_form_on_standardised_logits_read_raw_its_penalty_from_leave_one_out():
    rng = np.random.default_rng(0)
    n, v, a = 60, 40, 4
    x = rng.normal(0, 1, (n, v)) * rng.uniform(0.5, 3, v) + rng.normal(0, 2, v)
    tau = np.exp(x[:, :a] * 0.1 + rng.normal(0, 0.05, (n, a))) + 2
    costs, scale, ratios = [1.0, 1.1, 1.2, 1.3], 0.5, (0.025, 2.5)
    model, info = fit_ridge(x, tau, costs, 0, scale, ratios=ratios)
    assert isinstance(model, LinearPolicyModel) and info["ratio"] in ratios and info["rows"] == n
    # The primal ridge solution on the standardised columns, with the target's mean as intercept.
    mu, sd = x.mean(0), x.std(0)
    z = (x - mu) / sd
    y = speed_targets(tau, np.asarray(costs), 0) / scale
    # The penalty is relative to the kernel's scale: trace(Z Z^T) / N, which is V for standardised columns.
    assert info["kernel_scale"] == pytest.approx(v) and info["alpha"] == pytest.approx(info["ratio"] * v)

    def primal(rows, alpha):  # ridge with an unpenalised intercept on the rows given
        zr, yr = z[rows], y[rows]
        zc = zr - zr.mean(0)
        w = np.linalg.solve(zc.T @ zc + alpha * np.eye(v), zc.T @ (yr - yr.mean(0)))
        return w, yr.mean(0) - zr.mean(0) @ w

    w, b = primal(np.arange(n), info["alpha"])
    with torch.no_grad():
        got = model(torch.from_numpy(x).float()).double().numpy()
    assert got == pytest.approx(z @ w + b, abs=1e-4)
    # Leave-one-out for real: refit without row i (the columns' standardisation kept, as the closed form keeps it)
    # and predict it; the chosen penalty's LOO argmax gain is what the fit reports, and it is the best of the grid.
    scores = info["loo_argmax_gain"]
    assert scores[str(info["ratio"])] == max(scores.values())
    for r in ratios:
        loo = np.stack([z[i] @ wi + bi for i in range(n) for wi, bi in [primal(np.delete(np.arange(n), i), r * v)]])
        assert leave_one_out(z, y, r * v) == pytest.approx(loo, abs=1e-8)
        assert speed_gain(tau, np.asarray(costs), loo.argmax(1), np.zeros(n, int)) == pytest.approx(
            scores[str(r)], abs=1e-12)
    loo = np.stack([z[i] @ wi + bi for i in range(n)
                    for wi, bi in [primal(np.delete(np.arange(n), i), info["alpha"])]]) * scale
    assert info["loo_predictions"] == pytest.approx(loo, abs=1e-8)
    # The margin is calibrate_margin's on the out-of-fold predicted gains (tests/unit/test_ridge_margin.py checks
    # those predictions by direct solves), over every row.
    out = info["outer_predictions"]
    cal = calibrate_margin(out.max(1) - out[:, 0], out.argmax(1), tau, np.asarray(costs), 0)
    assert info["calibration"]["margin"] == pytest.approx(cal["margin"]) if cal["margin"] is not None else \
        info["calibration"]["margin"] is None
    assert info["calibration"]["calibration_rows"] == n


def test_a_policy_with_rule_actions_round_trips_folds_and_decodes_its_rule_exactly(tiny, tmp_path):
    m, engine = tiny
    cands = [6, 7, 8, 9, 10]
    lin = LinearPolicyModel(m.vocab_size, len(cands) + 1)
    with torch.no_grad():  # every prompt: the rule action scores highest, well past the margin
        lin.input.weight.zero_()
        lin.input.bias.copy_(torch.tensor([0.0, 0, 0, 0, 0, 1.0]))
    info = {"score": SPEED_SCORE, "fallback_block_size": 8, "margin": 0.1, "score_scale": 1.0,
            "rule_actions": [{"rule": "threshold:0.05", "max_block_size": B_MAX}]}
    policy = BlockSizePolicy(lin, cands, m.vocab_size, "none", info)
    policy.save_pretrained(tmp_path / "policy")
    back = BlockSizePolicy.from_pretrained(tmp_path / "policy")
    assert [a.name for a in back.actions] == [*(f"b={b}" for b in cands), "threshold:0.05@10"]
    assert isinstance(back.model, LinearPolicyModel)
    folded = back.fold(m.target.lm_head)
    ids = _prompts(m, 1)[0]
    state = engine.prefill(ids)
    assert back.choose_action(state.logits).name == folded.choose_action(state.hidden).name == "threshold:0.05@10"
    with torch.no_grad():  # the fold is exact up to float rounding: the same scores from the hidden state
        assert torch.allclose(back.scores(state.logits), folded.scores(state.hidden), atol=1e-4)
    out = AdaptiveDecoder(engine, folded).generate(ids, NEW, state=state)
    assert (out.block_size, out.step_rule, out.policy_action) == (B_MAX, "threshold:0.05", "threshold:0.05@10")
    assert out.decode.step_rule is not None and max(out.decode.verified) <= B_MAX - 1
    assert torch.equal(out.decode.output_ids, greedy_reference(m.target, ids, NEW, engine.stop_token_ids))
    # Under the margin the policy answers its fallback b, decoded whole-block.
    low = BlockSizePolicy(lin, cands, m.vocab_size, "none", {**info, "margin": 5.0})
    plain = AdaptiveDecoder(engine, low).generate(ids, NEW, state=state)
    assert (plain.block_size, plain.step_rule, plain.policy_action) == (8, None, "b=8")
