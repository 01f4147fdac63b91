"""evaluate's comparison of adaptive decoding with a fixed block size: the gain and its bootstrap interval."""

import numpy as np
import pyarrow as pa
import pytest

from pipeline.evaluation.headline import gain_with_interval, hindsight_method


def results(rows):
    return pa.Table.from_pylist([{"source": s, "prompt_id": p, "method": m, "time_per_output_token": t}
                                 for s, p, m, t in rows])


def test_a_constant_ratio_has_that_gain_and_no_width():
    rng = np.random.default_rng(0)
    rows = []
    for ds in ("a", "b"):
        for i, t in enumerate(rng.uniform(1, 3, size=20)):
            rows += [(ds, f"{ds}{i}", "adaptive", t), (ds, f"{ds}{i}", "b=8", 1.1 * t)]
    g = gain_with_interval(results(rows), "adaptive", "b=8")
    for key in ("a", "b", "average"):
        assert g[key]["gain"] == pytest.approx(0.1) and g[key]["ci95"] == pytest.approx([0.1, 0.1])
    assert g["a"]["prompts"] == 20


def test_noise_gives_an_interval_around_the_estimate_that_narrows_with_more_prompts():
    rng = np.random.default_rng(1)

    def widths(n):
        rows = []
        for i in range(n):
            t = rng.uniform(1, 3)
            rows += [("a", str(i), "adaptive", t), ("a", str(i), "b=8", t * rng.uniform(0.9, 1.3))]
        g = gain_with_interval(results(rows), "adaptive", "b=8")["a"]
        lo, hi = g["ci95"]
        assert lo < g["gain"] < hi and lo > 0  # a real, positive gain (mean ratio 1.1) is told apart from zero
        return hi - lo

    assert widths(400) < widths(25) / 2


def test_rows_pair_by_prompt_whatever_their_order():
    rows = [("a", "p1", "adaptive", 1.0), ("a", "p2", "adaptive", 2.0),
            ("a", "p2", "b=8", 3.0), ("a", "p1", "b=8", 1.0)]
    g = gain_with_interval(results(rows), "adaptive", "b=8")
    assert g["a"]["gain"] == pytest.approx((1.0 + 3.0) / (1.0 + 2.0) - 1)


def test_fixed_block_sizes_resolve_null_to_the_papers_set_and_a_list_to_it_and_the_candidates():
    from pipeline.evaluation.methods import fixed_block_sizes

    cands = [6, 7, 8, 9, 10]
    assert fixed_block_sizes(None, 8, cands) == [2, 4, 6, 7, 8, 9, 10, 16]  # {B/4, B/2, B, 2B} + C
    assert fixed_block_sizes([], 8, cands) == cands  # the default: the candidates alone
    assert fixed_block_sizes([12, 3, 7], 8, cands) == [3, 6, 7, 8, 9, 10, 12]


def test_the_hindsight_b_is_the_fastest_and_a_last_bit_tie_goes_to_the_smaller_b():
    """CI's numbers: b=6 and b=7 decoded alike and their averages differed in the last bit (b=7 the larger), which a
    plain max turned into a coin toss between two runs' summation orders."""
    methods = ["AR", "b=10", "b=7", "b=6", "b=8", "adaptive", "oracle"]
    table = {"b=10": {"average": 1.05}, "b=6": {"average": 1.162462858059943},
             "b=7": {"average": 1.1624628580599432}, "b=8": {"average": 1.1337887697267313}}
    assert hindsight_method(methods, table) == "b=6"
    table["b=7"]["average"] = 1.17  # a real difference is not a tie
    assert hindsight_method(methods, table) == "b=7"
    assert hindsight_method(methods, {**table, "b=10": {"average": 2.0}}) == "b=10"  # by value, not string order
    assert hindsight_method(methods, {**table, "b=6": {"s": 1.3}, "b=7": {"s": 1.2}, "b=8": {"s": 1.1},
                                      "b=10": {"s": 1.0}}, where="s") == "b=6"
