"""deploy's context-length form keeps every load's own verdict (issue 68, point 5): a tie at c = 4 leaves no
speculation at c = 4 alone; c = 8 (never timed) keeps the model's answer and c = 16 (b = 5 kept) speculates, in the
words and in the 5-item JSON, as in the 3-item schedule."""

from __future__ import annotations

import json

from pipeline.evaluation import deploy
from pipeline.evaluation.context_length import context_ranges, context_table, decide

from test_context_length import CANDS, cost_at, synthetic


def _deploy():
    x, tau = synthetic([0.9, 0.75, 0.5, 0.02])
    model = {1: 4, 4: 4, 8: 4, 16: 6}
    check = {"model_schedule": {str(c): b for c, b in model.items()}, "min_gain": 0.0,
             "loads": {"4": {"b": 4, "verdict": "tie", "kept": False, "serve": 1, "why": "a tie", "prompts": 64,
                             "repeats": 8},
                       "16": {"b": 6, "verdict": "kept", "kept": True, "serve": 6, "why": "kept", "prompts": 64,
                              "repeats": 3}},
             "inherited": {}, "unmeasured": [8]}
    from pipeline.evaluation.load_check import checked_schedule

    schedule = checked_schedule(model, check["loads"])
    assert schedule == {1: 4, 4: 1, 8: 4, 16: 6}  # the 3-item form: each load its own
    tables = {c: context_table(x, tau, CANDS, cost=cost_at(0.05), base_b=schedule[c]) for c in schedule}
    decide(list(tables.values()))
    assert all(t.varies for t in tables.values())  # the buckets would change K at every load
    return deploy.Deploy(run_dir="run", block_size=4, chosen_on="", train_b=4, target="t", draft="d", draft_note=None,
                         draft_revision=None, trust_remote_code=False, candidates=CANDS, rule_actions=[],
                         policy_answers_fallback_only=False, step_rule=None, schedule=schedule, context=tables,
                         load_check=check)


def test_a_tie_at_4_and_a_kept_b_at_16_give_one_answer_per_load():
    d = _deploy()
    assert d.no_speculation_at == [4]
    lines = deploy.context_lines(d)
    said = {c: next(x for x in lines if x.startswith(f"- c={c}: ")) for c in (4, 8, 16)}
    assert "Served: K = 0 in every length bucket, as tune's load check measured at this load" in said[4]
    assert "Served: K = 0" not in said[8] and "Served: K = 0" not in said[16]  # never measured / kept
    entries = json.loads(lines[lines.index("```json") + 1])
    assert entries == context_ranges(d.context, no_speculation_at=[4], served=d.schedule)

    def ks(c):
        return {e[4] for e in entries if e[0] <= c <= e[1]}

    assert ks(4) == {0}  # the tie: K = 0 in every bucket there
    assert ks(16) != {0} and max(ks(16)) > 0  # kept b = 5 at c = 16: it speculates, as the 3-item form does
    assert max(ks(8)) > 0  # not measured: the model's buckets
    three = deploy.vllm_schedule_config(d)["num_speculative_tokens_per_batch_size"]
    assert [r for r in three if r[0] <= 4 <= r[1]][0][2] == 0 and [r for r in three if r[0] <= 16 <= r[1]][0][2] == 5
    # the 3-item lines do not call c = 16 (kept) or c = 8 (unmeasured) a measured K = 0 either
    text = "\n".join(deploy.load_lines(d))
    assert "K = 0 at c in [" not in text or "16" not in text.split("K = 0 at c in [")[1].split("]")[0]


def test_a_load_the_monotone_fit_covers_says_so():
    d = _deploy()
    d.load_check = {**d.load_check, "inherited": {"16": "above c=4"}, "loads": {"4": d.load_check["loads"]["4"]}}
    d.schedule = {1: 4, 4: 1, 8: 4, 16: 1}
    assert d.no_speculation_at == [4, 16]
    line = next(x for x in deploy.context_lines(d) if x.startswith("- c=16: "))
    assert "monotone fit" in line and "not timed at this load" in line
