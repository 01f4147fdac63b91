"""The arithmetic of benchmarks/set_win_rate.py: a drawn set's gain is the ratio of its mean times per token, and
a fitted row's choice is made without that row (leave-one-out), a val row's by the model fitted on the others."""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.set_win_rate import out_of_sample_choices, set_gains  # noqa: E402
from pipeline.training.analysis import apply_margin  # noqa: E402


def test_a_set_of_every_row_has_the_all_rows_gain_and_a_set_of_one_its_own():
    rng = np.random.default_rng(0)
    t_ch, t_fb = rng.uniform(1, 2, 12), rng.uniform(1, 2, 12)
    whole = set_gains(t_ch, t_fb, 12, 50, rng)  # without replacement: every draw is a permutation of all rows
    assert np.allclose(whole, t_fb.mean() / t_ch.mean() - 1)
    single = set_gains(t_ch, t_fb, 1, 400, rng)
    assert set(np.round(single, 12)) <= set(np.round(t_fb / t_ch - 1, 12)) and len(set(np.round(single, 12))) > 6


def test_out_of_sample_choices_leave_the_row_out():
    rng = np.random.default_rng(1)
    n, v = 80, 6
    x = rng.normal(size=(n, v))
    # action 1 is faster exactly where feature 0 is positive; action 0 (the fallback) elsewhere.
    tau = np.stack([np.full(n, 3.0), np.where(x[:, 0] > 0, 4.5, 2.0)], 1)
    costs, fit = np.array([1.0, 1.0]), np.arange(n) < 60
    chosen, _ = out_of_sample_choices(x, tau, fit, costs, 0, 0.5)
    best = tau.argmax(1)
    assert (chosen == best).mean() > 0.9  # a learnable rule is learned, out of sample
    # The val rows: the fitted model's choice.
    from pipeline.training.ridge import fit_ridge

    model, again = fit_ridge(x[fit], tau[fit], costs, 0, 0.5)
    with torch.no_grad():
        pv = model(torch.from_numpy(x[~fit]).float()).double().numpy() * 0.5
    assert np.array_equal(chosen[~fit], apply_margin(pv, again["calibration"]["margin"], 0))
    # A fitted row with a feature of its own and a label that contradicts its neighbours': in sample, ridge fits
    # the label through that feature and would choose the fallback; left out, the row is chosen as its neighbours.
    i = int(np.flatnonzero(fit & (x[:, 0] > 1.0))[0])
    own = (np.arange(n) == i).astype(float)[:, None]
    tau2 = tau.copy()
    tau2[i] = [3.0, 1.0]
    chosen2, _ = out_of_sample_choices(np.hstack([x, own]), tau2, fit, costs, 0, 0.5)
    assert chosen2[i] == 1
