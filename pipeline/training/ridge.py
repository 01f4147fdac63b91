"""The ridge policy (``train.model=ridge``): closed-form ridge regression from the standardised logits to every
action's speed target (log speed ratio over the fallback b, divided by the target scale, as the MLP regresses it),
fitted on every row outside the val split, its penalty and fallback margin chosen on leave-one-out predictions of
those rows, exported as one linear layer on the raw logits.

Why ridge: on the label set's own val split it matched or beat the 12.6M-parameter MLP at every input and action
set tried, and the MLP memorises a few hundred rows (benchmarks/results/policy-learning.md).

Why leave-one-out: ridge's exact leave-one-out residuals come from the same eigendecomposition as the fit
(e_i / (1 - H_ii)), so the penalty and the margin are chosen on every non-val row (~720 on the default) instead of
a 15 % calibration split (~150), and the fit itself sees those rows too. On the default's labels this took the val
gain from +0.62 % to +1.06 % and its worst source from -0.50 % to -0.05 % (benchmarks/results/ridge-loo.md).

Why by hand: the dual-form solve and its hat matrix for the whole penalty grid are a dozen lines of numpy;
scikit-learn's RidgeCV does the same (its efficient LOO, ``cv=None``) but is not a dependency of the product.

The fit holds every row's logits in memory (the dual form: an N x N kernel), so it suits label sets up to about
``train.cache_max_gb`` of float32 logits; beyond that, train the MLP (``train.model=mlp``), which streams.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np
import torch

from pipeline.policy.blocksize import LinearPolicyModel, calibrate_margin, speed_gain, speed_targets

ALPHAS = (0.1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e5)


def fit_ridge(x: np.ndarray, tau: np.ndarray, costs: Sequence[float], fallback_index: int, scale: float,
              alphas: Sequence[float] = ALPHAS) -> Tuple[LinearPolicyModel, Dict[str, Any]]:
    """(the linear model, what was chosen) from the rows (x, tau): for every penalty the exact leave-one-out
    predictions; the penalty whose leave-one-out argmax gains most over the fallback (on a tie the stronger), then
    the fallback margin calibrated on its leave-one-out predicted gains (pipeline.policy.blocksize.calibrate_margin,
    ``info["calibration"]``; the predictions, log speed ratios [N, |A|], are ``info["loo_predictions"]``). Every column is standardised by the rows' mean and spread; both are folded into the
    exported weights, so the model reads the raw logits."""
    costs = np.asarray(costs, dtype=np.float64)
    tau = tau.astype(np.float64)
    n = len(x)
    x64 = x.astype(np.float64)
    mu, sd = x64.mean(axis=0), x64.std(axis=0).clip(1e-6)
    z = (x64 - mu) / sd
    y = speed_targets(tau, costs, fallback_index) / scale
    y_mu = y.mean(axis=0)
    # Dual form (rows < features): w = Z^T (K + a I)^-1 (y - mean); one eigendecomposition serves every a. The
    # columns of Z are centred, so K 1 = 0 and the intercept's hat term 1/n is orthogonal to the rest.
    evals, evecs = np.linalg.eigh(z @ z.T)
    evals = evals.clip(0)
    proj = evecs.T @ (y - y_mu)
    fb = np.full(n, fallback_index)
    scores, loo = {}, {}
    for a in alphas:
        loo[a] = _leave_one_out(evals, evecs, proj, y, a)
        scores[a] = speed_gain(tau, costs, loo[a].argmax(axis=1), fb)
    alpha = max(alphas, key=lambda a: (round(scores[a], 12), a))
    pred = loo[alpha] * scale  # log speed ratios, the units of the policy's predicted gain
    calibration = calibrate_margin(pred.max(axis=1) - pred[:, fallback_index], pred.argmax(axis=1), tau, costs,
                                   fallback_index)
    calibration["on"] = "leave-one-out predictions of every non-val row"
    w = z.T @ (evecs @ (proj / (evals + alpha)[:, None]))  # [V, |A|]
    train_loss = float(((z @ w + y_mu - y) ** 2).mean())  # the MLP's loss: MSE of the scaled targets
    w = w / sd[:, None]
    model = LinearPolicyModel(x.shape[1], y.shape[1])
    with torch.no_grad():
        model.input.weight.copy_(torch.from_numpy(w.T).float())
        model.input.bias.copy_(torch.from_numpy(y_mu - mu @ w).float())
    return model.eval(), {"alpha": alpha, "loo_argmax_gain": {str(a): scores[a] for a in alphas},
                          "calibration": calibration, "rows": int(n), "train_loss": train_loss,
                          "loo_predictions": pred}


def _leave_one_out(evals: np.ndarray, evecs: np.ndarray, proj: np.ndarray, y: np.ndarray, alpha: float
                   ) -> np.ndarray:
    """Exact leave-one-out predictions [N, |A|] of ridge with an unpenalised intercept, from the eigendecomposition
    of K = Z Z^T (Z column-centred) and ``proj`` = U^T (y - mean y): y_i - e_i / (1 - H_ii),
    H = 11^T / N + K (K + alpha I)^-1."""
    shrink = evals / (evals + alpha)
    fitted = evecs @ (proj * shrink[:, None]) + y.mean(axis=0)
    hat = (evecs ** 2) @ shrink + 1.0 / len(y)
    return y - (y - fitted) / (1.0 - hat).clip(1e-9)[:, None]


def leave_one_out(z: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """:func:`_leave_one_out` of column-centred features ``z`` [N, V] and targets ``y`` [N, |A|]."""
    evals, evecs = np.linalg.eigh(z @ z.T)
    return _leave_one_out(evals.clip(0), evecs, evecs.T @ (y - y.mean(axis=0)), y, alpha)
