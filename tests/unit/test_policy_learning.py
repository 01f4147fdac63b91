"""The arithmetic of benchmarks/policy_learning.py: its ridge (dual form where features outnumber rows) is ridge
regression, and an action table's gain over its train-chosen fallback is the ratio of mean times per token."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.policy_learning import Problem, ridge  # noqa: E402


def test_ridge_dual_form_equals_the_primal_solution():
    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(20, 50)), rng.normal(size=(20, 3))
    fit = np.arange(20) < 15
    got = ridge(z, y, fit, alpha=2.0)  # 50 features > 15 rows: the dual form
    zf, yf = z[fit], y[fit]
    w = np.linalg.solve(zf.T @ zf + 2.0 * np.eye(50), zf.T @ (yf - yf.mean(axis=0)))
    assert np.allclose(got, z @ w + yf.mean(axis=0), atol=1e-8)
    narrow = ridge(z[:, :5], y, fit, alpha=2.0)  # 5 features: the primal form, the same solution
    w5 = np.linalg.solve(zf[:, :5].T @ zf[:, :5] + 2.0 * np.eye(5), zf[:, :5].T @ (yf - yf.mean(axis=0)))
    assert np.allclose(narrow, z[:, :5] @ w5 + yf.mean(axis=0), atol=1e-10)


def test_gain_over_the_train_chosen_fallback_is_the_ratio_of_mean_times():
    split = np.array(["train"] * 4 + ["calib"] * 2 + ["val"] * 4)
    # action 0 is fastest on the train rows (the fallback); action 1 is faster on the last two val rows.
    tpot = np.array([[1.0, 2.0]] * 6 + [[1.0, 2.0], [1.0, 2.0], [2.0, 1.0], [4.0, 1.0]])
    p = Problem({"tpot": tpot, "names": ["b=4", "threshold:0.01@10"], "split": split}, [0, 1])
    assert p.fallback == 0 and list(p.val) == [False] * 6 + [True] * 4
    chosen = np.array([0] * 8 + [1, 1])
    assert np.isclose(p.gain(chosen, p.val), (1 + 1 + 2 + 4) / (1 + 1 + 1 + 1) - 1)
    oracle = p.evaluate(np.eye(2)[tpot.argmin(axis=1)])
    assert np.isclose(oracle["oracle_gain"], 1.0) and oracle["gain"] <= oracle["oracle_gain"] + 1e-12
