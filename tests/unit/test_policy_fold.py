"""The folded policy (first layer folded through the target's lm_head) makes the same choices from the final hidden
state as the policy makes from the logits, on real prefills of the bundled tiny pair."""

import pytest
import torch

from pipeline.decoding.adaptive import AdaptiveDecoder
from pipeline.runtime.config import ModelConfig, load_config
from pipeline.decoding.engine import Engine
from pipeline.decoding.models import load_models
from pipeline.policy.blocksize import BlockSizeMLP, BlockSizePolicy
from pipeline.data.sources import build_prompts


@pytest.fixture(scope="module")
def tiny():
    m = load_models(ModelConfig())
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    cfg = load_config()
    rows, _, _ = build_prompts(cfg.prepare.sources, m.tokenizer, cfg.prepare.max_prompt_tokens, limit=24)
    states = [engine.prefill(torch.tensor(r["input_ids"])[None]) for r in rows]
    return m, engine, states


def policy_for(vocab, transform="none", seed=0):
    torch.manual_seed(seed)
    return BlockSizePolicy(BlockSizeMLP(vocab, 5, hidden=256, n_layers=2), [6, 7, 8, 9, 10], vocab, transform,
                           {"trained_block_size": 8})


def test_folded_choices_equal_the_policy_on_logits(tiny, tmp_path):
    m, engine, states = tiny
    policy = policy_for(m.vocab_size)
    logits = torch.stack([s.logits for s in states])
    with torch.no_grad():  # centre the first layer on these prompts, so that the random policy's choices vary
        policy.model.input.bias.copy_(-(policy.model.input.weight @ logits.mean(0)))
    folded = policy.fold(m.target.lm_head)
    H = m.target.config.hidden_size
    assert folded.reads_hidden and folded.vocab_size == H and folded.model.input.weight.shape == (256, H)
    assert policy.model.input.weight.numel() / folded.model.input.weight.numel() == m.vocab_size / H  # V/H smaller
    hidden = torch.stack([s.hidden for s in states])
    assert torch.allclose(m.target.lm_head(hidden), logits, atol=1e-4)  # the prefill's hidden is what lm_head reads
    plain, fast = policy.scores(logits), folded.scores(hidden)
    assert torch.allclose(plain, fast, rtol=1e-4, atol=1e-4)
    assert policy.choose_batch(logits) == folded.choose_batch(hidden)
    assert len(set(policy.choose_batch(logits))) > 1  # the random policy does not answer one class for everything
    # It exports and reloads like any policy, and the adaptive decoder feeds it the hidden state.
    folded.save_pretrained(tmp_path / "folded")
    again = BlockSizePolicy.from_pretrained(tmp_path / "folded")
    assert again.reads_hidden and again.choose_batch(hidden) == folded.choose_batch(hidden)
    for state in states[:4]:
        assert AdaptiveDecoder(engine, again).choose(state)[0] == AdaptiveDecoder(engine, policy).choose(state)[0]


def test_only_a_policy_on_raw_logits_folds(tiny):
    m, _, _ = tiny
    with pytest.raises(ValueError, match="input_transform 'none'"):
        policy_for(m.vocab_size, "softmax").fold(m.target.lm_head)
    with pytest.raises(ValueError, match="lm_head has"):
        policy_for(m.vocab_size + 1).fold(m.target.lm_head)
    folded = policy_for(m.vocab_size).fold(m.target.lm_head)
    with pytest.raises(ValueError, match="folded already"):
        folded.fold(m.target.lm_head)
    with pytest.raises(ValueError, match="hidden states of width"):
        folded.choose(torch.zeros(m.vocab_size))
