"""The cost model against wall clock: evaluate's check (pipeline/evaluation/cost_check.py) on constructed rows, and
the cost profile's version-2 terms (a per-decode first-step extra, a per-step rule's own cost) on constructed raw
points: recovered by the fit, kept through save / load, and a version-1 profile still reads. No wall clock."""

import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline.data.schemas import RESULTS_SCHEMA
from pipeline.evaluation.cost_check import cost_check, ratios
from pipeline.evaluation.render import render_markdown
from pipeline.evaluation.results import with_modelled_time
from pipeline.evaluation.summary import summarize
from pipeline.policy.cost import FORMAT, FORMAT_VERSION, TIMING_RULE, CostProfile

# Modelled / measured seconds per method: AR's model is 10 % slow, b=8's 20 %, so b=8's modelled speedup is
# 1.1 / 1.2 of its wall one; per-step rows' ratios vary by prompt (their median is not their ratio of sums).
FACTOR = {"AR": 1.1, "b=8": 1.2}
PER_STEP = [1.0, 1.1, 1.6]


def rows():
    out = []
    for ds in ("a", "b"):
        for i in range(3):
            for m, seconds, tokens in (("AR", 1.0 + i, 32), ("b=8", 0.4 + 0.1 * i, 32), ("per-step", 0.5, 32)):
                factor = PER_STEP[i] if m == "per-step" else FACTOR[m]
                out.append({"source": ds, "prompt_id": f"{ds}{i}", "method": m, "tau": 1.0,
                            "decode_seconds": seconds, "time_per_output_token": seconds / tokens,
                            "new_tokens": tokens, "modelled_seconds": factor * seconds,
                            "matches_autoregressive": True, "policy_seconds": None, "prefill_seconds": 0.01,
                            "policy_block_size": None, "policy_action": None, "step_rule": None})
    return pa.Table.from_pylist(out, schema=pa.schema([RESULTS_SCHEMA.field(n) for n in out[0]]))


def test_the_check_gives_the_constructed_ratios_per_set_and_on_average():
    results = with_modelled_time(rows())
    methods = ["AR", "b=8", "per-step"]
    summary = summarize(results, methods)
    c = cost_check(results, summary)
    cm = c["methods"]
    for ds in ("a", "b", "average"):
        assert cm["AR"][ds]["ratio"] == pytest.approx(1.1) and cm["AR"][ds]["median_ratio"] == pytest.approx(1.1)
        assert cm["b=8"][ds]["ratio"] == pytest.approx(1.2) and cm["b=8"][ds]["ratio_vs_ar"] == pytest.approx(
            1.2 / 1.1)
        # A uniform error cancels in a speedup; what is left is the method's error relative to AR's.
        assert cm["AR"][ds]["speedup_error"] == pytest.approx(0.0)
        assert cm["b=8"][ds]["speedup_error"] == pytest.approx(1.1 / 1.2 - 1)
        assert cm["per-step"][ds]["ratio"] == pytest.approx(np.mean(PER_STEP))  # equal seconds per prompt
        assert cm["per-step"][ds]["median_ratio"] == pytest.approx(1.1)
    assert cm["b=8"]["a"]["prompts"] == 3 and cm["b=8"]["average"]["prompts"] == 6
    assert c["mean_abs_ratio_error"] == pytest.approx(np.mean([0.1, 0.2, np.mean(PER_STEP) - 1]))
    assert c["worst"]["method"] == "per-step"  # its ratio of sums, 1.233, is furthest from AR's 1.1
    md = render_markdown({**summary, "candidates": [8], "cost_model": c})
    assert "## Cost model against wall clock" in md and "| b=8 | 1.200 | 1.200 | 1.200 | 1.200 | 1.091 | -8.3% |" in md


def test_without_modelled_seconds_there_is_no_check():
    t = rows().drop_columns(["modelled_seconds"])
    assert cost_check(t, {"datasets": ["a"], "methods": ["AR"], "tables": {}}) == {}
    assert ratios([None, 1.0], [1.0, 0.0]) == {"ratio": None, "median_ratio": None, "prompts": 0}


# Constructed raw points with a known per-step cost (draft and verify affine in b), a known first-step extra
# (affine in the prompt length) and a known rule cost (affine in the drafted b): the fit must give them back.
DRAFT, VERIFY = (1e-3, 1e-4), (2e-3, 2e-4)
FIRST = {"speculative": (4e-4, 2e-6), "autoregressive": (1e-4, 0.0)}
RULE = (5e-5, 1e-5)
STEPS = 16


def line(p, x):
    return p[0] + p[1] * x


