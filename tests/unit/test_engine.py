"""The engine against dflash's reference loop and against plain greedy decoding (CPU, fp32, random pairs and the
bundled tiny pair)."""

import pytest
import torch
from dflash import model as dflash_model

from pipeline.decoding.engine import Engine, greedy_reference
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


def reference(draft, target, ids, b, max_new, stops, temperature=0.0, top_k=0, seed=None, top_p=1.0):
    if seed is not None:
        torch.manual_seed(seed)
    return dflash_model.dflash_generate(draft, target, ids, max_new, stops, temperature=temperature,
                                        top_p=top_p, top_k=top_k, block_size=b, return_stats=True)


def assert_same_as_dflash(res, ref, what=""):
    """Token ids AND per-verify-step committed counts (bonus included) equal to dflash_generate's."""
    assert torch.equal(res.output_ids, ref.output_ids), f"{what}: ids differ from dflash_generate"
    assert res.committed == ref.acceptance_lengths, f"{what}: per-step committed counts differ"
    assert res.new_tokens == ref.num_output_tokens, what


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
        # The step clock's books balance: one verified length per step, the first step's two parts inside the
        # totals, and the draft's and target's share summing to what the steps took.
        assert len(res.verified) == len(res.committed) == res.steps
        assert 0 < res.first_step_seconds[1] <= res.verify_seconds
        assert 0 <= res.first_step_seconds[0] <= res.draft_seconds
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


# ----------------------------------------------------------------------------------------------------------------
# Edge cases against the reference: stop tokens inside an accepted block, top_p / top_k, one-token prompts, and the
# bundled tiny pair (real tokenizer, real prompts). Each compares token ids AND per-step committed counts.


@pytest.fixture(scope="module")
def tiny():
    """The bundled tiny pair (loaded once for this module) and three HumanEval prompts through its chat template."""
    from pipeline.data.bundled import load_bundled
    from pipeline.runtime.config import ModelConfig
    from pipeline.data.chat import format_prompt
    from pipeline.decoding.models import load_models

    m = load_models(ModelConfig())
    rows = load_bundled("humaneval")[:3]
    prompts = [m.tokenizer(format_prompt(m.tokenizer, r["text"]), return_tensors="pt").input_ids.to(m.device)
               for r in rows]
    return m, prompts


def mid_block_stop(free):
    """Where a stop token would fire inside an accepted block of ``free`` (a run that no stop token cut short).

    Step j commits ``new[done + 1 : done + c + 1]`` (``new[0]`` is the prefill's token): the accepted draft tokens,
    then the bonus. Returns ``(token, j, k)`` for the first generated token that occurs for the first time at
    position k of a step j >= 1 with 2 <= k < c, i.e. an accepted draft token that is neither the step's first
    committed token nor its last (the bonus, the block end), after at least one whole step; None if there is none.
    """
    new = free.new_ids.tolist()
    first = {}
    for i, tok in enumerate(new):
        first.setdefault(tok, i)
    done = 0
    for j, c in enumerate(free.committed):
        for k in range(2, c):
            if j >= 1 and first[new[done + k]] == done + k:
                return new[done + k], j, k
        done += c
    return None


def check_mid_block_stop(target, draft, ids, b, max_new, stops, temperature=0.0, seed=None):
    """Find a mid-block stop token for this run (None if none); make it a stop token and compare with dflash."""
    engine = Engine(target, draft, stops)
    free = engine.decode(engine.prefill(ids), block_size=b, max_new_tokens=max_new, temperature=temperature,
                         seed=seed)
    found = mid_block_stop(free)
    if found is None:
        return None
    tok, j, k = found
    engine = Engine(target, draft, stops + [tok])
    res = engine.decode(engine.prefill(ids), block_size=b, max_new_tokens=max_new, temperature=temperature,
                        seed=seed)
    ref = reference(draft, target, ids, b, max_new, stops + [tok], temperature=temperature, seed=seed)
    assert_same_as_dflash(res, ref, f"b={b}, T={temperature}, stop token {tok}")
    # The situation really occurs: the run ends on the stop token, which step j committed at position k of an
    # accepted block that went on (k < c_j, so neither its first committed token nor its bonus).
    assert res.stopped and int(res.new_ids[-1]) == tok
    assert res.committed == free.committed[:j] + [k] and 2 <= k < free.committed[j]
    return found


