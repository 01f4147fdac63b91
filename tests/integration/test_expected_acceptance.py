"""What the engine records as each sampled step's expected committed tokens (``DecodeResult.expected_committed``, and
``tau_expected`` from it), read from whole decodes of the bundled tiny pair at T = 1, every step of each, the last
included.

Each decode runs to a budget of MAX_NEW tokens (no stop tokens, so the budget alone ends it) that the block of BLOCK
binds in its last steps: once fewer than BLOCK tokens are left, the step drafts only what fits and may commit at most
what is left ("room"), and the recorded expectation must be capped there the same way. Three claims, each read from
the records:

* every step: 1 <= expected <= min(drafted + 1, room), exactly 1 when one token is left, and the decode's steps
  commit the budget (deterministic);
* the recorded expectation has the mean of what the step committed, at every step: given what came before a step
  its expectation is the conditional mean of its commit, so their difference has mean 0 in each group of steps
  fixed before the step runs (non-binding steps by index, budget-bound steps by the room they had), and it varies
  less than the commit;
* ``tau_expected`` x steps, a decode's summed expectation, has the mean of the tokens it committed (MAX_NEW - 1).

The negative control is fixed before any outcome was seen: every prompt of PROMPTS, every seed of SEEDS (the same
decodes as above), one pooled statistic (the per-decode total). On each step's own probabilities it computes a
plausible wrong estimate (the draft's top-1 probability in place of the overlap sum_x min(p, q)), and the total's
test must reject it. The estimate itself is checked by hand in the last test.
"""

import math
import statistics

import pytest
import torch

import pipeline.decoding.engine as engine_module
from pipeline.decoding.engine import Engine
from pipeline.decoding.expected import expected_committed

BLOCK = 8
MAX_NEW = 12  # 11 tokens after the prefill's: the first steps have room >= BLOCK, the last ones less
SEEDS = range(200)
PROMPTS = ["def parse(self, text):\n    ", "The os.path module", "In the beginning God created the heaven"]
MIN_GROUP = 30  # steps a group needs for its normal interval (every budget-bound room 2..BLOCK-1 must have them)
FAMILY_ALPHA = 0.01  # the chance that any group's test of the right estimate fails, all groups together


@pytest.fixture(scope="module")
def tiny():
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config(["model.device=cpu", "model.dtype=float32"]).model)
    return m, Engine(m.target, m.draft, None)  # no stop tokens: the budget ends every decode


def top1_overlap(target_probs, draft_probs, drafted, room):
    """A plausible wrong estimate: the draft's confidence (its top-1 probability) as the chance a slot is accepted,
    capped by the room as the right one is."""
    k = min(int(drafted.shape[0]), int(room) - 1)
    conf = draft_probs[:k].double().max(-1).values
    return float(1.0 + torch.cumprod(conf, 0).sum()) if k > 0 else 1.0


def rooms(committed):
    """The tokens left before the budget at each step's start (the prefill's first token already out)."""
    left, out = MAX_NEW - 1, []
    for c in committed:
        out.append(left)
        left -= c
    return out


@pytest.fixture(scope="module")
def decodes(tiny):
    """Per prompt, the DecodeResult of each seed's decode at T = 1 with the wrong estimate of each of its steps
    (``wrong``), and one decode at T = 0. The engine's expected_committed is wrapped, not replaced: it returns the real
    value, which the engine records, and notes the wrong one computed on the same probabilities."""
    m, engine = tiny
    wrong = []
    real = engine_module.expected_committed

    def noting(target_probs, draft_probs, drafted, room):
        wrong.append(top1_overlap(target_probs, draft_probs, drafted, room))
        return real(target_probs, draft_probs, drafted, room)

    sampled, greedy = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "expected_committed", noting)
        for text in PROMPTS:
            state = engine.prefill(torch.tensor([m.tokenizer(text)["input_ids"]]))
            for seed in SEEDS:
                wrong.clear()
                r = engine.decode(state, block_size=BLOCK, max_new_tokens=MAX_NEW, temperature=1.0, seed=seed)
                assert len(wrong) == r.steps  # every step drafts (room >= 1, b >= 2): one estimate each
                sampled.append((text, r, list(wrong)))
            greedy.append(engine.decode(state, block_size=BLOCK, max_new_tokens=MAX_NEW, temperature=0.0))
    return sampled, greedy