def raw_points(block_sizes=(1, 2, 8, 16), contexts=(64, 256), rule_sizes=(2, 16)):
    out = []
    for rnd in (1, 2, 3):
        for ctx in contexts:
            for b in block_sizes:
                for rule in ([None, TIMING_RULE] if b in rule_sizes else [None]):
                    d = line(DRAFT, b) if b >= 2 else 0.0
                    v = line(VERIFY, b) if b >= 2 else 2.5e-3
                    r = line(RULE, b) if rule else 0.0
                    extra = line(FIRST["speculative" if b >= 2 else "autoregressive"], ctx)
                    # The first step's extra lies in its draft (the pass over the prompt's context features).
                    fd, fv = (d + r + extra, v) if b >= 2 else (0.0, v + extra)
                    out.append({"b": b, "context": ctx, "round": rnd, "steps": STEPS,
                                "draft_seconds": ((STEPS - 1) * (d + r) + fd) / STEPS,
                                "verify_seconds": ((STEPS - 1) * v + fv) / STEPS, "first_draft_seconds": fd,
                                "first_verify_seconds": fv, "rule": rule, "rule_seconds": r})
    return out


def test_the_fit_recovers_a_known_first_step_extra_and_rule_cost():
    p = CostProfile.from_raw(raw_points())
    assert p.version == FORMAT_VERSION == 3
    for k, truth in (("draft", DRAFT), ("verify", VERIFY)):  # steady steps: the first one's extra left out
        assert (p.fit[k]["intercept"], p.fit[k]["slope"]) == pytest.approx(truth)
    assert (p.fit["rule"]["intercept"], p.fit["rule"]["slope"]) == pytest.approx(RULE)
    for kind, truth in FIRST.items():
        assert (p.fit["first_step"][kind]["intercept"], p.fit["first_step"][kind]["slope"]) == pytest.approx(
            truth, abs=1e-12)
    assert p.cost(8) == pytest.approx(line(DRAFT, 8) + line(VERIFY, 8))
    # A decode with a per-step rule at b_max 12 sending 3, 11 and 5 drafted tokens, after a 100-token prompt.
    verified = [3, 11, 5]
    truth = sum(line(DRAFT, 12) + line(RULE, 12) + line(VERIFY, v + 1) for v in verified) + line(
        FIRST["speculative"], 100)
    assert p.decode_seconds(verified, 12, rule=True, context=100) == pytest.approx(truth)
    # Plain decoding at b = 8, its last step cut at max_new_tokens to 4 tokens; and AR.
    assert p.decode_seconds([7, 7, 3], 8, context=100) == pytest.approx(
        2 * p.cost(8) + p.cost(4) + line(FIRST["speculative"], 100))
    assert p.decode_seconds([0] * 5, 1, context=100) == pytest.approx(5 * 2.5e-3 + line(FIRST["autoregressive"],
                                                                                       100))
    assert p.decode_seconds([], 8, context=100) == 0.0
    assert p.step_seconds(12, 11, rule=False) == pytest.approx(p.cost(12))


def test_a_version_3_profile_round_trips_and_a_version_1_profile_still_loads(tmp_path):
    p = CostProfile.from_raw(raw_points(), meta={"device": "cpu"})
    p.save(tmp_path / "cost_profile.json")
    d = json.loads((tmp_path / "cost_profile.json").read_text())
    # Version 3 adds the load grid (pipeline.policy.load_cost); without one it reads as c = 1 at every load.
    assert d["format"] == FORMAT and d["version"] == 3 and "rule" in d["fit"] and "first_step" in d["fit"]
    again = CostProfile.load(tmp_path / "cost_profile.json")
    assert again.raw == p.raw and again.fit == p.fit and again.meta["device"] == "cpu"
    assert again.decode_seconds([3, 11], 12, rule=True, context=80) == p.decode_seconds([3, 11], 12, rule=True,
                                                                                         context=80)
    assert CostProfile.from_raw(again.raw).fit == p.fit  # the kept points refit to the same model
    # Version 1: no first step apart, no rule points; both terms read as 0, and re-saving keeps it version 1.
    v1 = {"format": FORMAT, "version": 1, "device": "cpu", "seconds": {"1": 0.0025, "2": 0.004, "8": 0.005},
          "measured": {}, "spread": {}, "raw": [{"b": 2, "context": 64, "round": 1, "steps": 16,
                                                 "draft_seconds": 0.001, "verify_seconds": 0.003}],
          "fit": {"from_block_size": 2, "draft": {"intercept": 0.001, "slope": 1e-4},
                  "verify": {"intercept": 0.0028, "slope": 1e-4}, "max_rel_residual": 0.0}}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    old = CostProfile.load(tmp_path / "v1.json")
    assert old.version == 1 and old.rule_seconds(12) == 0.0 and old.first_step_seconds(8, 500) == 0.0
    assert old.decode_seconds([7, 7], 8, context=500) == pytest.approx(2 * old.cost(8))
    assert old.decode_seconds([3], 12, rule=True) == pytest.approx(0.001 + 12e-4 + 0.0028 + 4e-4)
    old.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["version"] == 1
    with pytest.raises(ValueError, match="newer"):
        CostProfile.from_dict({**v1, "version": FORMAT_VERSION + 1})
