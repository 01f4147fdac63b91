"""The expected-acceptance estimate of a sampled step (pipeline.decoding.expected) against the mean of many sampled
steps on the bundled tiny pair at T = 1: it must agree within the paired interval, have less spread than one draw,
and a wrong overlap (the draft's top-1 probability in place of sum_x min(p, q)) must not agree."""

import math

import pytest
import torch

import pipeline.decoding.engine as engine_module
from pipeline.decoding.engine import Engine
from pipeline.decoding.expected import expected_committed

BLOCK = 8
DRAWS = 400


@pytest.fixture(scope="module")
def tiny():
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config(["model.device=cpu", "model.dtype=float32"]).model)
    return m, Engine(m.target, m.draft, None)  # no stop tokens: a stop's cut is not what is tested


def first_steps(engine, state, draws, seed):
    """(committed, expected) of the first step of ``draws`` sampled decodes from one prefill: one step each
    (max_new_tokens = b + 1 leaves room for the whole block and its bonus)."""
    torch.manual_seed(seed)
    got = [engine.decode(state, block_size=BLOCK, max_new_tokens=BLOCK + 1, temperature=1.0, seed=None)
           for _ in range(draws)]
    return [r.committed[0] for r in got], [r.expected_committed[0] for r in got]


def paired_interval(a, b):
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return mean - 2.6 * sd / math.sqrt(len(d)), mean + 2.6 * sd / math.sqrt(len(d))  # ~99 %


def sd(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


PROMPTS = ["def parse(self, text):\n    ", "In the beginning God created the heaven"]


@pytest.mark.parametrize("text", PROMPTS)
def test_the_expected_accepted_length_agrees_with_the_mean_of_sampled_steps(tiny, text):
    m, engine = tiny
    state = engine.prefill(torch.tensor([m.tokenizer(text)["input_ids"]]))
    sampled, expected = first_steps(engine, state, DRAWS, seed=0)
    lo, hi = paired_interval(sampled, expected)
    assert lo <= 0 <= hi, (sum(sampled) / DRAWS, sum(expected) / DRAWS, lo, hi)
    assert sd(expected) < sd(sampled)  # the draws of acceptance integrated out
    assert sum(sampled) / DRAWS > 1.05  # the pair accepts something here: the comparison is not of two constants


def top1_overlap(target_probs, draft_probs, drafted, room):
    """A plausible wrong estimate: the draft's confidence (its top-1 probability) as the chance a slot is accepted."""
    k = min(int(drafted.shape[0]), int(room) - 1)
    conf = draft_probs[:k].double().max(-1).values
    return float(1.0 + torch.cumprod(conf, 0).sum()) if k > 0 else 1.0


def test_a_wrong_overlap_does_not_agree(tiny, monkeypatch):
    m, engine = tiny
    monkeypatch.setattr(engine_module, "expected_committed", top1_overlap)
    missed = 0
    for text in PROMPTS:
        state = engine.prefill(torch.tensor([m.tokenizer(text)["input_ids"]]))
        sampled, expected = first_steps(engine, state, DRAWS, seed=0)
        lo, hi = paired_interval(sampled, expected)
        missed += not lo <= 0 <= hi
    assert missed == len(PROMPTS)


def test_the_estimate_by_hand_on_a_two_token_vocabulary():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])  # p_1, p_2 and the bonus row
    q = torch.tensor([[0.8, 0.2], [0.5, 0.5]])
    x = torch.tensor([0, 1])  # slot 1 drafted token 0: accepted w.p. min(1, 0.5 / 0.8) = 0.625
    alpha1, alpha2 = 0.5 + 0.2, 0.5 + 0.1
    assert expected_committed(p, q, x, room=3) == pytest.approx(1 + alpha1 + 0.625 * alpha2)
    assert expected_committed(p, q, x, room=2) == pytest.approx(1 + alpha1)  # room for one drafted token
    assert expected_committed(p, q, x, room=1) == 1.0
