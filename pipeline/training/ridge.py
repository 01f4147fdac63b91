"""The ridge policy (``train.model=ridge``): closed-form ridge regression from the standardised logits to every
action's speed target (log speed ratio over the fallback b, divided by the target scale, as the MLP regresses it),
with the penalty chosen on the calibration split, exported as one linear layer on the raw logits.

Why ridge: on the label set's own val split it matched or beat the 12.6M-parameter MLP at every input and action
set tried, and the MLP memorises a few hundred rows (benchmarks/results/policy-learning.md). Why by hand: the
dual-form solve with one eigendecomposition for the whole penalty grid is ten lines of numpy; scikit-learn's
RidgeCV does the same (and is not a dependency of the product).

The fit holds every train row's logits in memory (the dual form: an N x N kernel), so it suits label sets up to
about ``train.cache_max_gb`` of float32 logits; beyond that, train the MLP (``train.model=mlp``), which streams.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np
import torch

from pipeline.policy.blocksize import LinearPolicyModel, speed_gain, speed_targets

ALPHAS = (0.1, 1.0, 10.0, 100.0, 1e3, 1e4)


def fit_ridge(x: np.ndarray, tau: np.ndarray, x_calib: np.ndarray, tau_calib: np.ndarray, costs: Sequence[float],
              fallback_index: int, scale: float, alphas: Sequence[float] = ALPHAS
              ) -> Tuple[LinearPolicyModel, Dict[str, Any]]:
    """(the linear model, what was chosen): fitted on (x, tau), its penalty the one whose raw argmax gains most over
    the fallback on the calibration rows (on a tie the stronger). Every column is standardised by the train rows'
    mean and spread; both are folded into the exported weights, so the model reads the raw logits."""
    costs = np.asarray(costs, dtype=np.float64)
    x64 = x.astype(np.float64)
    mu, sd = x64.mean(axis=0), x64.std(axis=0).clip(1e-6)
    z = (x64 - mu) / sd
    y = speed_targets(tau.astype(np.float64), costs, fallback_index) / scale
    y_mu = y.mean(axis=0)
    # Dual form (rows < features): w = Z^T (K + a I)^-1 (y - mean); one eigendecomposition serves every a.
    evals, evecs = np.linalg.eigh(z @ z.T)
    proj = evecs.T @ (y - y_mu)
    zc = (x_calib.astype(np.float64) - mu) / sd
    fb = np.full(len(x_calib), fallback_index)
    scores, weights = {}, {}
    for a in alphas:
        w = z.T @ (evecs @ (proj / (evals.clip(0) + a)[:, None]))  # [V, |A|]
        weights[a] = w
        pred = zc @ w + y_mu
        scores[a] = speed_gain(tau_calib, costs, pred.argmax(axis=1), fb) if len(x_calib) else 0.0
    alpha = max(alphas, key=lambda a: (round(scores[a], 12), a))
    train_loss = float(((z @ weights[alpha] + y_mu - y) ** 2).mean())  # the MLP's loss: MSE of the scaled targets
    w = weights[alpha] / sd[:, None]
    model = LinearPolicyModel(x.shape[1], y.shape[1])
    with torch.no_grad():
        model.input.weight.copy_(torch.from_numpy(w.T).float())
        model.input.bias.copy_(torch.from_numpy(y_mu - mu @ w).float())
    return model.eval(), {"alpha": alpha, "calibration_argmax_gain": {str(a): scores[a] for a in alphas},
                          "train_rows": int(len(x)), "train_loss": train_loss}
