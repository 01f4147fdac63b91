"""Evaluate at load (pipeline.evaluation.load) on the bundled tiny pair: every method serves the same prompts losslessly
(T = 0: the same tokens), methods with the same choices share one decode, the interval is the paired t interval."""

import math

import pytest

from pipeline.decoding.batched import fixed
from pipeline.evaluation.load import ADAPTIVE, evaluate_at_load, load_summary, paired_ratio, render_load


def test_the_paired_interval_against_a_hand_computed_case():
    a, b = [1.1, 1.3, 1.2], [1.0, 1.0, 1.0]
    d = [math.log(x) for x in a]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.303 * sd / math.sqrt(3)  # t(0.975, 2 df)
    got = paired_ratio(a, b)
    assert got["gain"] == pytest.approx(1.2 / 1.0 - 1)
    assert got["ci95"] == pytest.approx([math.exp(mean - half) - 1, math.exp(mean + half) - 1], rel=1e-6)
    assert paired_ratio([2.0, 4.0], [1.0, 2.0])["ci95"] == pytest.approx([1.0, 1.0])  # no spread: a point
    assert paired_ratio([3.0, 3.0], [3.0, 3.0]) == {"gain": 0.0, "ci95": [0.0, 0.0], "repeats": 2, "identical": True}


def test_methods_serve_the_same_tokens_and_equal_choices_share_a_decode(batched):
    m, engine = batched
    prompts = [m.tokenizer(t)["input_ids"][:20 + 7 * i] for i, t in enumerate(
        ["def parse(self, text):", "In the beginning God created", "Let x be the number of apples", "import os\n",
         "The quick brown fox", "class Stack:\n    def push"])]
    choosers = {"AR": fixed(1), "b=4": fixed(4), "b=6": fixed(6), "also 4": fixed(4),
                ADAPTIVE: lambda i, lg, h: (4 if i % 2 else 6, None)}
    rows = evaluate_at_load(engine, prompts, 3, choosers, ["b=4"], repeats=2, max_new_tokens=16)
    by = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    assert {r["same_as"] for r in by["also 4"]} == {"b=4"} and len(by["also 4"]) == len(by["b=4"]) == 2
    assert len(by[ADAPTIVE]) == 2 and len(by["AR"]) == len(by["b=6"]) == 1  # baselines and adaptive repeated
    assert len({r["new_tokens"] for r in rows}) == 1  # lossless: every method commits the same tokens
    assert by[ADAPTIVE][0]["block_sizes"] == [4, 6] and by["b=6"][0]["block_sizes"] == [6]
    s = load_summary(rows, 3, {"b*(c)": "b=4"})
    assert list(s["methods"]) == ["AR", "b=4", "b=6", "also 4", ADAPTIVE]
    h = s["headline"]["b*(c)"]
    a = [r["throughput"] for r in by[ADAPTIVE]]
    b = [r["throughput"] for r in by["b=4"]]
    assert h["measured"]["gain"] == pytest.approx(sum(a) / sum(b) - 1) and h["measured"]["repeats"] == 2
    assert s["cost_model"]["mean_abs_speedup_error"] is None  # no cost model given: nothing modelled
    assert any("adaptive vs b*(c) (b=4)" in line for line in render_load(s))
    # The steady state: the steps with all 3 rows running, their tokens and seconds (AR's two waves of 3 are all
    # full; a speculative method's requests end at scattered steps and leave a ragged tail)
    for r in rows:
        assert 0 < r["full_steps"] <= r["steps"] and 0 < r["full_tokens"] <= r["new_tokens"]
        assert r["full_throughput"] > 0 and r["modelled_full_throughput"] is None
    assert any(r["full_steps"] < r["steps"] for r in by["b=6"] + by[ADAPTIVE])
    assert all(s["methods"][m]["full_throughput"] > 0 for m in s["methods"])
    assert s["fastest"]["full_throughput"] in s["methods"]


def test_a_steps_committed_tokens_add_up_to_the_runs_and_full_steps_are_those_with_c_rows(batched):
    m, engine = batched
    prompts = [m.tokenizer(t)["input_ids"][:12 + 5 * i] for i, t in enumerate(
        ["def parse(self, text):", "In the beginning God created", "Let x be the number of apples", "import os\n",
         "The quick brown fox"])]
    from pipeline.evaluation.load import run_row

    for b in (1, 5):
        run = engine.run(prompts, 2, 12, fixed(b))
        decode = [s for s in run.steps if s.kind == "decode"]
        assert sum(s.committed for s in decode) == run.new_tokens - len(prompts)  # the prefill's first token apart
        row = run_row(2, f"b={b}", 0, run, None)
        full = [s for s in decode if s.rows == 2]
        assert row["full_steps"] == len(full) and row["full_tokens"] == sum(s.committed for s in full)
        assert row["full_throughput"] == pytest.approx(
            row["full_tokens"] / sum(s.draft_seconds + s.verify_seconds for s in full))


def test_the_pass_at_load_samples_at_the_configured_temperature(batched):
    """At T = 1 the pass at load decodes by rejection sampling (the tiny pair accepts far less than at T = 0), and
    each repeat draws afresh."""
    m, engine = batched
    prompts = [m.tokenizer(t)["input_ids"] for t in ["def parse(self, text):", "In the beginning God created",
                                                       "Let x be the number of apples", "The quick brown fox"]]

    def per_step(temperature):
        rows = evaluate_at_load(engine, prompts, 2, {"b=6": fixed(6)}, ["b=6"], repeats=2, max_new_tokens=24,
                                temperature=temperature)
        return [r["new_tokens"] / r["steps"] for r in rows]

    greedy, sampled = per_step(0.0), per_step(1.0)
    assert greedy[0] == greedy[1]  # T = 0: the repeats decode the same tokens
    assert sampled[0] != sampled[1]
    assert max(sampled) < min(greedy) - 0.5, (greedy, sampled)