def test_every_step_records_an_expectation_within_what_it_could_commit(decodes):
    sampled, greedy = decodes
    budget_bound_last = room_one = 0
    for text, r, _ in sampled:
        e, c, v = r.expected_committed, r.committed, r.verified
        assert len(e) == len(c) == len(v) == r.steps >= 1, (text, e, c, v)
        assert sum(c) == MAX_NEW - 1 and r.new_tokens == MAX_NEW and not r.stopped, (text, c)  # the budget ends it
        for t, room in enumerate(rooms(c)):
            assert v[t] == min(BLOCK - 1, room), (text, t, room, v)  # drafts only what fits once room < BLOCK
            assert 1.0 <= e[t] <= min(v[t] + 1, room) + 1e-6, (text, t, room, v[t], e)
            if room == 1:
                assert e[t] == 1.0, (text, t, e)  # one token left: the step commits it, whatever is accepted
                room_one += 1
        assert c[-1] == rooms(c)[-1]  # the last step commits what was left
        budget_bound_last += rooms(c)[-1] <= v[-1]  # ... and the budget capped it: less than drafted + 1
        assert r.tau_expected == pytest.approx(sum(e) / len(e), abs=1e-12)
        assert r.tau == pytest.approx((MAX_NEW - 1) / r.steps, abs=1e-12)
    # The cases the claims are about happen: most decodes end on a budget-bound step, many with one token left.
    assert budget_bound_last > len(sampled) // 2 and room_one > 0, (budget_bound_last, room_one)
    for r in greedy:  # at T = 0 a step is deterministic: the expectation is what it committed
        assert r.expected_committed == [float(c) for c in r.committed] and r.tau_expected == r.tau


def z_score(d):
    """The mean of d over its standard error (0 for d all 0, inf for a nonzero constant)."""
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    if sd == 0:
        return 0.0 if mean == 0 else math.inf
    return mean / (sd / math.sqrt(len(d)))


def groups(sampled, estimate):
    """{group: [(committed, estimate)]} over every step of every decode, grouped by what is fixed before the step
    runs: a step with room >= BLOCK by its index, a budget-bound one by its room (a decode passes each room once)."""
    out = {}
    for _, r, wrong in sampled:
        est = r.expected_committed if estimate == "recorded" else wrong
        for t, (room, c, e) in enumerate(zip(rooms(r.committed), r.committed, est)):
            key = ("step", t) if room >= BLOCK else ("room", room)
            out.setdefault(key, []).append((c, e))
    return out


def test_the_recorded_expectation_has_the_mean_of_what_each_step_committed(decodes):
    sampled, _ = decodes
    got = groups(sampled, "recorded")
    bound = {room: len(got.get(("room", room), [])) for room in range(2, BLOCK)}
    assert all(n >= MIN_GROUP for n in bound.values()), bound  # every budget-bound room is tested
    tested = {k: v for k, v in got.items() if len(v) >= MIN_GROUP and k != ("room", 1)}  # room 1: exact, above
    z_crit = statistics.NormalDist().inv_cdf(1 - FAMILY_ALPHA / 2 / len(tested))  # Bonferroni over the groups
    z = {k: z_score([c - e for c, e in v]) for k, v in tested.items()}
    assert all(abs(s) <= z_crit for s in z.values()), (z_crit, z)
    # The acceptance draws integrated out: the expectation varies less than the commit, in every group.
    spread = {k: (statistics.stdev([e for _, e in v]), statistics.stdev([c for c, _ in v])) for k, v in tested.items()}
    assert all(se < sc for se, sc in spread.values()), spread
    steps = [c for v in tested.values() for c, _ in v]
    assert statistics.fmean(steps) > 1.05  # the pair accepts something: not a comparison of two constants


def totals(sampled, estimate):
    """Per decode, its summed estimate less the tokens it committed (MAX_NEW - 1): tau_expected x steps for the
    recorded one."""
    if estimate == "recorded":
        return [r.tau_expected * r.steps - (MAX_NEW - 1) for _, r, _ in sampled]
    return [sum(wrong) - (MAX_NEW - 1) for _, _, wrong in sampled]


TOTAL_Z = statistics.NormalDist().inv_cdf(1 - 0.01 / 2)  # one two-sided test at 1 %


def test_tau_expected_times_the_steps_has_the_mean_of_the_tokens_decoded(decodes):
    sampled, _ = decodes
    d = totals(sampled, "recorded")
    assert abs(z_score(d)) <= TOTAL_Z, (statistics.fmean(d), z_score(d))
    assert statistics.stdev(d) > 0  # a sampled quantity, not the budget itself


def test_a_wrong_overlap_is_told_apart_on_the_same_decodes(decodes):
    """The negative control, fixed before looking: all of PROMPTS, all of SEEDS, the per-decode total's test."""
    sampled, _ = decodes
    d = totals(sampled, "wrong")
    assert abs(z_score(d)) > TOTAL_Z, (statistics.fmean(d), z_score(d))


def test_the_estimate_by_hand_on_a_two_token_vocabulary():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]])  # p_1, p_2 and the bonus row
    q = torch.tensor([[0.8, 0.2], [0.5, 0.5]])
    x = torch.tensor([0, 1])  # slot 1 drafted token 0: accepted w.p. min(1, 0.5 / 0.8) = 0.625
    alpha1, alpha2 = 0.5 + 0.2, 0.5 + 0.1
    assert expected_committed(p, q, x, room=3) == pytest.approx(1 + alpha1 + 0.625 * alpha2)
    assert expected_committed(p, q, x, room=2) == pytest.approx(1 + alpha1)  # room for one drafted token
    assert expected_committed(p, q, x, room=1) == 1.0
