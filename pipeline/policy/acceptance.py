"""A learned acceptance model: the chance that the target accepts each drafted slot, from the draft's own numbers.

The per-step trace (pipeline.policy.trace) records, at every start along the target's greedy continuation, the
draft's top-1 probability of each drafted slot and how many of them the target accepted. :func:`fit_acceptance`
fits a logistic *hazard* on it: q_j = P(slot j accepted | slots 1..j-1 accepted), from features the draft side
knows before the verify (:data:`FEATURES`): the slot's log confidence, the log of the cumulative product up to it
(the threshold rule's whole input), its position, and the previous step's accepted count. The survival of a
prefix of k slots is then S_k = q_1 ... q_k, and a verify of k slots commits 1 + S_1 + ... + S_k tokens in
expectation (the accepted prefix plus the target's own token at the cut): what
pipeline.policy.step_rules.LearnedVerify trades against the modelled seconds of each k.

Samples come from the steps plain decoding at b_max visits (the Full rule's path, simulated): each step gives its
accepted slots (y = 1) and the first rejected one (y = 0); slots past a rejection carry no information about the
hazard. :func:`reliability` is the calibration check: predicted against observed acceptance per decile.

The fit is a few Newton steps of L2-regularised logistic regression in numpy on standardised features (about 10^5
samples x 6 features on the default): written out here because sklearn is not one of the product's packages and the
model must serialise to plain JSON (weights, means and scales), never pickle. Pure numpy, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.policy.trace import Trace

FORMAT = "blockpilot.acceptance_model"
FORMAT_VERSION = 1
FEATURES = ("log_confidence", "log_cumulative_confidence", "position", "log_position", "previous_accepted",
            "first_step")
_FLOOR = 1e-6  # confidences are clipped here before the log (a float32 softmax can round to 0)


def slot_features(conf: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """[L, W, F] features of every slot of L steps: ``conf`` [L, W] the draft's top-1 probabilities (zero-padded
    past each step's width), ``prev`` [L] the previous step's accepted drafted tokens (committed - 1), -1 on a
    decode's first step. Elementwise float64 only, so one step alone and the same step in a batch give the same
    bits (the rule's choice in the engine equals the simulator's)."""
    conf = np.asarray(conf, dtype=np.float64)
    L, W = conf.shape
    logc = np.log(np.maximum(conf, _FLOOR))
    pos = np.broadcast_to(np.arange(1, W + 1, dtype=np.float64), (L, W))
    prev = np.asarray(prev, dtype=np.float64)[:, None]
    first = (prev < 0).astype(np.float64)
    return np.stack([logc, np.cumsum(logc, axis=1), pos, np.log(pos), np.broadcast_to(np.maximum(prev, 0), (L, W)),
                     np.broadcast_to(first, (L, W))], axis=-1)


@dataclass(frozen=True)
class AcceptanceModel:
    """q_j = sigmoid(intercept + sum_f weight_f (x_f - mean_f) / scale_f) over :data:`FEATURES`."""

    intercept: float
    weights: Tuple[float, ...]
    means: Tuple[float, ...]
    scales: Tuple[float, ...]
    features: Tuple[str, ...] = FEATURES
    block_size: int = 0  # the b_max its traces were drafted at
    info: Tuple[Tuple[str, Any], ...] = ()  # how it was fitted (samples, log loss), for the record
    # Isotonic recalibration of the logistic's q (knots: raw q -> observed rate, fitted on the same train split):
    # the logistic alone is off by up to 9 points per decile on the default (benchmarks/results/
    # acceptance-calibration.md); empty = none.
    calibration_x: Tuple[float, ...] = ()
    calibration_y: Tuple[float, ...] = ()

    def hazard(self, conf: np.ndarray, prev: np.ndarray) -> np.ndarray:
        """[L, W] q_j of every slot (see :func:`slot_features` for the inputs). The linear score folded into
        per-position constants (a rule calls this once per decode step, so its cost is the rule's own per-step
        cost): z = a log c_j + b sum_{i <= j} log c_i + pos_j + prev term, elementwise float64, the same bits for one
        step alone as in a batch."""
        conf = np.asarray(conf, dtype=np.float64)
        a, b, by_pos, p_w, p_first, p_c = self._folded(conf.shape[1])
        logc = np.log(np.maximum(conf, _FLOOR))
        prev = np.asarray(prev, dtype=np.float64)
        z = a * logc + b * np.cumsum(logc, axis=1) + by_pos[None, :] + \
            (np.where(prev < 0, p_first, p_w * np.maximum(prev, 0)) + p_c)[:, None]
        return self.calibrate(1.0 / (1.0 + np.exp(-z)))

    def calibrate(self, q: np.ndarray) -> np.ndarray:
        """The isotonic map of raw q (elementwise: np.interp over the knots), or q itself without one."""
        if not self.calibration_x:
            return q
        return np.interp(q, self._knots[0], self._knots[1])

    @cached_property
    def _knots(self):
        return np.asarray(self.calibration_x), np.asarray(self.calibration_y)

    def raw_probability(self, x: np.ndarray) -> np.ndarray:
        """The logistic's q of feature rows x [N, F] (before the recalibration)."""
        z = self.intercept + ((x - np.array(self.means)) / np.array(self.scales)) @ np.array(self.weights)
        return 1.0 / (1.0 + np.exp(-z))

    def probability(self, x: np.ndarray) -> np.ndarray:
        """Calibrated q of feature rows x [N, F]."""
        return self.calibrate(self.raw_probability(x))

    def _folded(self, W: int):
        """(a, b, by_pos [W], prev weight, first-step term, constant): the standardised weights over FEATURES
        (log_confidence, log_cumulative_confidence, position, log_position, previous_accepted, first_step)."""
        key = f"_folded_{W}"
        if key not in self.__dict__:
            w = np.asarray(self.weights) / np.asarray(self.scales)
            const = self.intercept - float(np.dot(w, self.means))
            pos = np.arange(1, W + 1, dtype=np.float64)
            object.__setattr__(self, key, (w[0], w[1], w[2] * pos + w[3] * np.log(pos), w[4], w[5], const))
        return self.__dict__[key]

    def expected_committed(self, conf: np.ndarray, prev: np.ndarray, width: Optional[np.ndarray] = None
                           ) -> np.ndarray:
        """[L, W] expected tokens a verify of k = 1..W slots commits: 1 + S_1 + ... + S_k (0 past a step's width)."""
        q = self.hazard(conf, prev)
        W = q.shape[1]
        mask = np.arange(W)[None, :] < (np.asarray(width)[:, None] if width is not None else W)
        s = np.cumprod(np.where(mask, q, 0.0), axis=1)
        return np.where(mask, 1.0 + np.cumsum(s, axis=1), 0.0)

    def to_dict(self) -> Dict[str, Any]:
        return {"format": FORMAT, "version": FORMAT_VERSION, "features": list(self.features),
                "intercept": self.intercept, "weights": list(self.weights), "means": list(self.means),
                "scales": list(self.scales), "block_size": self.block_size, "info": dict(self.info),
                "calibration": {"raw": list(self.calibration_x), "calibrated": list(self.calibration_y)}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "AcceptanceModel":
        if d.get("format") != FORMAT:
            raise ValueError(f"not an acceptance model (format {d.get('format')!r}, expected {FORMAT!r})")
        if int(d.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"acceptance model version {d['version']} is newer than this reader ({FORMAT_VERSION})")
        if tuple(d["features"]) != FEATURES:
            raise ValueError(f"acceptance model features {d['features']} are not this reader's {list(FEATURES)}")
        cal = d.get("calibration") or {}
        return cls(float(d["intercept"]), tuple(map(float, d["weights"])), tuple(map(float, d["means"])),
                   tuple(map(float, d["scales"])), FEATURES, int(d.get("block_size", 0)),
                   tuple(sorted((d.get("info") or {}).items())), tuple(map(float, cal.get("raw", ()))),
                   tuple(map(float, cal.get("calibrated", ()))))


def full_path_steps(trace: Trace) -> List[Tuple[int, int]]:
    """(offset, previous accepted or -1) of every step plain decoding at the trace's b_max takes."""
    out, i, prev, end = [], 0, -1, trace.new_tokens - 1
    while i < end:
        w = len(trace.confidence[i])
        if not w:
            break  # undraftable: the engine fails here (pipeline.policy.simulate); nothing to learn past it
        produced = min(min(trace.match[i], w) + 1, end - i)
        out.append((i, prev))
        prev, i = produced - 1, i + produced
    return out


def acceptance_samples(traces: Sequence[Trace]) -> Tuple[np.ndarray, np.ndarray]:
    """(X [N, F], y [N]) of the hazard: every accepted slot and the first rejected one of each step on the Full
    path."""
    xs, ys = [], []
    for t in traces:
        steps = full_path_steps(t)
        if not steps:
            continue
        W = max(len(t.confidence[i]) for i, _ in steps)
        conf = np.zeros((len(steps), W))
        for r, (i, _) in enumerate(steps):
            conf[r, :len(t.confidence[i])] = t.confidence[i]
        x = slot_features(conf, np.array([p for _, p in steps]))
        for r, (i, _) in enumerate(steps):
            m, w = t.match[i], len(t.confidence[i])
            n = min(m + 1, w)  # slots 1..m accepted, slot m + 1 rejected (when it exists)
            xs.append(x[r, :n])
            ys.append((np.arange(1, n + 1) <= m).astype(np.float64))
    if not xs:
        return np.zeros((0, len(FEATURES))), np.zeros(0)
    return np.concatenate(xs), np.concatenate(ys)


def _newton(x: np.ndarray, y: np.ndarray, l2: float, iters: int = 50) -> np.ndarray:
    """L2-regularised logistic regression (intercept unpenalised) by Newton's method; [1 + F] coefficients."""
    X = np.hstack([np.ones((len(x), 1)), x])
    beta = np.zeros(X.shape[1])
    reg = np.full(X.shape[1], l2)
    reg[0] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(X @ beta)))
        grad = X.T @ (p - y) + reg * beta
        hess = (X * (p * (1 - p))[:, None]).T @ X + np.diag(reg) + 1e-9 * np.eye(X.shape[1])
        step = np.linalg.solve(hess, grad)
        beta -= step
        if np.max(np.abs(step)) < 1e-8:
            break
    return beta


