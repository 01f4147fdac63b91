"""tune's load check (pipeline.evaluation.load_check): b*(c) timed against AR on the real tiny pair, repeats added
until the paired interval settles kept / dropped / tie, and the schedule it leaves (each load by its own evidence).
The rule's power at the check's measured spread: tests/unit/test_load_verdict.py."""

import pytest

from pipeline.evaluation.load_check import (check_at, check_for, checked_schedule, inherited, loads_to_check,
                                            read_checked, served)
from pipeline.evaluation.sequential import SequentialRule

MODEL = {1: 8, 2: 7, 4: 6, 8: 5, 16: 4}


def _load(b, serve, gain=0.0):
    return {"b": b, "kept": serve == b, "serve": serve, "interval": {"gain": gain}}


def test_each_load_keeps_its_own_verdict_and_no_other_load_inherits_it_unmeasured():
    assert checked_schedule(MODEL, {}) == MODEL
    assert checked_schedule(MODEL, {"16": _load(4, 4)}) == MODEL
    assert checked_schedule(MODEL, {"16": _load(4, 1)}) == {**MODEL, 16: 1}
    # a smaller load dropped no longer takes the larger ones with it: 8 was not timed, 16 was and kept
    assert checked_schedule(MODEL, {"4": _load(6, 1), "16": _load(4, 4)}) == {**MODEL, 4: 1}
    assert checked_schedule(MODEL, {"16": _load(4, 2)}) == {**MODEL, 16: 2}  # b*(16) lost, b = 2 was kept there
    assert served({"b": 4, "kept": False}) == 1 and served({"b": 4, "kept": True}) == 4  # a check from before serve
    assert loads_to_check({**MODEL, 16: 1}, [1, 4, 16]) == [4]  # b*(16) = 1 already: nothing to take away there
    # tune.load_loads=changes: also every grid point where b*(c) changes (where a 3-item range starts), in order
    grid = {1: 8, 2: 8, 4: 6, 8: 6, 16: 4, 32: 4, 64: 1}
    assert loads_to_check(grid, [1, 16]) == [16]
    assert loads_to_check(grid, [1, 16], "changes") == [4, 16]  # 64 changes to b = 1: nothing to take away there
    assert loads_to_check(grid, [1, 8], "changes") == [4, 8, 16]


def test_an_unchecked_larger_load_gets_k0_only_where_the_measured_gains_fall_with_c():
    model = {**MODEL, 32: 3, 64: 3}
    falling = {"8": _load(5, 5, +0.03), "16": _load(4, 1, -0.04)}
    assert set(inherited(model, falling)) == {32, 64} and "fall as c grows" in inherited(model, falling)[32]
    assert checked_schedule(model, falling) == {**model, 16: 1, 32: 1, 64: 1}
    rising = {"8": _load(5, 1, -0.05), "16": _load(4, 1, -0.02)}  # no monotone fit: 32 and 64 stay unmeasured
    assert inherited(model, rising) == {} and checked_schedule(model, rising)[32] == 3
    assert inherited(model, {"16": _load(4, 1, -0.04)}) == {}  # one checked load is no fit
    assert inherited(model, {"8": _load(5, 5, 0.05), "16": _load(4, 4, 0.01)}) == {}  # the largest still speculates


def test_the_rule_settles_kept_dropped_and_tie_and_waits_while_open():
    rule = SequentialRule(min_repeats=3, max_repeats=6, alpha=0.02, tie=0.02)
    assert rule.verdict([0.05, 0.06, 0.055]) == "kept"
    assert rule.verdict([-0.05, -0.06, -0.055]) == "dropped"
    assert rule.verdict([0.001, -0.001, 0.0005]) == "tie"  # half-width well within 2 %
    assert rule.verdict([0.05, 0.06]) is None  # fewer than min_repeats: never settled
    assert rule.verdict([0.1, -0.1, 0.08]) is None  # open: another repeat
    assert rule.verdict([0.1, -0.1, 0.08, -0.09, 0.1, -0.1]) == "tie"  # the cap: a tie, the cheaper choice
    assert rule.verdict([0.05, 0.06, 0.055], threshold=10.0) == "dropped"  # held against tune.load_min_gain


def test_a_check_on_the_tiny_pair_pairs_its_repeats_and_decides_on_them(batched):
    m, engine = batched
    prompts = [m.tokenizer(t)["input_ids"][:16 + 5 * i] for i, t in enumerate(
        ["def parse(self, text):", "In the beginning God created", "Let x be the number of apples", "import os\n",
         "The quick brown fox", "class Stack:\n    def push", "for i in range(10):", "Blessed are the meek"])]
    # a threshold no run can miss (-99.9 %) and one none can reach (+1000 %): settled at the first look, 3 repeats
    rule = SequentialRule(min_repeats=3, max_repeats=8)
    got = check_at(engine, prompts, 4, 5, rule, max_new_tokens=16, min_gain=-0.999)
    rows = got["rows"]
    ar = sorted((r for r in rows if r["method"] == "AR"), key=lambda r: r["repeat"])
    b5 = sorted((r for r in rows if r["method"] == "b=5"), key=lambda r: r["repeat"])
    assert [r["repeat"] for r in ar] == [r["repeat"] for r in b5] == [0, 1, 2]  # both timed, stopped at the verdict
    assert ar[0]["full_steps"] > 0 and b5[0]["full_steps"] > 0
    full = got["full_steps"]
    assert full["repeats"] == 3 and full["gain"] == pytest.approx(
        sum(r["full_throughput"] for r in b5) / sum(r["full_throughput"] for r in ar) - 1)
    assert got["verdict"] == "kept" and got["kept"] and got["repeats"] == 3
    assert got["interval"]["over"] == "the full steps of the window both shared in lockstep"
    assert all(r["window_throughput"] > 0 for r in rows)
    lo, hi = got["interval"]["ci"]
    assert lo <= got["interval"]["gain"] <= hi and got["interval"]["level"] == pytest.approx(0.98)
    assert got["engines_at_once"] == 2 and got["timing"] == "in lockstep"
    dropped = check_at(engine, prompts, 4, 5, rule, max_new_tokens=16, min_gain=10.0, max_engines=1)
    assert dropped["verdict"] == "dropped" and "upper end below +1000.00%" in dropped["why"]
    assert dropped["engines_at_once"] == 1 and dropped["timing"].startswith("one after the other")
    assert dropped["interval"]["over"] == "full steps"  # no shared window one engine at a time
    # a tie no run settles (tie 0, the threshold at the gain just measured, a 99.9 % interval): on to the cap
    capped = check_at(engine, prompts, 4, 5, SequentialRule(min_repeats=2, max_repeats=4, alpha=1e-3, tie=0.0),
                      max_new_tokens=16, min_gain=full["gain"])
    assert capped["verdict"] == "tie" and capped["repeats"] == 4 and "tune.load_max_repeats 4" in capped["why"]


def test_a_check_made_for_another_schedule_is_ignored(tmp_path):
    import json

    path = tmp_path / "load_check.json"
    assert read_checked(path, MODEL) == MODEL and check_for(path, MODEL) is None  # no check: the model's
    path.write_text(json.dumps({"model_schedule": {str(c): b for c, b in MODEL.items()},
                                "loads": {"16": {"b": 4, "kept": False}}}))
    assert read_checked(path, MODEL)[16] == 1
    other = {**MODEL, 16: 5}  # a policy trained again since: its b*(16) was never checked
    assert read_checked(path, other) == other and check_for(path, other) is None
