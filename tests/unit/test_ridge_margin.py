"""The ridge policy's margin is calibrated on predictions its penalty choice did not see (pipeline/training/ridge.py):
each fold's rows predicted by a fit on the other folds whose penalty was chosen by leave-one-out on those rows
alone, checked here against direct solves; the penalty grid is relative to the kernel's scale; a fit above
train.cache_max_gb is refused before it starts."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.policy.blocksize import calibrate_margin, speed_gain, speed_targets
from pipeline.training.ridge import _gram, check_memory, fit_ridge, peak_bytes, row_folds

RATIOS = (0.01, 0.3, 10.0)
COSTS = np.array([1.0, 1.05, 1.1])
SCALE = 0.5


def _problem(seed: int = 0, n: int = 45, v: int = 7):
    """Weak signal in feature 0 (action 2 faster where it is positive), the rest noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, v)) * rng.uniform(0.5, 2, v) + rng.normal(0, 1, v)
    tau = rng.uniform(2.5, 3.5, (n, 3))
    tau[:, 2] += 0.6 * np.tanh(x[:, 0]) + rng.normal(0, 0.3, n)
    return x, tau


def _direct_outer(x, tau, folds):
    """The out-of-fold predictions by plain primal solves: standardise on every row; per fold, every ratio's
    leave-one-out argmax gain on the other rows (a refit per left-out row), the best ratio (a tie: the larger),
    alpha = ratio x trace(Zc Zc^T) / m on those m rows, then the fit on them predicts the fold."""
    n, v = x.shape
    z = (x - x.mean(0)) / x.std(0)
    y = speed_targets(tau, COSTS, 0) / SCALE

    def solve(rows, alpha):
        zc = z[rows] - z[rows].mean(0)
        w = np.linalg.solve(zc.T @ zc + alpha * np.eye(v), zc.T @ (y[rows] - y[rows].mean(0)))
        return w, y[rows].mean(0) - z[rows].mean(0) @ w

    pred = np.empty_like(y)
    for f in np.unique(folds):
        inner = np.flatnonzero(folds != f)
        zc = z[inner] - z[inner].mean(0)
        k_scale = float((zc ** 2).sum()) / len(inner)
        gains = {}
        for r in RATIOS:
            loo = np.stack([z[i] @ w + b for i in inner
                            for w, b in [solve(inner[inner != i], r * k_scale)]])
            gains[r] = speed_gain(tau[inner], COSTS, loo.argmax(1), np.zeros(len(inner), int))
        best = max(RATIOS, key=lambda r: (round(gains[r], 12), r))
        w, b = solve(inner, best * k_scale)
        pred[folds == f] = z[folds == f] @ w + b
    return pred * SCALE


def _calibration_keys(cal):
    return {k: cal[k] for k in ("margin", "calibration_gain", "calibration_switched", "calibration_rows",
                                "calibration_gain_lower5", "rejected_margin") if k in cal}


def test_the_margin_is_calibrated_on_out_of_fold_predictions_not_on_those_that_chose_the_penalty():
    x, tau = _problem()
    folds = np.arange(len(x)) % 5
    _, info = fit_ridge(x, tau, COSTS, 0, SCALE, ratios=RATIOS, folds=folds)
    want_pred = _direct_outer(x, tau, folds)
    assert info["outer_predictions"] == pytest.approx(want_pred, abs=1e-8)
    want = calibrate_margin(want_pred.max(1) - want_pred[:, 0], want_pred.argmax(1), tau, COSTS, 0)
    assert _calibration_keys(info["calibration"]) == pytest.approx(_calibration_keys(want))
    assert info["calibration"]["on"].startswith("out-of-fold") and len(info["calibration"]["fold_ratios"]) == 5
    # What the test tells apart: calibrated on the leave-one-out predictions that chose the penalty, the result
    # is another one.
    loo = info["loo_predictions"]
    same = calibrate_margin(loo.max(1) - loo[:, 0], loo.argmax(1), tau, COSTS, 0)
    assert _calibration_keys(same) != pytest.approx(_calibration_keys(want))


def test_the_default_folds_hash_the_logits_so_any_row_order_gives_the_same_margin():
    x, tau = _problem(1, n=60)
    folds = row_folds(x)
    assert set(folds) == set(range(5)) and np.array_equal(row_folds(x.astype(np.float32)), folds)
    _, info = fit_ridge(x, tau, COSTS, 0, SCALE, ratios=RATIOS)
    perm = np.random.default_rng(2).permutation(len(x))
    _, again = fit_ridge(x[perm], tau[perm], COSTS, 0, SCALE, ratios=RATIOS)
    assert np.array_equal(row_folds(x[perm]), folds[perm])
    assert again["outer_predictions"] == pytest.approx(info["outer_predictions"][perm], abs=1e-8)
    assert _calibration_keys(again["calibration"]) == pytest.approx(_calibration_keys(info["calibration"]))


def test_the_penalty_grid_scales_with_the_kernel_features_repeated_4x_choose_the_same_ratio():
    x, tau = _problem(3, n=60)
    folds = row_folds(x)  # the hash of the wider rows deals other folds
    _, one = fit_ridge(x, tau, COSTS, 0, SCALE, folds=folds)
    _, four = fit_ridge(np.hstack([x] * 4), tau, COSTS, 0, SCALE, folds=folds)
    # K is 4x as large, so is every alpha; the fits, their choices and their gains are the same ones.
    assert four["kernel_scale"] == pytest.approx(4 * one["kernel_scale"])
    assert four["ratio"] == one["ratio"] and four["alpha"] == pytest.approx(4 * one["alpha"])
    assert four["loo_argmax_gain"] == pytest.approx(one["loo_argmax_gain"], abs=1e-12)
    assert four["outer_predictions"] == pytest.approx(one["outer_predictions"], abs=1e-8)
    assert [f["ratio"] for f in four["folds"]] == [f["ratio"] for f in one["folds"]]
    assert _calibration_keys(four["calibration"]) == pytest.approx(_calibration_keys(one["calibration"]))


def test_the_gram_matrix_streamed_in_float64_chunks_is_the_direct_one():
    x = np.random.default_rng(4).normal(3, 2, (20, 23)).astype(np.float32)
    mu, sd, k = _gram(x, chunk=5)
    x64 = x.astype(np.float64)
    z = (x64 - x64.mean(0)) / x64.std(0)
    assert mu == pytest.approx(x64.mean(0)) and sd == pytest.approx(x64.std(0))
    assert k == pytest.approx(z @ z.T, abs=1e-9)


def test_a_fit_above_cache_max_gb_is_refused_before_it_starts():
    # The default's shapes fit the default 4 GiB, at its own vocabulary and at Qwen's.
    assert peak_bytes(720, 4096) < 4 * 2**30 and peak_bytes(720, 151_936) < 4 * 2**30
    check_memory(720, 151_936, 4.0)
    with pytest.raises(ValueError, match=r"train\.cache_max_gb = 4.*train\.model=mlp"):
        check_memory(20_000, 151_936, 4.0)
    x, tau = _problem()
    with pytest.raises(ValueError, match=r"train\.cache_max_gb"):
        fit_ridge(x, tau, COSTS, 0, SCALE, max_gb=peak_bytes(*x.shape) / 2**30 / 2)
    fit_ridge(x, tau, COSTS, 0, SCALE, max_gb=peak_bytes(*x.shape) / 2**30)
