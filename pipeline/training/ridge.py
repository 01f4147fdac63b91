"""The ridge policy (``train.model=ridge``): closed-form ridge regression from the standardised logits to every
action's speed target (log speed ratio over the fallback b, divided by the target scale, as the MLP regresses it),
fitted on every row outside the val split, its penalty chosen on leave-one-out predictions of those rows and its
fallback margin on out-of-fold predictions the penalty choice never saw, exported as one linear layer on the raw
logits.

Why ridge: on the label set's own val split it matched or beat the 12.6M-parameter MLP at every input and action
set tried, and the MLP memorises a few hundred rows (benchmarks/results/policy-learning.md).

Why leave-one-out for the penalty: ridge's exact leave-one-out residuals come from the same eigendecomposition as
the fit (e_i / (1 - H_ii)), so the penalty is chosen on every non-val row (~720 on the default) instead of a 15 %
calibration split (~150), and the fit itself sees those rows too (benchmarks/results/ridge-loo.md).

Why out-of-fold for the margin: the penalty is the one whose leave-one-out argmax gains most, so those predictions'
gain is a maximum over the grid and flatters them; a margin and a "lower 5 % bound > 0" check fitted on the same
predictions inherit that. So the rows are split into :data:`OUTER_FOLDS` folds by a hash of their logits (the same
folds in any row order); for each fold the penalty is chosen by leave-one-out on the other folds' rows alone, and
that fit predicts the fold. The margin is calibrated on these predictions (``info["outer_predictions"]``); the
exported model is still the fit on every row with the penalty chosen by leave-one-out on every row.

The penalty grid is relative: alpha = ratio x trace(K) / N for the centred kernel K = Z Z^T of the rows fitted. Z is
standardised, so trace(K) / N is about V, and one ratio grid (:data:`RATIOS`) sits around the chosen penalty at
V = 4,096 and at V = 151,936 alike; an absolute grid drifts off its end as V grows.

Memory: the Gram matrix is accumulated in float64 column chunks (:data:`CHUNK` columns) straight from the float32
logits, so no float64 copy of the logits exists; what remains is the logits the caller holds, the N x N kernels and
their eigenvectors. :func:`peak_bytes` estimates that and :func:`check_memory` refuses, before anything is
allocated, a fit above ``train.cache_max_gb`` (train calls it on the driver before Ray Train starts): beyond it,
train the MLP (``train.model=mlp``), which streams.

Why by hand: the dual-form solve and its hat matrix for the whole penalty grid are a dozen lines of numpy;
scikit-learn's RidgeCV does the same (its efficient LOO, ``cv=None``) but is not a dependency of the product.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from pipeline.policy.blocksize import LinearPolicyModel, calibrate_margin, speed_gain, speed_targets

# Penalty / (trace(K) / N). On the default (V = 4,096, so trace(K) / N is about 4,096) leave-one-out chose an
# alpha of 1000 (benchmarks/results/ridge-loo.md): a ratio of about 0.25, mid-grid.
RATIOS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
# An absolute grid: the one benchmarks/ridge_loo.py's calibration-split baseline (the fit train once did) searches.
ALPHAS = (0.1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e5)
OUTER_FOLDS = 5
CHUNK = 2048  # feature columns per float64 chunk of the Gram matrix and of the exported weights


def peak_bytes(n: int, v: int, chunk: int = CHUNK) -> int:
    """About the most memory a ridge fit of n rows x v logits holds in train's worker: the float32 logits twice
    (the gathered splits and their concatenation), one float64 column chunk and its standardised copy, and about six
    float64 N x N arrays (the kernel, a fold's kernels, the eigenvectors, their squares)."""
    return int(2 * 4 * n * v + 2 * 8 * n * min(chunk, v) + 6 * 8 * n * n)


def check_memory(n: int, v: int, max_gb: float) -> None:
    """Raise (before anything is allocated) when :func:`peak_bytes` of the fit is above ``max_gb`` GiB."""
    need = peak_bytes(n, v)
    if need > max_gb * 2**30:
        raise ValueError(f"the ridge fit of {n} rows x {v} logits needs about {need / 2**30:.1f} GiB (the float32 "
                         f"logits twice and the float64 N x N kernels), above train.cache_max_gb = {max_gb:g}: "
                         "train the MLP instead (train.model=mlp streams its rows), or raise train.cache_max_gb "
                         "if the train workers have the memory")


def row_folds(x: np.ndarray, k: int = OUTER_FOLDS) -> np.ndarray:
    """Fold per row in 0..k-1 from a CRC-32 of its logits as float32: the same folds in any row order and for a
    float64 copy of float32 logits; identical rows share a fold. When the hash leaves fewer than two folds (a few
    identical rows), the row order's i mod k."""
    folds = np.array([zlib.crc32(np.ascontiguousarray(r, dtype=np.float32).tobytes()) % k for r in x], dtype=int)
    return folds if len(np.unique(folds)) >= 2 else np.arange(len(x)) % k


def fit_ridge(x: np.ndarray, tau: np.ndarray, costs: Sequence[float], fallback_index: int, scale: float,
              ratios: Sequence[float] = RATIOS, folds: Optional[np.ndarray] = None, max_gb: Optional[float] = None
              ) -> Tuple[LinearPolicyModel, Dict[str, Any]]:
    """(the linear model, what was chosen) from the rows (x, tau). The penalty: the ratio whose exact leave-one-out
    argmax gains most over the fallback (on a tie the stronger); ``info["loo_predictions"]`` are its leave-one-out
    predictions (log speed ratios [N, |A|]). The margin: pipeline.policy.blocksize.calibrate_margin on
    ``info["outer_predictions"]``, each fold's rows predicted by the fit on the other folds with the ratio their
    own leave-one-out chose (``folds``: a fold per row, default :func:`row_folds`); ``info["calibration"]``. Every
    column is standardised by all the rows' mean and spread (no target enters it); both are folded into the
    exported weights, so the model reads the raw logits. ``max_gb``: :func:`check_memory` first."""
    n, v = x.shape
    if max_gb is not None:
        check_memory(n, v, max_gb)
    costs = np.asarray(costs, dtype=np.float64)
    tau = tau.astype(np.float64)
    ratios = [float(r) for r in ratios]
    mu, sd, kernel = _gram(x)
    y = speed_targets(tau, costs, fallback_index) / scale
    full = _choose(kernel, y, tau, costs, fallback_index, ratios)
    folds = row_folds(x) if folds is None else np.asarray(folds)
    outer, per_fold = _outer_predictions(kernel, y, tau, costs, fallback_index, ratios, folds)
    outer = outer * scale  # log speed ratios, the units of the policy's predicted gain
    calibration = calibrate_margin(outer.max(axis=1) - outer[:, fallback_index], outer.argmax(axis=1), tau, costs,
                                   fallback_index)
    calibration["on"] = (f"out-of-fold predictions of every non-val row ({len(per_fold)} folds by a hash of the "
                         "logits, each fold's penalty chosen by leave-one-out on the other folds alone)")
    calibration["fold_ratios"] = [f["ratio"] for f in per_fold]
    y_mu = y.mean(axis=0)
    coef = full["evecs"] @ (full["proj"] / (full["evals"] + full["alpha"])[:, None])  # w = Z^T coef, Z w = K coef
    train_loss = float(((kernel @ coef + y_mu - y) ** 2).mean())  # the MLP's loss: MSE of the scaled targets
    w = np.empty((v, y.shape[1]))
    for lo in range(0, v, CHUNK):
        cols = slice(lo, lo + CHUNK)
        w[cols] = ((x[:, cols].astype(np.float64) - mu[cols]) / sd[cols]).T @ coef
    w /= sd[:, None]
    model = LinearPolicyModel(v, y.shape[1])
    with torch.no_grad():
        model.input.weight.copy_(torch.from_numpy(w.T).float())
        model.input.bias.copy_(torch.from_numpy(y_mu - mu @ w).float())
    return model.eval(), {"ratio": full["ratio"], "alpha": full["alpha"], "kernel_scale": full["kernel_scale"],
                          "ratios": ratios, "loo_argmax_gain": {str(r): full["scores"][r] for r in ratios},
                          "calibration": calibration, "folds": per_fold, "rows": int(n), "train_loss": train_loss,
                          "loo_predictions": full["loo"] * scale, "outer_predictions": outer}


def _gram(x: np.ndarray, chunk: int = CHUNK) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(column means, column spreads, K = Z Z^T) of the standardised columns Z = (x - mean) / spread, accumulated in
    float64 over column chunks of ``chunk`` so that no float64 copy of x exists."""
    n, v = x.shape
    mu, sd, kernel = np.empty(v), np.empty(v), np.zeros((n, n))
    for lo in range(0, v, chunk):
        cols = slice(lo, lo + chunk)
        c = x[:, cols].astype(np.float64)
        mu[cols], sd[cols] = c.mean(axis=0), c.std(axis=0).clip(1e-6)
        c -= mu[cols]
        c /= sd[cols]
        kernel += c @ c.T
    return mu, sd, kernel


def _choose(kernel: np.ndarray, y: np.ndarray, tau: np.ndarray, costs: np.ndarray, fallback_index: int,
            ratios: Sequence[float]) -> Dict[str, Any]:
    """The penalty leave-one-out chooses on the rows of a centred kernel: every ratio's leave-one-out predictions and
    argmax gain, the best ratio (on a tie the stronger), its absolute alpha, and the eigensystem to fit with."""
    evals, evecs = np.linalg.eigh(kernel)
    evals = evals.clip(0)
    kernel_scale = max(float(np.trace(kernel)) / len(y), 1e-12)
    proj = evecs.T @ (y - y.mean(axis=0))
    fb = np.full(len(y), fallback_index)
    loo, scores = {}, {}
    for r in ratios:
        loo[r] = _leave_one_out(evals, evecs, proj, y, r * kernel_scale)
        scores[r] = speed_gain(tau, costs, loo[r].argmax(axis=1), fb)
    ratio = max(ratios, key=lambda r: (round(scores[r], 12), r))
    return {"ratio": ratio, "alpha": ratio * kernel_scale, "kernel_scale": kernel_scale, "scores": scores,
            "loo": loo[ratio], "evals": evals, "evecs": evecs, "proj": proj}


def _outer_predictions(kernel: np.ndarray, y: np.ndarray, tau: np.ndarray, costs: np.ndarray, fallback_index: int,
                       ratios: Sequence[float], folds: np.ndarray) -> Tuple[np.ndarray, list]:
    """(predictions [N, |A|] in target units, one {fold, rows, ratio, alpha} per fold): each fold's rows predicted by
    ridge on the other rows, its penalty chosen by :func:`_choose` on those rows alone. The other rows' columns are
    centred on their own mean (the intercept is theirs), which the kernel of all rows gives without Z: for rows I
    and J, (z_i - m)(z_j - m)^T = K_ij - mean_k K_ik - mean_k K_kj + mean_kl K_kl, k and l over the fitted rows."""
    pred = np.zeros_like(y)
    per_fold = []
    for f in np.unique(folds):
        out, inner = folds == f, folds != f
        if inner.sum() < 2:  # nothing to learn from: predict no gain (the fallback)
            per_fold.append({"fold": int(f), "rows": int(out.sum()), "ratio": None, "alpha": None})
            continue
        k_in, k_out = kernel[np.ix_(inner, inner)], kernel[np.ix_(out, inner)]
        col_mean, grand = k_in.mean(axis=0), k_in.mean()
        k_in = k_in - k_in.mean(axis=1, keepdims=True) - col_mean[None, :] + grand
        k_out = k_out - k_out.mean(axis=1, keepdims=True) - col_mean[None, :] + grand
        c = _choose(k_in, y[inner], tau[inner], costs, fallback_index, ratios)
        coef = c["evecs"] @ (c["proj"] / (c["evals"] + c["alpha"])[:, None])
        pred[out] = k_out @ coef + y[inner].mean(axis=0)
        per_fold.append({"fold": int(f), "rows": int(out.sum()), "ratio": c["ratio"], "alpha": c["alpha"]})
    return pred, per_fold


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
