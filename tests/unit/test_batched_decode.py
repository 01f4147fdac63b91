"""The batched decoder (pipeline.decoding.batched) against the batch-1 engine on the bundled tiny pair: at T = 0 every
request of a continuously batched run, whatever its block size, rule, prompt length and slot, decodes token for token
and step for step as it does alone."""

import json

import pytest
import torch

from pipeline.decoding.batched import BatchedEngine, fixed
from pipeline.decoding.engine import Engine
from pipeline.policy.step_rules import parse_rule

BLOCK_SIZES = [1, 2, 3, 5, 8, 12, 16]


@pytest.fixture(scope="module")
def tiny():
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config(["model.device=cpu", "model.dtype=float32"]).model)
    return m, Engine(m.target, m.draft, m.stop_token_ids)


def bundled_prompts(tokenizer, n):
    """n real prompts of the bundled label sets, cut to lengths from 3 to 90 tokens (so rows start unaligned)."""
    from pipeline.data.bundled import PROMPTS_DIR

    texts = []
    for kind in ("code", "bible", "maths", "docs"):
        with open(PROMPTS_DIR / f"{kind}-label.jsonl") as f:
            texts += [json.loads(line)["text"] for _, line in zip(range(n), f)]
    return [tokenizer(t)["input_ids"][:3 + (7 * i) % 88] for i, t in enumerate(texts[:n])]


def choice_of(i):
    """Mixed actions: every fourth request a threshold rule at b_max 10, the rest cycling through BLOCK_SIZES."""
    return (10, parse_rule("threshold:0.05")) if i % 4 == 3 else (BLOCK_SIZES[i % len(BLOCK_SIZES)], None)


def alone(engine, prompt, b, rule, max_new_tokens):
    return engine.decode(engine.prefill(torch.tensor([prompt])), block_size=b, max_new_tokens=max_new_tokens,
                         step_rule=rule)


def test_every_request_of_a_continuous_batch_equals_its_batch1_decode(tiny):
    m, engine = tiny
    # 32 requests through 12 slots: 16 prefills, every action taken (2026-12-06; 64 took 12 s of the unit layer)
    prompts = bundled_prompts(m.tokenizer, 32)
    assert len(prompts) == 32
    run = BatchedEngine(engine).run(prompts, slots=12, max_new_tokens=40, choose=lambda i, lg, h: choice_of(i))
    # Continuous batching: requests were admitted in many prefills as slots freed, not in one closed batch.
    prefills = [s for s in run.steps if s.kind == "prefill"]
    assert len(prefills) > 6 and max(s.rows for s in run.steps if s.kind == "decode") == 12
    assert sorted({r.choice[0] for r in run.requests}) == sorted(set(BLOCK_SIZES) | {10})
    for i, (p, got) in enumerate(zip(prompts, run.requests)):
        b, rule = choice_of(i)
        ref = alone(engine, p, b, rule, 40)
        assert got.index == i and got.choice == (b, rule)
        assert got.decode.output_ids.tolist() == ref.output_ids.tolist(), f"request {i} (b={b}, rule={rule}): tokens"
        assert got.decode.committed == ref.committed, f"request {i}: committed per step"
        assert got.decode.verified == ref.verified, f"request {i}: verified per step"
        assert got.decode.stopped == ref.stopped
        assert 0 <= got.admitted_at < got.finished_at <= run.wall_seconds + 1e-6
    assert run.new_tokens == sum(r.decode.new_tokens for r in run.requests) > 0


def test_the_step_log_accounts_for_every_verified_token(tiny):
    """The batched steps' token counts are the requests' own: each decode step's verify tokens are its rows' verified
    + 1, summed, and its draft tokens the drafting rows' block sizes (what the cost model is fitted on)."""
    m, engine = tiny
    prompts = bundled_prompts(m.tokenizer, 10)
    run = BatchedEngine(engine).run(prompts, slots=4, max_new_tokens=24, choose=lambda i, lg, h: (1 + i % 5, None))
    decode = [s for s in run.steps if s.kind == "decode"]
    assert sum(s.verify_tokens for s in decode) == sum(v + 1 for r in run.requests for v in r.decode.verified)
    assert sum(s.rows for s in decode) == sum(r.decode.steps for r in run.requests)
    assert sum(s.verify_tokens for s in run.steps if s.kind == "prefill") == sum(map(len, prompts))
    assert all(s.rows <= 4 for s in run.steps)


def test_sampling_runs_and_stays_in_the_vocabulary(tiny):
    """T > 0: rejection sampling per row; tokens are valid and each request stops within its budget."""
    m, engine = tiny
    prompts = bundled_prompts(m.tokenizer, 6)
    torch.manual_seed(0)
    run = BatchedEngine(engine).run(prompts, slots=3, max_new_tokens=20, choose=fixed(6), temperature=1.0)
    for p, r in zip(prompts, run.requests):
        assert r.decode.output_ids[0, :len(p)].tolist() == p
        assert 1 <= r.decode.new_tokens <= 20 and int(r.decode.output_ids.max()) < m.vocab_size
        assert all(1 <= c <= 6 for c in r.decode.committed)


def test_bad_choices_are_refused(tiny):
    m, engine = tiny
    with pytest.raises(ValueError, match="block size 0"):
        BatchedEngine(engine).run([[5, 6, 7]], slots=1, max_new_tokens=4, choose=fixed(0))
    with pytest.raises(ValueError, match="at least one token"):
        BatchedEngine(engine).run([[]], slots=1, max_new_tokens=4, choose=fixed(4))