def test_stop_token_mid_block_greedy_matches_dflash(tiny, cpu_timer):
    # The random pairs accept only runs of one repeated token at T = 0, so no token occurs for the first time
    # inside an accepted block there; the bundled pair's real continuations do.
    m, prompts = tiny
    found = next((f for ids in prompts
                  if (f := check_mid_block_stop(m.target, m.draft, ids, m.block_size, 32, list(m.stop_token_ids)))),
                 None)
    assert found, "no T = 0 run of the bundled pair stops inside an accepted block: the test would be vacuous"


@pytest.mark.parametrize("b", [B, B + 3])
def test_stop_token_mid_block_sampled_matches_dflash(b, cpu_timer):
    target, draft = make_pair(0, block_size=B)
    found = check_mid_block_stop(target, draft, prompt(0), b, 30, [EOS_ID], temperature=1.0, seed=5)
    assert found, f"b={b}: no sampled run stops inside an accepted block: the test would be vacuous"


@pytest.mark.parametrize("top_p,top_k", [(0.6, 0), (1.0, 8), (0.8, 12)], ids=["top_p", "top_k", "top_p+top_k"])
def test_top_p_top_k_sampling_matches_dflash(top_p, top_k, cpu_timer):
    target, draft = make_pair(1, block_size=B)
    engine = Engine(target, draft, stop_token_ids=[EOS_ID])
    ids = prompt(1)
    state = engine.prefill(ids)
    for b in (1, B, B + 3):
        res = engine.decode(state, block_size=b, max_new_tokens=30, temperature=1.0, top_p=top_p, top_k=top_k,
                            seed=3)
        ref = reference(draft, target, ids, b, 30, [EOS_ID], temperature=1.0, top_p=top_p, top_k=top_k, seed=3)
        assert_same_as_dflash(res, ref, f"b={b}, top_p={top_p}, top_k={top_k}")
        # The truncation bites: the same seed without it samples other tokens.
        plain = engine.decode(state, block_size=b, max_new_tokens=30, temperature=1.0, seed=3)
        assert not torch.equal(res.output_ids, plain.output_ids), f"b={b}: top_p/top_k changed nothing"


@pytest.mark.parametrize("seed", [0, 1])
def test_prompt_of_length_one_matches_dflash(seed, cpu_timer):
    target, draft = make_pair(seed, block_size=B)
    engine = Engine(target, draft, stop_token_ids=[EOS_ID])
    ids = prompt(seed, length=1)
    state = engine.prefill(ids)
    assert state.num_input_tokens == 1 and state.context.shape[1] == 1
    greedy = greedy_reference(target, ids, 24, [EOS_ID])
    for b in BLOCK_SIZES:
        res = engine.decode(state, block_size=b, max_new_tokens=24)
        ref = reference(draft, target, ids, b, 24, [EOS_ID])
        assert_same_as_dflash(res, ref, f"T=0, b={b}")
        assert torch.equal(res.output_ids, greedy), f"b={b}: not lossless w.r.t. greedy decoding"
        assert res.steps > 0
        res = engine.decode(state, block_size=b, max_new_tokens=24, temperature=1.0, seed=7)
        ref = reference(draft, target, ids, b, 24, [EOS_ID], temperature=1.0, seed=7)
        assert_same_as_dflash(res, ref, f"T=1, b={b}")
        assert res.steps > 0


def test_bundled_pair_greedy_matches_dflash(tiny, cpu_timer):
    m, prompts = tiny
    assert m.block_size == 8
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    taus = []
    for i, ids in enumerate(prompts):
        state = engine.prefill(ids)
        for b in (5, m.block_size):
            res = engine.decode(state, block_size=b, max_new_tokens=24)
            ref = reference(m.draft, m.target, ids, b, 24, m.stop_token_ids)
            assert_same_as_dflash(res, ref, f"prompt {i}, b={b}")
            taus.append(res.tau)
    assert max(taus) > 1.0, "the trained draft should get some tokens accepted"


def test_bundled_pair_sampling_matches_dflash(tiny, cpu_timer):
    m, prompts = tiny
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    ids = prompts[0]
    state = engine.prefill(ids)
    res = engine.decode(state, block_size=m.block_size, max_new_tokens=24, temperature=0.8, top_p=0.9, top_k=20,
                        seed=0)
    ref = reference(m.draft, m.target, ids, m.block_size, 24, m.stop_token_ids, temperature=0.8, top_p=0.9,
                    top_k=20, seed=0)
    assert_same_as_dflash(res, ref, "T=0.8, top_p=0.9, top_k=20")
    assert res.tau > 1.0, "some sampled draft tokens should be accepted"
    plain = engine.decode(state, block_size=m.block_size, max_new_tokens=24, temperature=0.8, seed=0)
    assert not torch.equal(res.output_ids, plain.output_ids), "top_p/top_k changed nothing"
