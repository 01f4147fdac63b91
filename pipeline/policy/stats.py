"""The paired percentile bootstrap: one implementation for every interval the pipeline reports.

Rows are prompts; the arrays are per-prompt measurements of the methods being compared (time per output token of
adaptive and of a fixed b, ...), row i of every array the same prompt. A resample draws prompts with replacement and
keeps every array's row of a drawn prompt together (paired), so what a prompt's methods share (a long or an easy
prompt) cancels in their ratio instead of widening the interval. With ``groups`` (the evaluation set of each
prompt), prompts are resampled within their group, and an interval of the average over groups comes with the
per-group ones.

Used by the margin calibration (pipeline.policy.blocksize.calibrate_margin: its lower 5 % bound) and by evaluate's
gains (pipeline.evaluation.headline: 95 % intervals per evaluation set and averaged over the sets).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

Interval = Tuple[float, float]
AVERAGE = "average"


def percentile_interval(draws: np.ndarray, level: float = 0.95) -> Interval:
    """The central ``level`` interval of the bootstrap draws (percentiles (1 - level) / 2 and its mirror)."""
    low = (100 - 100 * level) / 2
    return float(np.percentile(draws, low)), float(np.percentile(draws, 100 - low))


def grouped_paired_bootstrap(statistic: Callable[..., np.ndarray], *arrays: Sequence[float],
                             groups: Optional[Sequence[Any]] = None, reps: int = 2000, seed: int = 0,
                             level: float = 0.95, final: Optional[Callable[[np.ndarray], np.ndarray]] = None
                             ) -> Dict[Any, Interval]:
    """Percentile intervals of ``final(statistic(*means))`` per group and of its average over groups.

    ``arrays``: equal-length per-row values, paired row by row. Each group's rows (in their given order; ``groups``
    a per-row label, None for one group) are resampled ``reps`` times with replacement, the same rows for every
    array, and ``statistic`` receives each array's mean per resample (arrays [reps]) and returns the group's
    quantity (vectorised, reps on the last axis). The interval of a group is of ``final(quantity)``; that of
    ``"average"`` (with groups) is of ``final`` of the quantity averaged over the groups. ``final`` defaults to the
    quantity itself: a gain averaged over sets passes the gain as the statistic; a ratio of averaged speedups
    passes the speedups as the statistic and their ratio as ``final``. One generator seeded with ``seed`` draws the
    groups in sorted order, so an interval is reproducible for the same rows and seed.

    Returns ``{group: (low, high)}`` in sorted group order (``{None: ...}`` without groups), then ``"average"``.
    """
    final = final or (lambda q: q)
    values = [np.asarray(a, dtype=np.float64) for a in arrays]
    n = len(values[0])
    if any(len(v) != n for v in values):
        raise ValueError(f"paired arrays differ in length: {[len(v) for v in values]}")
    labels = np.asarray(groups) if groups is not None else np.zeros(n, dtype=np.int8)
    if len(labels) != n:
        raise ValueError(f"{len(labels)} group labels for {n} rows")
    rng = np.random.default_rng(seed)
    quantities: Dict[Any, np.ndarray] = {}
    for g in sorted(set(labels.tolist())) if groups is not None else [None]:
        rows = np.flatnonzero(labels == g) if groups is not None else np.arange(n)
        idx = rng.integers(0, len(rows), size=(reps, len(rows)))
        quantities[g] = np.asarray(statistic(*(v[rows][idx].mean(axis=1) for v in values)))
    out = {g: percentile_interval(final(q), level) for g, q in quantities.items()}
    if groups is not None:
        out[AVERAGE] = percentile_interval(final(np.mean(list(quantities.values()), axis=0)), level)
    return out


def paired_bootstrap(statistic: Callable[..., np.ndarray], *arrays: Sequence[float], reps: int = 2000,
                     seed: int = 0, level: float = 0.95) -> Interval:
    """The percentile interval of ``statistic(*means)`` over paired resamples of all rows (one group): see
    :func:`grouped_paired_bootstrap`. A one-sided lower 5 % bound is the low end at ``level=0.90``."""
    return grouped_paired_bootstrap(statistic, *arrays, reps=reps, seed=seed, level=level)[None]
