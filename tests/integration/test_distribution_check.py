"""The T > 0 output check (pipeline.evaluation.distribution) on the bundled tiny pair at T = 1: the engine's outputs
pass at every block size, and samplers that are not exact fail it: one that accepts every drafted token, and one
that resamples a rejected slot from the target's p instead of the residual (p - q)+."""

import pytest
import torch
from dflash.model import _sample_probs

import pipeline.decoding.engine as engine_module
from pipeline.decoding.engine import Engine
from pipeline.evaluation.distribution import ALPHA, pit_values, uniformity

PROMPTS = ["def parse(self, text):\n    ", "In the beginning God created the heaven", "Q: What is 12 times 7?\nA:",
           "The os.path module", "You will be"]
NEW, SEEDS = 96, 3


@pytest.fixture(scope="module")
def tiny():
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config(["model.device=cpu", "model.dtype=float32"]).model)
    return m, Engine(m.target, m.draft, None)  # no stop tokens: every draw is NEW tokens long


def check(tiny, block_size, seeds=SEEDS):
    m, engine = tiny
    u = []
    for i, text in enumerate(PROMPTS):
        state = engine.prefill(torch.tensor([m.tokenizer(text)["input_ids"]]))
        for s in range(seeds):  # every (prompt, draw) its own stream: one seed for all prompts repeats the draws
            res = engine.decode(state, block_size=block_size, max_new_tokens=NEW, temperature=1.0, seed=1000 * i + s)
            u.extend(pit_values(m.target, res.output_ids, res.num_input_tokens, 1.0, 1.0, 0, seed=100 * i + s))
    return uniformity(u)


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_the_engine_samples_the_targets_distribution(tiny, block_size):
    out = check(tiny, block_size)
    assert out["tokens"] == len(PROMPTS) * SEEDS * NEW
    assert out["passes"], out


def accept_all(draft_tokens, target_probs, draft_probs, draft_indices=None):
    return int(draft_tokens.shape[1]), _sample_probs(target_probs[:, -1])[0]


def resample_from_p(draft_tokens, target_probs, draft_probs, draft_indices=None):
    """The acceptance test right, the correction wrong: a rejected slot is redrawn from p, not from (p - q)+."""
    p = target_probs[:, :draft_tokens.shape[1]].gather(-1, draft_tokens[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    accepted = int((torch.rand_like(q) * q < p).to(torch.int32).cumprod(-1).sum(-1)[0])
    return accepted, _sample_probs(target_probs[:, accepted])[0]


# The wrong correction only touches the token after a rejection: it needs more draws to show (p ~ 0.3 at 3 draws a
# prompt, ~5e-8 at 8) than accepting everything does (p ~ 4e-89 at 3).
@pytest.mark.parametrize("sampler, seeds", [(accept_all, SEEDS), (resample_from_p, 8)])
def test_a_biased_sampler_fails(tiny, monkeypatch, sampler, seeds):
    monkeypatch.setattr(engine_module, "_rejection_sample", sampler)
    out = check(tiny, 8, seeds)
    assert not out["passes"] and out["p_value"] < ALPHA, out


def test_uniformity_by_hand():
    even = [(i + 0.5) / 200 for i in range(200)]  # 10 per bin: chi2 = 0, p = 1
    assert uniformity(even)["chi2"] == 0.0 and uniformity(even)["p_value"] == pytest.approx(1.0)
    low = [x / 2 for x in even]  # every value in the lower half: chi2 = 10 bins x (20 - 10)^2 / 10 x 2 = 200
    out = uniformity(low)
    assert out["chi2"] == pytest.approx(200.0) and out["p_value"] < 1e-30 and not out["passes"]
    assert uniformity(even[:50])["p_value"] is None  # under 5 expected per bin: no verdict


def test_the_batched_engine_samples_the_targets_distribution(tiny):
    """Continuous batching at T = 1 (rows of several requests verified in one pass, mixed block sizes), as the pass
    at load decodes."""
    from pipeline.decoding.batched import BatchedEngine

    m, engine = tiny
    prompts = [m.tokenizer(t)["input_ids"] for t in PROMPTS] * SEEDS
    torch.manual_seed(0)
    run = BatchedEngine(engine).run(prompts, slots=4, max_new_tokens=NEW, choose=lambda i, lg, h: (4 + i % 5, None),
                                    temperature=1.0)
    u = [x for i, r in enumerate(run.requests)
         for x in pit_values(m.target, r.decode.output_ids, r.decode.num_input_tokens, 1.0, 1.0, 0, seed=i)]
    out = uniformity(u)
    assert out["tokens"] == len(prompts) * NEW and out["passes"], out


def test_each_prompt_draws_its_own_stream_and_a_draw_is_reproducible():
    from pipeline.runtime.seeds import draw_seed

    seeds = {draw_seed(0, f"p{i}", r) for i in range(50) for r in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert draw_seed(0, "p1", 2) == draw_seed(0, "p1", 2) != draw_seed(1, "p1", 2)
    assert draw_seed(0, "p1", 0) != draw_seed(0, "p1", 0, "pit")
