"""A sequential verdict on a paired timing: add repeats until the interval says kept, dropped or tie.

tune's load check (pipeline.evaluation.load_check) times b*(c) against AR in lockstep, one pair per repeat, and
decides on the paired log ratios d_i = log(b_i / AR_i). A fixed 3 repeats (t = 4.30 at 2 degrees of freedom) could
not resolve a 5 % gain at the check's spread, so it served AR whatever the truth (issue #52). Here the repeats go on
while the answer is open:

- after each repeat from ``min_repeats`` on, the paired interval at level 1 - ``alpha`` (Student's t over the
  repeats so far);
- **kept**: its lower end is above 0 (b measured faster); **dropped**: its upper end is below 0 (measured slower);
- **tie**: its half-width is within ``tie`` (both ends within +-tie of the estimate: whatever the truth, it is small),
  or ``max_repeats`` were taken without a verdict. A tie serves the cheaper choice, no speculation.

Looking after every repeat is several tests, not one: at a true 0 a 95 % interval opened up to 8 times keeps b
about 7 % of the time (simulated). ``alpha`` is set per look so that the whole rule keeps a true 0 at most 5 % of
the time; :func:`simulate` is the rule's power at a given spread (tests/unit/test_load_verdict.py holds it to: a true
+5 % kept >= 80 %, a true -5 % dropped >= 95 %, a true 0 kept <= 5 %, at the check's measured spread).

Student's t quantile is computed here from its density (scipy is not in the stack): :func:`t_quantile`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

KEPT, DROPPED, TIE = "kept", "dropped", "tie"


def _t_cdf_from_0(x: float, df: int, n: int = 4000) -> float:
    """P(0 < T < x) for Student's t at ``df`` degrees of freedom, x >= 0 (Simpson's rule on the density)."""
    xs = np.linspace(0.0, x, n + 1)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = c * (1 + xs ** 2 / df) ** (-(df + 1) / 2)
    return float(x / n / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at p in (0.5, 1): bisection on the CDF (to 1e-6 of the tables at 1-30 df)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while 0.5 + _t_cdf_from_0(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 + _t_cdf_from_0(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SequentialRule:
    min_repeats: int = 3
    max_repeats: int = 10
    alpha: float = 0.02  # per look, two-sided; 0.05 over the whole rule at a true 0 (module docstring)
    tie: float = 0.02  # half-width (of the log ratio) within which the difference is called a tie

    def interval(self, d: Sequence[float]) -> Optional[Dict[str, float]]:
        """The paired interval over the log ratios ``d`` so far: mean, half-width, ends as gains (exp - 1)."""
        d = np.asarray(d, float)
        if len(d) < 2:
            return None
        half = t_quantile(1 - self.alpha / 2, len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
        m = float(d.mean())
        return {"gain": math.expm1(m), "ci": [math.expm1(m - half), math.expm1(m + half)], "half_width": half,
                "level": 1 - self.alpha, "repeats": int(len(d))}

    def verdict(self, d: Sequence[float], threshold: float = 0.0) -> Optional[str]:
        """kept / dropped / tie once the repeats so far settle it; None while another repeat is due. ``threshold``:
        the gain the interval is held against (tune.load_min_gain; 0: faster or slower than the other)."""
        if len(d) < self.min_repeats:
            return None
        iv = self.interval(d)
        if iv["ci"][0] > threshold:
            return KEPT
        if iv["ci"][1] < threshold:
            return DROPPED
        if iv["half_width"] <= self.tie or len(d) >= self.max_repeats:
            return TIE
        return None


def simulate(rule: SequentialRule, true_gain: float, sd: float, draws: int = 4000, seed: int = 0) -> Dict[str, float]:
    """The rule's verdict frequencies (and mean repeats) when each repeat's log ratio is normal around
    log(1 + true_gain) with standard deviation ``sd``."""
    rng = np.random.default_rng(seed)
    d = rng.normal(math.log1p(true_gain), sd, size=(draws, rule.max_repeats))
    counts = {KEPT: 0, DROPPED: 0, TIE: 0}
    reps = 0
    for row in d:
        for n in range(rule.min_repeats, rule.max_repeats + 1):
            v = rule.verdict(row[:n])
            if v:
                counts[v] += 1
                reps += n
                break
    return {**{k: v / draws for k, v in counts.items()}, "mean_repeats": reps / draws}


def fixed_rule_keeps(d: Sequence[float]) -> bool:
    """The rule before this module (kept when the 95 % interval over a fixed 3 repeats is above 0), for the power
    test's contrast."""
    iv = SequentialRule(min_repeats=len(d), max_repeats=len(d), alpha=0.05).interval(d)
    return iv is not None and iv["ci"][0] > 0


def simulate_fixed(true_gain: float, sd: float, repeats: int = 3, draws: int = 4000, seed: int = 0) -> float:
    """How often the fixed rule keeps b at ``true_gain`` and spread ``sd``."""
    rng = np.random.default_rng(seed)
    d = rng.normal(math.log1p(true_gain), sd, size=(draws, repeats))
    return float(np.mean([fixed_rule_keeps(row) for row in d]))


def log_ratios(a: Sequence[float], b: Sequence[float]) -> List[float]:
    """log(a_i / b_i) per repeat: the pairs the rule decides on."""
    return [math.log(x / y) for x, y in zip(a, b)]
