"""evaluate's adaptive-vs-rule comparison (pipeline.evaluation.headline.pair_gain): its estimate is the estimator
its interval resamples, the ratio of mean times per token per set (evaluate's speedup), so it lies inside."""

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
    for v in [*g["per_set"].values(), {"gain": g["gain"], "ci95": g["gain_ci95"]}]:
        assert v["ci95"][0] <= v["gain"] <= v["ci95"][1], v
    speeds = [((ar.mean() / (x * s).mean()), ar.mean() / y.mean()) for s in (1.0, 0.95)]
    assert g["gain"] == pytest.approx(np.mean([a for a, _ in speeds]) / np.mean([b for _, b in speeds]) - 1)
