"""The profile's stability check (pipeline.policy.cost.round_stability) is what measure_profile's docstring says:
every b's median per-step seconds at every context length settles, from the raw points; a single b drifting round
after round is not stable, even where the pooled affine fit barely moves. No timing: synthetic raw points, and a
fake engine whose step seconds are set by the test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.policy.cost import _fit, measure_profile, round_stability

BS, CONTEXTS, STEPS = list(range(1, 17)), (64, 256), 16


def _seconds(b: int) -> float:
    return 0.010 + 0.002 * b


def _raw(rounds: int, drift_b=None, drift_context=None, growth=1.2):
    """Raw points (version 2, first steps as the steady ones) of ``rounds`` rounds: b = 1 four times a round, every
    b constant but ``drift_b``, whose seconds grow by ``growth`` a round (at ``drift_context`` only, if given)."""
    raw = []
    for r in range(1, rounds + 1):
        for b in BS:
            for ctx in CONTEXTS:
                s = _seconds(b)
                if b == drift_b and drift_context in (None, ctx):
                    s *= growth ** (r - 1)
                for _ in range(4 if b == 1 else 1):
                    raw.append({"b": b, "context": ctx, "steps": STEPS, "draft_seconds": 0.4 * s,
                                "verify_seconds": 0.6 * s, "first_draft_seconds": 0.4 * s,
                                "first_verify_seconds": 0.6 * s, "rule": None, "rule_seconds": 0.0, "round": r})
    return raw


def test_one_b_drifting_20_percent_a_round_is_not_stable():
    raw = _raw(5, drift_b=8)
    check = round_stability(raw, 0.02)
    assert check["stable"] is False and (check["worst"]["b"], check["worst"]["move"] > 0.05) == (8, True)
    # Why from the raw points: the pooled affine fit over b >= 2 moves by less than the tolerance at every b, so a
    # check on the fit would call this profile stable.
    now = _fit(BS, raw, list(CONTEXTS))[0]
    before = _fit(BS, [p for p in raw if p["round"] < 5], list(CONTEXTS))[0]
    assert all(abs(now[b] - before[b]) <= 0.02 * now[b] for b in BS)


def test_one_context_of_one_b_drifting_is_not_stable():
    check = round_stability(_raw(5, drift_b=3, drift_context=256), 0.02)
    assert check["stable"] is False and (check["worst"]["b"], check["worst"]["context"]) == (3, 256)


def test_constant_points_are_stable_and_one_round_is_not():
    assert round_stability(_raw(3), 0.02) == {"stable": True, "worst": {"b": 1, "context": 64, "move": 0.0}}
    assert round_stability(_raw(1), 0.02)["stable"] is False
    # A drift within the tolerance settles too; rule points (timed apart) are not what the check reads.
    assert round_stability(_raw(6, drift_b=8, growth=1.01), 0.02)["stable"] is True
    ruled = [{**p, "rule": "threshold:0", "rule_seconds": 1.0 * p["round"]} for p in _raw(3) if p["b"] == 2]
    assert round_stability(_raw(3) + ruled, 0.02)["stable"] is True


class _FakeEngine:
    """measure_profile's view of an engine: step seconds from ``seconds(b, call)``, no model run."""

    def __init__(self, seconds):
        self.seconds, self.calls, self.stop_token_ids = seconds, {}, [0]
        self.device = "cpu"
        self.target = torch.nn.Linear(1, 1)

    def prefill(self, ids):
        return SimpleNamespace(ids=ids)

    def decode(self, state, block_size, max_new_tokens, step_rule=None):
        b = int(block_size)
        k = self.calls[b] = self.calls.get(b, 0) + 1
        n = max(1, (max_new_tokens - 1) // b)
        s = self.seconds(b, k)
        return SimpleNamespace(steps=n, draft_seconds=0.4 * s * n, verify_seconds=0.6 * s * n,
                               first_step_seconds=(0.4 * s, 0.6 * s), rule_seconds=0.0, committed=[b] * n)


@pytest.mark.parametrize("drift", [False, True])
def test_measure_profile_stops_when_every_b_settles_and_runs_on_while_one_drifts(drift):
    def seconds(b, call):  # call 1 is the warm-up, call r + 1 round r's: b = 8 grows 20 % a round
        return _seconds(b) * (1.2 ** max(0, call - 2) if drift and b == 8 else 1.0)

    p = measure_profile(_FakeEngine(seconds), BS, 100, context_lengths=(64,), steps=4, min_repeats=3,
                        max_repeats=6, rule_block_sizes=[])
    assert (p.meta["stable"], p.meta["rounds"]) == ((False, 6) if drift else (True, 3))
