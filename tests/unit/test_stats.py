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


def test_the_95_percent_interval_covers_a_known_mean_about_95_percent_of_the_time():
    """Coverage on synthetic data with a known mean: 300 samples of 40 rows (skewed: exponential, mean 2), each
    sample's 95 % interval of its mean. A percentile bootstrap covers 90-99 % of the time at n = 40; an interval
    too narrow (a 80 % one, or the resample's spread divided by sqrt(n) twice) or too wide (99.9 %) does not, and the
    average width is the normal approximation's 2 x 1.96 sigma / sqrt(n) within 15 %."""
    rng = np.random.default_rng(2026)
    trials, n, mean = 300, 40, 2.0
    intervals = [paired_bootstrap(lambda m: m, rng.exponential(mean, n), reps=1000, seed=t) for t in range(trials)]
    covered = sum(lo <= mean <= hi for lo, hi in intervals) / trials
    assert 0.90 <= covered <= 0.99, covered
    width = np.mean([hi - lo for lo, hi in intervals])
    assert width == pytest.approx(2 * 1.96 * mean / np.sqrt(n), rel=0.15)  # exponential: sigma = mean


def test_a_paired_ratio_interval_covers_the_true_ratio_and_is_reproducible():
    """The paired statistic's coverage: per row a shared prompt cost c_i (1..100) times noise, method b 10 % dearer
    than a on average; the interval of mean(b) / mean(a) - 1 covers the true +10 % in 90-99 % of 200 samples. An
    implementation resampling the two arrays apart would cover ~100 % with intervals ~9x as wide (checked)."""
    rng = np.random.default_rng(7)
    covered, widths = 0, []
    for t in range(200):
        cost = rng.uniform(1, 100, 30)
        a, b = cost * rng.normal(1.0, 0.05, 30), cost * 1.1 * rng.normal(1.0, 0.05, 30)
        # the true gain given these costs: E[b]/E[a] - 1 = 0.1 exactly (the noise is independent of the cost)
        lo, hi = paired_bootstrap(lambda x, y: y / x - 1, a, b, reps=1000, seed=t)
        covered += lo <= 0.1 <= hi
        widths.append(hi - lo)
    assert 0.90 <= covered / 200 <= 0.99, covered
    assert np.mean(widths) < 0.10  # the cost's 100x spread cancels in pairs: ~6 points wide, unpaired ~55
    # The same rows and seed give the same interval; another seed, another (equally valid) one.
    a, b = rng.uniform(1, 2, 40), rng.uniform(1, 2, 40)
    groups = np.array(["s2"] * 15 + ["s1"] * 25)
    one = grouped_paired_bootstrap(lambda a, b: b / a - 1, a, b, groups=groups, reps=300, seed=7)
    assert one == grouped_paired_bootstrap(lambda a, b: b / a - 1, a, b, groups=groups, reps=300, seed=7)
    assert one != grouped_paired_bootstrap(lambda a, b: b / a - 1, a, b, groups=groups, reps=300, seed=8)


def test_a_two_row_group_has_the_interval_worked_out_by_hand():
    """Two rows: a resample is {1, 1}, {1, 2} or {2, 2} with probability 1/4, 1/2, 1/4, so its mean is 1, 2 or 3
    (rows 1 and 3); the 2.5 and 97.5 percentiles of 2000 draws are then exactly 1 and 3 (each end has ~500 draws)."""
    assert paired_bootstrap(lambda m: m, [1.0, 3.0]) == (1.0, 3.0)
    assert paired_bootstrap(lambda m: m, [1.0, 3.0], seed=1) == (1.0, 3.0)  # whatever the draws
    # Per group, and the average over groups: x is 1, 2, 3 and y 10, 20, 30 (1/4, 1/2, 1/4 each, drawn apart), so
    # the average (x + y) / 2 is 5.5 with probability 1/16 and 16.5 with 1/16 (> 2.5 % each): the interval's ends.
    ci = grouped_paired_bootstrap(lambda m: m, [1.0, 3.0, 10.0, 30.0], groups=["x", "x", "y", "y"])
    assert ci == {"x": (1.0, 3.0), "y": (10.0, 30.0), "average": (5.5, 16.5)}


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap(lambda a, b: a / b, [1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="group labels"):
        grouped_paired_bootstrap(lambda a: a, [1.0, 2.0], groups=["x"])
