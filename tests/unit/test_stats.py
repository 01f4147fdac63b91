"""pipeline.policy.stats: the one paired bootstrap (margin calibration, evaluate's gains and headline)."""

import numpy as np
import pytest

from pipeline.policy.stats import grouped_paired_bootstrap, paired_bootstrap, percentile_interval


def test_the_interval_of_a_mean_holds_the_true_mean():
    values = np.tile([0.0, 2.0], 50)  # true and sample mean 1, symmetric
    lo, hi = paired_bootstrap(lambda m: m, values)
    assert lo < 1.0 < hi and hi - lo < 0.5
    assert paired_bootstrap(lambda m: m, np.full(30, 3.0)) == (3.0, 3.0)  # no spread, no width


def test_pairing_tells_a_small_consistent_gain_from_zero():
    """Prompts differ 100x in cost, the method is 5 % faster on every one: resampled in pairs the gain's interval is
    tight and excludes zero; resampling the two arrays apart (what pairing prevents) would not."""
    rng = np.random.default_rng(0)
    base = rng.uniform(1, 100, size=60)
    method = base / 1.05 * rng.uniform(0.99, 1.01, size=60)
    lo, hi = paired_bootstrap(lambda m, b: b / m - 1, method, base)
    assert 0.04 < lo < hi < 0.06  # about the 5 %, far from zero
    r = np.random.default_rng(0)
    i, j = r.integers(0, 60, size=(2, 2000, 60))
    unpaired = base[j].mean(axis=1) / method[i].mean(axis=1) - 1
    assert np.percentile(unpaired, 2.5) < 0 < np.percentile(unpaired, 97.5)


def test_groups_are_resampled_apart_and_averaged_over_groups_not_rows():
    groups = ["x"] * 5 + ["y"] * 50
    values = np.array([1.0] * 5 + [3.0] * 50)
    ci = grouped_paired_bootstrap(lambda m: m, values, groups=groups)
    assert list(ci) == ["x", "y", "average"]
    # Within its own group a resample never draws the other group's rows; the average weighs the groups equally.
    assert ci["x"] == (1.0, 1.0) and ci["y"] == (3.0, 3.0) and ci["average"] == (2.0, 2.0)


def test_final_applies_to_the_average_over_groups():
    """The headline's shape: speedups per set, averaged over the sets, then their ratio (not the mean of ratios)."""
    ar, m, b = np.array([4.0, 4.0, 4.0, 4.0]), np.array([1.0, 1.0, 2.0, 2.0]), np.array([2.0, 2.0, 1.0, 1.0])
    ci = grouped_paired_bootstrap(lambda ar, m, b: np.stack([ar / m, ar / b]), ar, m, b, groups=[0, 0, 1, 1],
                                  final=lambda s: s[0] / s[1] - 1)
    assert ci[0] == (1.0, 1.0) and ci[1] == (-0.5, -0.5) and ci["average"] == (0.0, 0.0)


def test_the_draws_are_one_generator_seeded_with_seed_in_group_order():
    """Pins the resampling the callers' intervals were computed with before there was one implementation: one
    generator, per group in sorted order an index draw [reps, rows], the percentile interval of the statistic."""
    rng = np.random.default_rng(5)
    a, b = rng.uniform(1, 2, 40), rng.uniform(1, 2, 40)
    groups = np.array(["s2"] * 15 + ["s1"] * 25)
    expect, draws = {}, []
    gen = np.random.default_rng(7)
    for g in ("s1", "s2"):
        rows = np.flatnonzero(groups == g)
        idx = gen.integers(0, len(rows), size=(300, len(rows)))
        draws.append(b[rows][idx].mean(axis=1) / a[rows][idx].mean(axis=1) - 1)
        expect[g] = (np.percentile(draws[-1], 2.5), np.percentile(draws[-1], 97.5))
    got = grouped_paired_bootstrap(lambda a, b: b / a - 1, a, b, groups=groups, reps=300, seed=7)
    assert got["s1"] == expect["s1"] and got["s2"] == expect["s2"]
    assert got["average"] == percentile_interval(np.mean(draws, axis=0))
    lower = paired_bootstrap(lambda a, b: b / a - 1, a, b, reps=300, seed=7, level=0.90)[0]
    idx = np.random.default_rng(7).integers(0, 40, size=(300, 40))
    assert lower == float(np.percentile(b[idx].mean(axis=1) / a[idx].mean(axis=1) - 1, 5))


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap(lambda a, b: a / b, [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="group labels"):
        grouped_paired_bootstrap(lambda a: a, [1.0, 2.0], groups=["x"])
