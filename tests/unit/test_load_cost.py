"""The cost of a batched step over (b, c, width) (pipeline.policy.load_cost) and what the batched engine records for it;
lockstep runs (pipeline.decoding.batched.lockstep) decode exactly what they decode alone."""

import numpy as np
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


def test_a_width_slope_the_noise_made_negative_is_refit_without_the_width_axis():
    """AR's per-key cost is small beside its step; two noisy contexts can fit it negative, and extrapolated to longer
    rows that would model them faster than short ones. The fit then drops the width terms: the mean, not a slope."""
    from pipeline.policy.load_cost import fit_width

    ar = [{"b": 1, "context": ctx, "width": float(ctx), "draft_seconds": 0.0, "verify_seconds": y}
          for ctx, y in ((64, 6.9e-3), (64, 6.5e-3), (256, 6.0e-3), (256, 6.2e-3))]
    f = fit_width(ar, "total", 160.0)
    assert f["per_key"] == 0.0 and f["intercept"] == pytest.approx(np.mean([6.9e-3, 6.5e-3, 6.0e-3, 6.2e-3]))
    # a positive slope is kept as fitted
    up = [dict(p, verify_seconds=5e-3 + 1e-5 * p["width"]) for p in ar]
    g = fit_width(up, "total", 160.0)
    assert g["per_key"] == pytest.approx(1e-5) and g["intercept"] == pytest.approx(5e-3 + 1e-5 * 160)
    # b >= 2: a per-key cost negative at some b of the fit drops both width terms, the slope in b stays
    multi = [{"b": b, "context": ctx, "width": float(ctx), "draft_seconds": 0.0,
              "verify_seconds": 1e-3 * b + (2e-6 - 1e-6 * b) * ctx} for b in (2, 4, 8) for ctx in (64, 256)]
    h = fit_width(multi, "verify", 160.0)
    assert h["per_key"] == h["per_key_b"] == 0.0 and h["slope"] > 0
    # ... while the made-up truth of the tests above (positive at every b) is recovered exactly
    kept = fit_width([p for p in raw_points(4) if p["b"] >= 2], "draft", 170.0)
    assert kept["per_key"] > 0 and kept["per_key_b"] > 0


def test_padded_width_is_the_expected_longest_of_c_rows():
    from pipeline.policy.load_cost import padded_width

    assert padded_width([100, 300], 1) == pytest.approx(200)  # one row: the mean
    assert padded_width([100, 300], 2) == pytest.approx((100 + 3 * 300) / 4)  # max of two draws: 300 unless both 100
    assert padded_width([250] * 7, 16) == pytest.approx(250)
    rng = np.random.default_rng(0)
    w = rng.integers(20, 400, 50).astype(float)
    draws = rng.choice(w, size=(200_000, 8)).max(axis=1).mean()  # Monte Carlo, independent of the formula
    assert padded_width(w, 8) == pytest.approx(draws, rel=5e-3)
    assert padded_width(w, 16) > padded_width(w, 8) > padded_width(w, 1)


def test_the_schedule_reads_each_c_at_the_width_its_steps_pad_to():
    """A profile where b = 4 costs 2.4x AR at the profile's mean width and its per-key cost (4 queries a row) grows
    faster than AR's: with the rows' widths the c = 16 steps pad to ~the longest row, where AR wins; at the mean
    width b = 4 does."""
    from pipeline.policy.load_cost import padded_width, schedule

    def pts(c):
        return [{"b": b, "context": ctx, "round": 1, "steps": 8, "width": float(ctx),
                 "draft_seconds": 0.0,
                 "verify_seconds": 3e-3 + 1e-6 * ctx if b == 1 else 1.6e-3 * b + 2e-6 * b * ctx}
                for b in (1, 2, 4) for ctx in (64, 256)]
    load = {}
    for c in (4, 16):
        part = fit_load(pts(c), [1, 2, 4], [64, 256])
        load[str(c)] = {"seconds": {str(b): v for b, v in part["seconds"].items()}, "fit": part["fit"], "raw": part["raw"]}
    lc = LoadCost.from_profile(CostProfile({1: 1e-3, 2: 1.5e-3, 4: 2e-3}, meta={"load": load, "concurrency": [1, 4, 16]},
                                           version=3))
    tau = np.full((40, 2), [1.2, 3.0])  # candidates 2 and 4
    widths = np.r_[np.full(30, 60.0), np.full(10, 900.0)]
    assert padded_width(widths, 16) > 850 and widths.mean() < 300
    at_mean = schedule(tau, [2, 4], lc, [1, 4, 16])
    at_pad = schedule(tau, [2, 4], lc, [1, 4, 16], widths)
    assert at_mean[16] == 4 and at_pad[16] == 1
    for c in (4, 16):  # what each chose is the least mean cost / tau at the width it read
        for sched, w in ((at_mean, None), (at_pad, padded_width(widths, c))):
            per = {b: lc.cost(b, c, w) / (1.0 if b == 1 else tau[0, [2, 4].index(b)]) for b in (1, 2, 4)}
            assert sched[c] == min(per, key=per.get)
