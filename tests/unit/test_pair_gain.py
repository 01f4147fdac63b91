"""evaluate's adaptive-vs-rule comparison (pipeline.evaluation.headline.pair_gain): its estimate is the estimator
its interval resamples, the ratio of mean times per token per set (evaluate's speedup); the intervals against a case
worked out by hand."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pipeline.evaluation.headline import pair_gain
from pipeline.evaluation.results import MODELLED_TPOT

# One set's modelled ms per output token of a default run (code-eval, 16 prompts): per-prompt speedups from 0.7x to
# 4.2x. The mean of per-prompt speedup ratios (+2.7 %) lies outside the interval of the ratio of means.
AR = [3.177, 3.1767, 3.1767, 3.1767, 3.1767, 3.1769, 3.1767, 3.1769, 3.1767, 3.1769, 3.177, 3.1767, 3.1768, 3.1768,
      3.1769, 3.1767]
ADAPTIVE = [2.709, 4.4003, 0.7624, 3.3792, 3.881, 1.8667, 1.1865, 2.0948, 2.1401, 3.2353, 3.2692, 2.8143, 1.4727,
            1.7924, 2.9307, 0.8619]
RULE = [2.8482, 4.561, 0.8794, 3.3768, 3.8845, 1.8421, 1.209, 2.1736, 2.1536, 3.1142, 3.1519, 2.8222, 1.4426, 1.8485,
        2.8876, 0.8768]


def _table(sets):
    rows = []
    for ds, scale in sets:
        for i, (a, x, y) in enumerate(zip(AR, ADAPTIVE, RULE)):
            for m, v in (("AR", a), ("adaptive", x * scale), ("per-step", y)):
                rows.append({"source": ds, "prompt_id": f"{ds}{i}", "method": m, MODELLED_TPOT: v * 1e-3})
    return pa.Table.from_pylist(rows)


def test_the_gain_is_the_ratio_of_mean_times_and_lies_in_its_interval():
    g = pair_gain(_table([("code", 1.0), ("other", 0.95)]), "adaptive", "per-step")
    ar, x, y = (np.array(v) for v in (AR, ADAPTIVE, RULE))
    expect = (ar.mean() / x.mean()) / (ar.mean() / y.mean()) - 1  # = mean(y) / mean(x) - 1
    assert g["per_set"]["code"]["gain"] == pytest.approx(expect, rel=1e-12)
    assert ((ar / x).mean() / (ar / y).mean() - 1) - expect > 0.015  # the other estimator is points away here
    speeds = [((ar.mean() / (x * s).mean()), ar.mean() / y.mean()) for s in (1.0, 0.95)]
    assert g["gain"] == pytest.approx(np.mean([a for a, _ in speeds]) / np.mean([b for _, b in speeds]) - 1)


def test_the_intervals_of_a_two_prompt_case_worked_out_by_hand():
    """Two sets of two prompts (modelled ms per token). A set's resample is {1, 1}, {1, 2} or {2, 2} with
    probability 1/4, 1/2, 1/4, so each end of its 95 % interval is a one-prompt resample (> 2.5 % each), and
    the average's ends are corner pairs of the sets' resamples (1/16 each).

    set A: AR 4, 4; adaptive 1, 2; rule 2, 3 -> per prompt rule / adaptive 2 and 1.5: gain +100 % and +50 %;
    set B: AR 6, 6; adaptive 3, 6; rule 3, 9 -> 1 and 1.5: +0 % and +50 %.
    Estimates: A 2.5 / 1.5 - 1 = 2/3, B 6 / 4.5 - 1 = 1/3; average: speedups (AR / adaptive, AR / rule) A (8/3,
    1.6), B (4/3, 1), (8/3 + 4/3) / (1.6 + 1) - 1 = 7/13. Average's ends: A's {2, 2} (2, 4/3) with B's {1, 1}
    (2, 2): 4 / (10/3) - 1 = 0.2; A's {1, 1} (4, 2) with B's {2, 2} (1, 2/3): 5 / (8/3) - 1 = 0.875.
    Resampling adaptive and the rule apart would widen A to [+0 %, +200 %]."""
    rows = []
    for ds, ar, adaptive, rule in (("A", [4, 4], [1, 2], [2, 3]), ("B", [6, 6], [3, 6], [3, 9])):
        for i in range(2):
            for m, v in (("AR", ar[i]), ("adaptive", adaptive[i]), ("per-step", rule[i])):
                rows.append({"source": ds, "prompt_id": f"{ds}{i}", "method": m, MODELLED_TPOT: v * 1e-3})
    g = pair_gain(pa.Table.from_pylist(rows), "adaptive", "per-step")
    assert g["per_set"]["A"]["gain"] == pytest.approx(2 / 3) and g["per_set"]["B"]["gain"] == pytest.approx(1 / 3)
    assert g["per_set"]["A"]["ci95"] == pytest.approx([0.5, 1.0])
    assert g["per_set"]["B"]["ci95"] == pytest.approx([0.0, 0.5])
    assert g["gain"] == pytest.approx(7 / 13) and g["gain_ci95"] == pytest.approx([0.2, 0.875])
    assert g["prompts"] == 4
