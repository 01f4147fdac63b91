"""A per-step rule at T > 0 is lossless: the token after a cut block, verified and accepted or resampled, follows the
target's own distribution (a chi-square test over 2,000 draws), and the same test fails an always-accepting sampler
(on 200 draws). In the integration layer for its draws (2 x 2,000 + 200 decodes); the rules' arithmetic and greedy
exactness are tests/unit/test_step_rules.py's."""

import math

import torch

import pipeline.decoding.engine as engine_mod
from pipeline.decoding.engine import Engine
from pipeline.policy.step_rules import ConfidenceThreshold
from random_pair import VOCAB, learned_rule, make_pair, prompt

B_MAX = 6  # as tests/unit/test_step_rules.py
LOSSY_DRAWS = 200  # the always-accepting sampler's draws (the lossless checks keep 2,000)


def _second_token_counts(engine, state, rule, n: int):
    counts = torch.zeros(VOCAB)
    for seed in range(n):
        res = engine.decode(state, block_size=B_MAX, max_new_tokens=2, temperature=1.0, seed=seed, step_rule=rule)
        counts[int(res.new_ids[1])] += 1
    return counts


def _exact_second_token(target, ids) -> torch.Tensor:
    """P(second new token) = sum over t1 of p(t1) p(t2 | t1), from the target alone at T = 1."""
    with torch.inference_mode():
        p1 = torch.softmax(target(ids).logits[0, -1].double(), -1)
        ext = torch.cat([ids.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        p2 = torch.softmax(target(ext).logits[:, -1].double(), -1)
    return p1 @ p2


def _chi2_rejects(counts: torch.Tensor, probs: torch.Tensor, z: float = 3.29) -> bool:
    """Pearson's chi-square at about the 0.0005 level (Wilson-Hilferty quantile), over bins expecting >= 5."""
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    df = int(keep.sum())  # bins - 1, with the pooled rest as one more bin
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


def test_sampling_with_a_cut_is_lossless_and_the_test_catches_a_lossy_sampler(monkeypatch):
    """The second new token is drafted, verified on a cut block (one drafted token of five) and accepted or
    resampled; its distribution must be the target's own. An always-accept sampler must fail the same test."""
    target, draft = make_pair(3, block_size=B_MAX, tilt=6.0)  # peaked, and draft and target often disagree
    engine = Engine(target, draft)
    ids = prompt(3)
    state = engine.prefill(ids)
    exact = _exact_second_token(target, ids)
    rule = ConfidenceThreshold(1.0)  # always cut to one drafted token
    assert not _chi2_rejects(_second_token_counts(engine, state, rule, 2000), exact)
    learned = learned_rule(B_MAX, slope=0.05)  # the learned rule, cutting where its model and costs say
    assert not _chi2_rejects(_second_token_counts(engine, state, learned, 2000), exact)

    def always_accept(draft_tokens, target_probs, draft_probs, draft_indices=None):
        return draft_tokens.shape[1], engine_mod._sample_probs(target_probs[:, -1])[0]

    # The lossy sampler is caught on fewer draws: the statistic grows with the draws for a fixed bias, and at 200
    # (seeds 0..199, so the same counts every run) it is 1,346 against a critical value of 15.7 (6,875 at 1,000).
    monkeypatch.setattr(engine_mod, "_rejection_sample", always_accept)
    assert _chi2_rejects(_second_token_counts(engine, state, rule, LOSSY_DRAWS), exact)
