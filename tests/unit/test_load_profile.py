"""The load part of the cost profile (pipeline.decoding.load_profile): which b are timed together in lockstep, and
that every (b, c, context, round) point is timed, on the bundled tiny pair."""

import pytest

from pipeline.decoding.load_profile import lockstep_groups, measure_load

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("sizes, at_most", [([1, 2, 4, 6, 8, 10, 12], 8), ([1, 2, 4, 6, 8, 10, 12], 3),
                                            ([1, *range(2, 21, 2)], 8), ([2, 4, 6], 2), ([1], 4), ([1, 2], 1)])
def test_every_b_is_timed_once_beside_ar_and_no_group_is_larger_than_allowed(sizes, at_most):
    groups = lockstep_groups(sizes, at_most)
    rest = [b for g in groups for b in g if b != 1]
    assert sorted(rest) == sorted(b for b in sizes if b != 1)  # each b > 1 once, none lost
    if 1 in sizes:  # AR in every group: each group's ratios are to the same moment's AR
        assert all(g[0] == 1 for g in groups)
        assert all(len(g) <= max(2, at_most) for g in groups)
    else:
        assert all(len(g) <= at_most for g in groups) and not any(1 in g for g in groups)


def test_measure_load_times_every_point_of_every_round_on_the_tiny_pair():
    from pipeline.decoding.engine import Engine
    from pipeline.decoding.models import load_models
    from pipeline.runtime.config import ModelConfig

    m = load_models(ModelConfig(dtype="float32", device="cpu"))
    engine = Engine(m.target, m.draft, m.stop_token_ids)
    got = measure_load(engine, [1, 2, 4, 6], [1, 3], m.vocab_size, context_lengths=(16, 40), steps=3, rounds=2,
                       max_engines=3)
    assert list(got["load"]) == ["3"] and engine.stop_token_ids == m.stop_token_ids  # stop tokens restored
    raw = got["load"]["3"]["raw"]
    # groups [1, 2, 4] and [1, 6]: b = 1 twice per (context, round), every other b once
    for ctx in (16, 40):
        for rnd in (1, 2):
            here = sorted(p["b"] for p in raw if p["context"] == ctx and p["round"] == rnd)
            assert here == [1, 1, 2, 4, 6], (ctx, rnd, here)
    assert all(p["steps"] >= 1 and p["draft_seconds"] >= 0 and p["verify_seconds"] > 0 for p in raw)
    # the widths follow the contexts: the model's width axis sees two points
    assert all(16 <= p["width"] < 30 for p in raw if p["context"] == 16)
    assert all(40 <= p["width"] < 54 for p in raw if p["context"] == 40)
    seconds = got["load"]["3"]["seconds"]
    assert set(seconds) == {"1", "2", "4", "6"} and all(v > 0 for v in seconds.values())
