"""The table `blockpilot run` ends with (pipeline.evaluation.table): its rows agree with evaluate's summary."""

import pytest

from pipeline.evaluation.table import format_rows, headline_rows


def summary(with_rule=True, baseline_is="train_chosen"):
    avg = lambda v: {"a": v, "average": v}  # noqa: E731
    modelled = {"AR": 1.0, "b=8": 1.60, "b=9": 1.55, "b=10": 1.50, "adaptive": 1.62, "policy": 1.55,
                "per-step": 1.61, "oracle": 1.70}
    wall = {k: v * 0.9 for k, v in modelled.items()}
    head = {"baseline_b": 9, "baseline_is": baseline_is, "hindsight_b": 8, "gain": 1.62 / 1.55 - 1,
            "gain_ci95": [0.01, 0.05]}
    s = {"methods": list(modelled), "tables": {"modelled_speedup": {k: avg(v) for k, v in modelled.items()},
                                               "speedup": {k: avg(v) for k, v in wall.items()}},
         "headline": {"modelled": head, "wall": {**head, "gain_ci95": [-0.02, 0.06]},
                      "adaptive_is": "the policy, its fallback b replaced by the per-step rule threshold:0.01"
                      if with_rule else "the policy alone"}}
    if with_rule:
        s["headline"]["per_step"] = {"modelled": {"gain": 1.61 / 1.55 - 1, "gain_ci95": [0.0, 0.07]}}
        s["headline"]["policy_only"] = {"modelled": {"gain": 0.0, "gain_ci95": [0.0, 0.0]}}
    return s


def test_rows_name_the_train_chosen_and_the_hindsight_b_apart_and_agree_with_the_tables():
    rows = headline_rows(summary())
    assert [r["row"] for r in rows] == ["adaptive (policy + rule)", "per-step rule alone", "policy alone",
                                        "train-chosen b=9", "hindsight b=8", "oracle (per prompt)"]
    by = {r["method"]: r for r in rows}
    assert by["adaptive"]["modelled"] == 1.62 and by["adaptive"]["wall"] == pytest.approx(1.62 * 0.9)
    assert by["adaptive"]["gain_ci95"] == [0.01, 0.05]  # the modelled interval, as the column says
    assert by["b=9"]["gain"] == 0 and by["b=8"]["gain"] == pytest.approx(1.60 / 1.55 - 1)
    assert by["oracle"]["gain"] == pytest.approx(1.70 / 1.55 - 1) and by["oracle"]["gain_ci95"] is None
    text = format_rows(rows)
    assert "gain vs train-chosen b=9 (modelled, 95 % CI)" in text.splitlines()[0]
    assert "(baseline)" in text and "+4.52% [+1.00%, +5.00%]" in text


def test_a_hindsight_b_equal_to_the_baseline_still_has_its_row():
    s = summary()
    s["tables"]["modelled_speedup"]["b=9"] = {"a": 1.65, "average": 1.65}
    s["headline"]["modelled"]["hindsight_b"] = 9  # evaluate names it (headline.hindsight_method); rows read it
    rows = headline_rows(s)
    assert "hindsight b=9 (= the baseline)" in [r["row"] for r in rows]
    assert format_rows(rows).count("(baseline)") == 2


def test_without_a_rule_adaptive_is_the_policy_and_a_hindsight_baseline_says_so():
    rows = headline_rows(summary(with_rule=False, baseline_is="hindsight"))
    assert [r["row"] for r in rows][:2] == ["adaptive (the policy alone)", "baseline (hindsight) b=9"]
    assert headline_rows({"methods": [], "tables": {}, "headline": {}}) == [] and format_rows([]) == ""


def test_run_leaves_tune_out_at_t_above_0_before_any_stage_runs():
    """At T > 0 tune would refuse after label and train had run; run decides up front and says why in one line."""
    from pipeline.runtime.config import load_config
    from stages.run import ORDER, skipped

    hot = load_config(["decode.temperature=1.0", "label.mode=exhaustive"])
    assert [n for n in ORDER if skipped(hot, n)] == ["tune"]
    assert "decode.temperature=1.0" in skipped(hot, "tune")
    assert not any(skipped(load_config([]), n) for n in ORDER)
    assert skipped(load_config(["evaluate.per_step=false"]), "tune") == "evaluate.per_step is false"
