"""The cost of a batched step over (b, c, width) (pipeline.policy.load_cost) and what the batched engine records for it;
lockstep runs (pipeline.decoding.batched.lockstep) decode exactly what they decode alone."""

import pytest
import torch

from pipeline.policy.cost import CostProfile
from pipeline.policy.load_cost import LoadCost, fit_load


def truth(b, width, c):
    """A made-up step: draft 1 ms + 0.5 ms per b + (2 + 0.3 b) us per key; verify twice that; AR 3 ms + 4 us a key;
    each scaled by c / 4 (so that interpolation in c is exercised)."""
    k = c / 4
    draft = k * (1e-3 + 5e-4 * b + (2e-6 + 3e-7 * b) * width)
    return (0.0, k * (3e-3 + 4e-6 * width)) if b == 1 else (draft, 2 * draft)


def raw_points(c):
    return [{"b": b, "context": ctx, "round": 1, "steps": 8, "width": float(ctx + 10),
             "draft_seconds": truth(b, ctx + 10, c)[0], "verify_seconds": truth(b, ctx + 10, c)[1]}
            for b in (1, 2, 4, 6, 8) for ctx in (64, 256)]


def load_cost(cs=(4, 16)):
    load = {}
    for c in cs:
        part = fit_load(raw_points(c), [1, 2, 4, 6, 8], [64, 256])
        load[str(c)] = {"seconds": {str(b): v for b, v in part["seconds"].items()}, "fit": part["fit"],
                        "raw": part["raw"]}
    base = CostProfile({b: 1e-3 * b for b in range(1, 9)}, meta={"load": load, "concurrency": [1, *cs]}, version=3)
    return LoadCost.from_profile(base)


@pytest.mark.parametrize("b,width", [(2, 74), (6, 600), (8, 900), (5, 40)])
def test_the_width_fit_recovers_a_known_step_cost_at_widths_it_never_saw(b, width):
    lc = load_cost()
    for c in (4, 16):
        draft, verify = truth(b, width, c)
        assert lc.cost(b, c, width) == pytest.approx(draft + verify, rel=1e-6)
        assert lc.step_seconds(c, c * b, c, c * b, width) == pytest.approx(draft + verify, rel=1e-6)
        assert lc.cost(1, c, width) == pytest.approx(truth(1, width, c)[1], rel=1e-6)
    # Between grid points each coefficient is interpolated linearly in c, and so is this c-linear truth.
    assert lc.cost(b, 10, width) == pytest.approx(sum(truth(b, width, 10)), rel=1e-6)


def test_without_a_width_the_step_is_costed_at_the_profiles_mean_width():
    lc = load_cost()
    mean_width = (74 + 266) / 2
    assert lc.cost(6, 16) == pytest.approx(sum(truth(6, mean_width, 16)), rel=1e-6)
    # A profile measured before the width axis (raw points without `width`) keeps the affine fit in b alone.
    old = [{k: v for k, v in p.items() if k != "width"} for p in raw_points(16)]
    fit = fit_load(old, [1, 2, 4, 6, 8], [64, 256])["fit"]
    assert set(fit) == {"draft", "verify"} and set(fit["draft"]) == {"intercept", "slope"}


@pytest.fixture(scope="module")
def tiny():
    from pipeline.decoding.batched import BatchedEngine
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import load_config

    torch.set_num_threads(1)
    m = load_models(load_config(["model.device=cpu", "model.dtype=float32"]).model)
    return m, BatchedEngine(Engine(m.target, m.draft, None))


def test_a_step_records_the_keys_its_longest_row_reads(tiny):
    from pipeline.decoding.batched import fixed

    m, batched = tiny
    run = batched.run([list(range(5, 15)), list(range(5, 35))], slots=2, max_new_tokens=6, choose=fixed(4))
    first = next(s for s in run.steps if s.kind == "decode")
    # Row 2's prompt has 30 tokens: its block starts at position 30 (the first new token) and spans 4 positions.
    assert first.width == 30 + 4 and first.rows == 2
    prefill = run.steps[0]
    assert prefill.kind == "prefill" and prefill.width == 30


def test_lockstep_runs_decode_what_they_decode_alone(tiny):
    from pipeline.decoding.batched import fixed

    m, batched = tiny
    prompts = [m.tokenizer(t)["input_ids"] for t in ["def parse(self, text):", "In the beginning God created",
                                                      "Let x be the number of apples", "import os\n", "The fox"]]
    chooses = [fixed(1), fixed(3), lambda i, lg, h: (2 + i % 3, None)]
    together = batched.run_lockstep(chooses, prompts, 2, 12)
    for ch, got in zip(chooses, together):
        alone = batched.run(prompts, slots=2, max_new_tokens=12, choose=ch)
        assert [r.decode.committed for r in got.requests] == [r.decode.committed for r in alone.requests]
        assert [r.choice for r in got.requests] == [r.choice for r in alone.requests]
        assert [(s.kind, s.rows, s.verify_tokens, s.width) for s in got.steps] == \
            [(s.kind, s.rows, s.verify_tokens, s.width) for s in alone.steps]
