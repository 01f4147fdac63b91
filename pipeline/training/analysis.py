"""The held-out analyses of a speed policy: the fallback margin calibrated on the calibration rows (the ridge
policy brings its own, from leave-one-out predictions), then on the val rows (never seen by the fit nor the
calibration) the modelled gain over the fallback b, and the share of the
oracle's gain, of the policy's raw argmax, the policy with its fallback (the exported policy: MLP or ridge), a ridge
regression on principal components of the logits with the same calibrated fallback, and a perfect predictor of the
paper's label (over the block sizes: the rule actions have none).
Also the val metrics of modelled speed the epoch loop logs."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from pipeline.policy.blocksize import calibrate_margin, speed_gain, speed_targets, transform_inputs
from pipeline.policy.labels import speed_label, tau_label

from .data import Splits

RIDGE_COMPONENTS = 32
RIDGE_ALPHA = 10.0


def val_speed_metrics(tau: np.ndarray, costs: np.ndarray, chosen: np.ndarray, fixed_index: int) -> Dict[str, float]:
    """Modelled speed over the train-chosen fixed b of ``chosen`` (the raw argmax, no fallback) and of the oracle
    (the speed label)."""
    fixed = np.full(len(tau), fixed_index)
    return {"speed_gain_policy": speed_gain(tau, costs, chosen, fixed),
            "speed_gain_oracle": speed_gain(tau, costs, np.asarray(speed_label(tau, costs)), fixed)}


def mlp_predictions(model, x: np.ndarray, input_transform: str, scale: float) -> np.ndarray:
    """The speed policy's (MLP or ridge) predicted log speed ratios over the fallback [N, |A|] (its outputs times
    ``scale``)."""
    model.eval()
    with torch.no_grad():
        s = model(transform_inputs(torch.from_numpy(x), input_transform)).numpy().astype(np.float64)
    return s * scale


def ridge_predictions(x: np.ndarray, target: np.ndarray, train: np.ndarray, components: int = RIDGE_COMPONENTS,
                      alpha: float = RIDGE_ALPHA) -> np.ndarray:
    """The linear baseline: ``components`` principal components of the train rows' logits (standardised, plus a
    constant) -> every candidate's target, by ridge regression fitted on the train rows; predicted for every row."""
    mu = x[train].mean(axis=0)
    _, _, vt = np.linalg.svd(x[train] - mu, full_matrices=False)
    z = (x - mu) @ vt[:components].T
    z /= z[train].std(axis=0).clip(1e-6)
    zt = np.c_[z, np.ones(len(z))]
    w = np.linalg.solve(zt[train].T @ zt[train] + alpha * np.eye(zt.shape[1]), zt[train].T @ target[train])
    return zt @ w


def with_fallback(pred: np.ndarray, calib: np.ndarray, tau: np.ndarray, costs: np.ndarray,
                  fallback_index: int) -> Tuple[np.ndarray, np.ndarray, Dict[str, Any]]:
    """(raw argmax, the choice with the calibrated fallback, the calibration) of predicted log speed ratios: switch
    from the fallback only where the predicted gain exceeds the margin calibrated on the ``calib`` rows."""
    best = pred.argmax(axis=1)
    gain = pred.max(axis=1) - pred[:, fallback_index]
    cal = calibrate_margin(gain[calib], best[calib], tau[calib], costs, fallback_index)
    return best, apply_margin(pred, cal["margin"], fallback_index), cal


def apply_margin(pred: np.ndarray, margin: Optional[float], fallback_index: int) -> np.ndarray:
    """The choice per row of predicted log speed ratios: the argmax where its gain over the fallback exceeds
    ``margin``, else the fallback (always the fallback when ``margin`` is None)."""
    if margin is None:
        return np.full(len(pred), fallback_index)
    return np.where(pred.max(axis=1) - pred[:, fallback_index] > margin, pred.argmax(axis=1), fallback_index)


def held_out(model, input_transform: str, x: np.ndarray, splits: Splits, costs: np.ndarray, fallback_index: int,
             scale: float, n_candidates: Optional[int] = None,
             calibration: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The analyses of the module docstring; ``x`` every row's logits, in the order of ``splits``. ``calibration``:
    the policy's margin as its fit chose it (the ridge fit, on leave-one-out predictions: it saw the calibration
    rows, so they cannot calibrate it again); None = calibrate it on the calibration rows."""
    tau = splits.tau
    target = speed_targets(tau.astype(np.float64), costs, fallback_index)
    out: Dict[str, Any] = {}
    policies: Dict[str, np.ndarray] = {}
    for name, pred in (("policy", mlp_predictions(model, x, input_transform, scale)),
                       ("pca_ridge", ridge_predictions(x, target, splits.train))):
        if name == "policy" and calibration is not None:
            cal = calibration
            best, chosen = pred.argmax(axis=1), apply_margin(pred, cal["margin"], fallback_index)
        else:
            best, chosen, cal = with_fallback(pred, splits.calib, tau, costs, fallback_index)
        policies[f"{name}_argmax"] = best
        policies[f"{name}_with_fallback"] = chosen
        out["calibration" if name == "policy" else "pca_ridge_calibration"] = cal
    policies["paper_label_perfect"] = np.asarray(tau_label(tau[:, :n_candidates]))
    policies["oracle"] = oracle = np.asarray(speed_label(tau, costs))
    va = splits.val
    fb = np.full(len(tau), fallback_index)
    n_val = int(va.sum())
    oracle_gain = speed_gain(tau[va], costs, oracle[va], fb[va]) if n_val else 0.0
    out["val_rows"] = n_val
    out["val"] = {}
    for name, chosen in policies.items():
        g = speed_gain(tau[va], costs, chosen[va], fb[va]) if n_val else 0.0
        out["val"][name] = {"gain": g, "oracle_gain_captured": g / oracle_gain if oracle_gain > 0 else None,
                            "switched": int((chosen[va] != fb[va]).sum())}
    return out
