"""tune's load check (pipeline.evaluation.load_check): b*(c) timed against AR on the real tiny pair, the verdict on the
full steps' paired interval, and the schedule it leaves (K = 0 from the first load not kept on)."""

import pytest

from pipeline.evaluation.load_check import check_at, check_for, checked_schedule, decide, loads_to_check, read_checked

MODEL = {1: 8, 2: 7, 4: 6, 8: 5, 16: 4}


def test_the_schedule_left_is_the_models_up_to_the_first_load_not_kept():
    assert checked_schedule(MODEL, {}) == MODEL
    assert checked_schedule(MODEL, {"16": {"kept": True}}) == MODEL
    assert checked_schedule(MODEL, {"16": {"kept": False}}) == {1: 8, 2: 7, 4: 6, 8: 5, 16: 1}
    # a smaller load dropped takes every larger one with it, checked or not
    assert checked_schedule(MODEL, {"4": {"kept": False}, "16": {"kept": True}}) == {1: 8, 2: 7, 4: 1, 8: 1, 16: 1}
    assert loads_to_check({**MODEL, 16: 1}, [1, 4, 16]) == [4]  # b*(16) = 1 already: nothing to take away there


def test_the_verdict_is_the_lower_bound_of_the_full_steps_interval():
    whole = {"gain": 0.5, "ci95": [0.4, 0.6]}
    assert decide({"gain": 0.1, "ci95": [0.01, 0.2]}, whole, 0.0, 16, 64)[0] is True
    kept, why = decide({"gain": 0.1, "ci95": [-0.01, 0.2]}, whole, 0.0, 16, 64)
    assert kept is False and "full steps" in why and "not above" in why  # the whole run's +40 % does not count
    assert decide({"gain": 0.1, "ci95": [0.01, 0.2]}, whole, 0.05, 16, 64)[0] is False  # min_gain is a margin
    kept, why = decide(None, {"gain": 0.1, "ci95": [0.02, 0.2]}, 0.0, 16, 8)  # no full step: the whole run
    assert kept is True and "8 prompts < c=16" in why
    assert decide({"gain": 0.3, "ci95": None}, whole, 0.0, 16, 64)[0] is False  # one repeat: no interval, no K


def test_a_check_on_the_tiny_pair_pairs_its_repeats_and_decides_on_them(batched):
    m, engine = batched
    prompts = [m.tokenizer(t)["input_ids"][:16 + 5 * i] for i, t in enumerate(
        ["def parse(self, text):", "In the beginning God created", "Let x be the number of apples", "import os\n",
         "The quick brown fox", "class Stack:\n    def push", "for i in range(10):", "Blessed are the meek"])]
    got = check_at(engine, prompts, 4, 5, repeats=3, max_new_tokens=16, min_gain=-0.999)
    rows = got["rows"]
    ar = sorted((r for r in rows if r["method"] == "AR"), key=lambda r: r["repeat"])
    b5 = sorted((r for r in rows if r["method"] == "b=5"), key=lambda r: r["repeat"])
    assert [r["repeat"] for r in ar] == [r["repeat"] for r in b5] == [0, 1, 2]  # both timed in every repeat
    assert ar[0]["full_steps"] > 0 and b5[0]["full_steps"] > 0
    full = got["full_steps"]
    assert full["repeats"] == 3 and full["gain"] == pytest.approx(
        sum(r["full_throughput"] for r in b5) / sum(r["full_throughput"] for r in ar) - 1)
    assert full["ci95"][0] <= full["gain"] <= full["ci95"][1]
    assert got["kept"] is True  # any measured gain clears -99.9 %
    # the same measurement under a margin no run can clear: dropped, and the schedule says K = 0 from c = 4 on
    kept, why = decide(full, got["whole_run"], 10.0, 4, len(prompts))
    assert kept is False and why.startswith("measured ")
    assert checked_schedule(MODEL, {"4": {"kept": kept}})[16] == 1


def test_a_check_made_for_another_schedule_is_ignored(tmp_path):
    import json

    path = tmp_path / "load_check.json"
    assert read_checked(path, MODEL) == MODEL and check_for(path, MODEL) is None  # no check: the model's
    path.write_text(json.dumps({"model_schedule": {str(c): b for c, b in MODEL.items()},
                                "loads": {"16": {"kept": False}}}))
    assert read_checked(path, MODEL)[16] == 1
    other = {**MODEL, 16: 5}  # a policy trained again since: its b*(16) was never checked
    assert read_checked(path, other) == other and check_for(path, other) is None