def isotonic_knots(p: np.ndarray, y: np.ndarray, bins: int = 50) -> Tuple[np.ndarray, np.ndarray]:
    """Knots of a monotone map p -> P(y = 1): ``bins`` equal-count bins of p, then pool-adjacent-violators over
    their observed rates (written here rather than taken from sklearn, which is not one of the product's
    packages)."""
    order = np.argsort(p, kind="stable")
    groups = [g for g in np.array_split(order, bins) if len(g)]
    blocks = [[float(p[g].sum()), float(y[g].sum()), float(len(g))] for g in groups]  # sums of p, y, count
    out: List[List[float]] = []
    for blk in blocks:
        out.append(blk)
        while len(out) > 1 and out[-2][1] / out[-2][2] > out[-1][1] / out[-1][2]:  # a violator: pool the two
            last = out.pop()
            out[-1] = [out[-1][0] + last[0], out[-1][1] + last[1], out[-1][2] + last[2]]
    return np.array([b[0] / b[2] for b in out]), np.array([b[1] / b[2] for b in out])


def log_loss(model: AcceptanceModel, x: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(model.probability(x), 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))) if len(y) else float("nan")


def fit_acceptance(traces: Sequence[Trace], l2: float = 1.0, calibrate: bool = True) -> AcceptanceModel:
    """The hazard model fitted on ``traces`` (the label set's train split), then recalibrated on the same samples
    (:func:`isotonic_knots`); ValueError when they hold no step."""
    x, y = acceptance_samples(traces)
    if not len(y):
        raise ValueError("no trace step to fit the acceptance model on (the label set has no traces?)")
    if y.min() == y.max():
        raise ValueError(f"every one of the {len(y)} trace slots was {'accepted' if y[0] else 'rejected'}: "
                         "nothing to learn an acceptance model from")
    means, scales = x.mean(axis=0), x.std(axis=0)
    scales[scales == 0] = 1.0  # a constant feature (one b_max, no first step...) keeps weight 0
    beta = _newton((x - means) / scales, y, l2)
    block = max((t.block_size for t in traces), default=0)
    raw = AcceptanceModel(float(beta[0]), tuple(map(float, beta[1:])), tuple(map(float, means)),
                          tuple(map(float, scales)), FEATURES, int(block))
    kx, ky = isotonic_knots(raw.raw_probability(x), y) if calibrate else ((), ())
    model = AcceptanceModel(raw.intercept, raw.weights, raw.means, raw.scales, FEATURES, raw.block_size, (),
                            tuple(map(float, kx)), tuple(map(float, ky)))
    info = {"samples": int(len(y)), "accepted_share": float(y.mean()), "l2": l2, "traces": len(traces),
            "train_log_loss": log_loss(model, x, y), "train_log_loss_uncalibrated": log_loss(raw, x, y),
            "calibration_knots": len(kx)}
    return AcceptanceModel(model.intercept, model.weights, model.means, model.scales, FEATURES, model.block_size,
                           tuple(sorted(info.items())), model.calibration_x, model.calibration_y)


def reliability(model: AcceptanceModel, traces: Sequence[Trace], bins: int = 10) -> Dict[str, Any]:
    """Calibration on held-out traces: the slots (as :func:`acceptance_samples`) in ``bins`` equal-count bins of
    predicted q, each with its mean prediction, the observed acceptance rate and the count; plus the log loss
    and that of the constant (base-rate) predictor."""
    x, y = acceptance_samples(traces)
    if not len(y):
        return {"samples": 0, "table": []}
    p = model.probability(x)
    order = np.argsort(p, kind="stable")
    table = []
    for d, idx in enumerate(np.array_split(order, bins)):
        if len(idx):
            table.append({"decile": d + 1, "predicted": float(p[idx].mean()), "observed": float(y[idx].mean()),
                          "slots": int(len(idx)), "p_min": float(p[idx].min()), "p_max": float(p[idx].max())})
    base = float(np.clip(y.mean(), 1e-12, 1 - 1e-12))
    return {"samples": int(len(y)), "log_loss": log_loss(model, x, y),
            "base_rate_log_loss": float(-(base * np.log(base) + (1 - base) * np.log(1 - base))),
            "max_abs_gap": float(max(abs(r["predicted"] - r["observed"]) for r in table)), "table": table}

