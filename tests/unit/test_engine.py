"""The engine against dflash's reference loop and against plain greedy decoding (CPU, fp32, random pairs)."""

import pytest
import torch
from dflash import model as dflash_model

from pipeline.engine import Engine, greedy_reference
from random_pair import EOS_ID, make_pair, prompt

SEEDS = [0, 1, 3]  # seed 2 stops on its first token: see test_first_token_stop
B = 4
BLOCK_SIZES = [1, 2, B - 1, B, B + 3]


@pytest.fixture
def cpu_timer(monkeypatch):
    # dflash's return_stats timer calls torch.cuda.synchronize(), which a CPU-only torch cannot run:
    # replace that one CUDA call with the plain clock so the reference can report its step counts here.
    import time

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def reference(draft, target, ids, b, max_new, stops, temperature=0.0, top_k=0, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return dflash_model.dflash_generate(draft, target, ids, max_new, stops, temperature=temperature,
                                        top_k=top_k, block_size=b, return_stats=True)


@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_matches_dflash_and_autoregressive(seed, cpu_timer):
    target, draft = make_pair(seed, block_size=B)
    engine = Engine(target, draft, stop_token_ids=[EOS_ID])
    ids = prompt(seed)
    state = engine.prefill(ids)
    greedy = greedy_reference(target, ids, 40, [EOS_ID])
    saw_acceptance = False
    for b in BLOCK_SIZES:
        res = engine.decode(state, block_size=b, max_new_tokens=40)
        ref = reference(draft, target, ids, b, 40, [EOS_ID])
        assert torch.equal(res.output_ids, ref.output_ids), f"b={b}: ids differ from dflash_generate"
        assert res.committed == ref.acceptance_lengths, f"b={b}: per-step committed counts differ"
        assert torch.equal(res.output_ids, greedy), f"b={b}: not lossless w.r.t. greedy decoding"
        assert res.new_tokens == ref.num_output_tokens
        assert res.tau == pytest.approx(sum(ref.acceptance_lengths) / len(ref.acceptance_lengths))
        if b == 1:
            assert res.tau == 1.0 and res.steps == res.new_tokens - 1
        saw_acceptance |= res.tau > 1.0
        assert res.draft_seconds >= 0 and res.verify_seconds > 0
    assert saw_acceptance, "the tilted pair should accept some draft tokens"


def test_prefill_runs_once_for_all_candidates():
    target, draft = make_pair(7, block_size=B)
    engine = Engine(target, draft)
    calls = []
    handle = target.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append(kwargs["input_ids"].shape[1] if "input_ids" in kwargs
                                             else args[0].shape[1]), with_kwargs=True)
    ids = prompt(7, length=15)
    state = engine.prefill(ids)
    results = [engine.decode(state, block_size=b, max_new_tokens=20) for b in BLOCK_SIZES]
    handle.remove()
    # One forward over the whole prompt, then exactly one target forward per verify step of each candidate.
    assert calls.count(15) == 1 and calls[0] == 15
    assert len(calls) == 1 + sum(r.steps for r in results)
    # The state survives: a repeated decode gives the same result.
    again = engine.decode(state, block_size=B, max_new_tokens=20)
    assert torch.equal(again.output_ids, results[BLOCK_SIZES.index(B)].output_ids)
    assert state.target_cache.get_seq_length() == 15


def test_stop_token_and_max_new_tokens_clip():
    target, draft = make_pair(3, block_size=B)
    ids = prompt(3)
    free = Engine(target, draft).decode(Engine(target, draft).prefill(ids), block_size=B, max_new_tokens=30)
    assert free.new_tokens == 30 and not free.stopped
    assert sum(free.committed) == free.new_tokens - 1  # the first token comes from the prefill
    # Make the 6th generated token a stop token: generation must end there, with it included.
    stop = int(free.new_ids[5])
    engine = Engine(target, draft, stop_token_ids=[stop])
    first = int((free.new_ids == stop).nonzero()[0])
    res = engine.decode(engine.prefill(ids), block_size=B, max_new_tokens=30)
    assert res.stopped and res.new_tokens == first + 1 and int(res.new_ids[-1]) == stop


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_is_seeded_and_matches_dflash(seed, cpu_timer):
    target, draft = make_pair(seed, block_size=B)
    engine = Engine(target, draft)
    ids = prompt(seed)
    state = engine.prefill(ids)
    for b in (1, B, B + 3):
        a = engine.decode(state, block_size=b, max_new_tokens=30, temperature=1.0, top_k=20, seed=11)
        again = engine.decode(state, block_size=b, max_new_tokens=30, temperature=1.0, top_k=20, seed=11)
        other = engine.decode(state, block_size=b, max_new_tokens=30, temperature=1.0, top_k=20, seed=12)
        ref = reference(draft, target, ids, b, 30, None, temperature=1.0, top_k=20, seed=11)
        assert torch.equal(a.output_ids, again.output_ids) and a.committed == again.committed
        assert torch.equal(a.output_ids, ref.output_ids) and a.committed == ref.acceptance_lengths
        assert not torch.equal(a.output_ids, other.output_ids)


def test_rejection_rule_on_known_distributions():
    """The T > 0 acceptance the engine uses: accept a draft token x ~ q with prob min(1, p(x)/q(x)), else
    resample from norm(max(p - q, 0)). Then P(accept) = sum_x min(p, q) and the emitted token is ~ p."""
    from pipeline.engine import _rejection_sample

    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    torch.manual_seed(0)
    n = 20000
    accepted = 0
    counts = torch.zeros(4)
    target_probs = torch.stack([p, p])[None]  # position 0 verifies the draft token, position 1 is the bonus
    for _ in range(n):
        x = torch.multinomial(q, 1)
        acc, tok = _rejection_sample(x[None], target_probs, q[None, None])
        accepted += acc
        counts[int(x) if acc == 1 else int(tok)] += 1
    assert accepted / n == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.015)
    assert torch.allclose(counts / n, p, atol=0.015)


def test_bad_arguments_fail_clearly():
    target, draft = make_pair(0, block_size=B)
    engine = Engine(target, draft)
    state = engine.prefill(prompt(0))
    with pytest.raises(ValueError, match="block_size"):
        engine.decode(state, block_size=0, max_new_tokens=5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.decode(state, block_size=2, max_new_tokens=0)
    with pytest.raises(ValueError, match="one non-empty prompt"):
        engine.prefill(torch.zeros((2, 3), dtype=torch.long))


def test_first_token_stop_has_no_steps(cpu_timer):
    target, draft = make_pair(2, block_size=B)  # this pair's greedy first token is EOS
    engine = Engine(target, draft, stop_token_ids=[EOS_ID])
    ids = prompt(2)
    res = engine.decode(engine.prefill(ids), block_size=B, max_new_tokens=20)
    ref = reference(draft, target, ids, B, 20, [EOS_ID])
    assert res.new_ids.tolist() == [EOS_ID] and res.stopped
    assert res.steps == 0 and ref.acceptance_lengths == [] and res.tau == 1.0
