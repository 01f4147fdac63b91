"""evaluate's summary as text: summary.md (the tables and the headline), summary.csv, the results card and the
line the stage logs."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from pipeline.data.schemas import RESULT_COLUMNS
from pipeline.evaluation.headline import TRAIN_CHOSEN



def _fmt(v: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def _has_values(s: Dict[str, Any], metric: str) -> bool:
    """Whether the summary's table ``metric`` exists and holds a value (``lossless`` is all null at T > 0)."""
    return any(v is not None for vals in s["tables"].get(metric, {}).values() for v in vals.values())


def render_markdown(s: Dict[str, Any]) -> str:
    cols = [*s["datasets"], "average"]
    out = ["# Evaluation", "",
           f"Prompts per dataset: {s['prompts']}. Candidates {s['candidates']}; policy latency "
           f"{_fmt(s['policy_ms_mean'], 3)} ms vs prefill {_fmt(s['prefill_ms_mean'], 3)} ms (mean). "
           f"The policy's choices (action: prompts): {s['adaptive_choices']}; adaptive decoded "
           f"{s.get('adaptive_rule_rows', 0)} of them with a per-step rule (a rule action of the policy's, or the "
           "tuned rule where the policy answered its fallback b).", ""]
    for metric, title, suffix in (("tau", "Acceptance length tau (tokens per verify step)", ""),
                                  ("speedup", "Speedup vs autoregressive (ratio of mean time per output token)", "x"),
                                  ("modelled_speedup", "Modelled speedup vs autoregressive (steps x profiled step "
                                   "cost; deterministic at T = 0)", "x"),
                                  ("lossless", "Share of prompts whose output equals autoregressive output", "")):
        out += [f"## {title}", "", "| method | " + " | ".join(cols) + " |",
                "| --- |" + " ---: |" * len(cols)]
        if not _has_values(s, metric):
            out = out[:-4]
            continue
        for m in s["methods"]:
            vals = s["tables"][metric].get(m, {})
            out.append(f"| {m} | " + " | ".join(_fmt(vals.get(c), 3, suffix) for c in cols) + " |")
        out.append("")
    headline = s.get("headline", {})
    sections = [(kind, "adaptive", headline[kind]) for kind in ("modelled", "wall") if kind in headline]
    for key in ("policy_only", "per_step"):  # adaptive's two parts apart: the policy alone, the tuned rule alone
        if key in headline:
            name = headline[key]["method"] + (f" ({headline[key]['rule']})" if headline[key]["rule"] else "")
            sections += [(kind, name, headline[key][kind]) for kind in ("modelled", "wall") if kind in headline[key]]
    for kind, name, h in sections:
        against = (f"the best fixed b chosen on the label set's train split (b={h['baseline_b']}), the "
                   "hindsight-fastest fixed b" if h["baseline_is"] == TRAIN_CHOSEN else
                   f"the hindsight-fastest fixed b (b={h['baseline_b']}; the train-chosen b was not evaluated)")
        out += [f"## Headline ({kind}): {name} vs {against} and the oracle; gain with its 95 % bootstrap interval "
                "over prompts", "",
                f"| set | {name} | best fixed | hindsight fixed | oracle | oracle headroom | gain [95 % CI] | "
                "share of the oracle's gain |", "| --- |" + " ---: |" * 7]
        for ds, v in [*h["per_set"].items(), ("average", h)]:
            hind = h["hindsight"] if ds == "average" else s["tables"][
                "modelled_speedup" if kind == "modelled" else "speedup"][f"b={v['hindsight_b']}"][ds]
            cap = "-" if v["oracle_gain_captured"] is None else f"{v['oracle_gain_captured']:.0%}"
            out.append(f"| {ds} | {v['adaptive']:.3f}x | {v['baseline']:.3f}x | b={v['hindsight_b']} "
                       f"{hind:.3f}x | {v['oracle']:.3f}x | {v['oracle_headroom']:+.1%} | {v['gain']:+.2%} "
                       f"[{v['gain_ci95'][0]:+.2%}, {v['gain_ci95'][1]:+.2%}] | {cap} |")
        out.append("")
    avr = headline.get("adaptive_vs_per_step")
    if avr:
        out += ["## What the per-request policy adds to the per-step rule (modelled; adaptive vs the rule alone, "
                "95 % paired bootstrap interval)", "", "| set | gain [95 % CI] |", "| --- | ---: |"]
        out += [f"| {ds} | {v['gain']:+.2%} [{ci[0]:+.2%}, {ci[1]:+.2%}] |"
                for ds, v, ci in [*((d, p, p["ci95"]) for d, p in avr["per_set"].items()),
                                  ("average", avr, avr["gain_ci95"])]]
        out.append("")
    if s.get("adaptive_choices_per_set"):
        out += ["## What the policy chose per set (action: prompts)", "", "| set | choices |", "| --- | --- |"]
        out += [f"| {ds} | " + ", ".join(f"{b}: {n}" for b, n in c.items()) + " |"
                for ds, c in s["adaptive_choices_per_set"].items()]
        out.append("")
    out += render_rules(headline)
    out += render_distribution(s.get("distribution") or {}, s.get("samples", 1))
    out += render_cost_model(s.get("cost_model") or {})
    if s.get("folded_policy"):
        f = s["folded_policy"]
        out += [f"Folded policy (reads the final hidden state): same choice as the policy on logits on {f['agree']} "
                f"of {f['prompts']} prompts.", ""]
    if s.get("comparisons"):
        out += ["## Adaptive against a fixed block size (wall-clock gain, 95 % bootstrap interval over prompts)", "",
                "| against | chosen on | " + " | ".join(cols) + " |", "| --- | --- |" + " ---: |" * len(cols)]
        for c in s["comparisons"]:
            cells = [f"{c[ds]['gain']:+.1%} [{c[ds]['ci95'][0]:+.1%}, {c[ds]['ci95'][1]:+.1%}]" for ds in cols]
            out.append(f"| {c['against']} | {c['chosen_on']} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def render_rules(headline: Dict[str, Any]) -> List[str]:
    """summary.md's table of the per-step rules decoded apart against the per-step oracle (modelled), and the
    learned rule against the threshold rule with its interval."""
    rules = headline.get("rules") or {}
    if not rules:
        return []
    base = headline["modelled"]["baseline_b"]
    first = next(iter(rules.values()))
    out = ["## Per-step rules against the per-step oracle (modelled)", "",
           f"Gain over the train-chosen b={base} with its 95 % interval; the per-step oracle (the best verify length "
           f"at each step in hindsight, from each prompt's trace) is {_fmt(first['per_step_oracle'], 3, 'x')} "
           f"({_fmt(first['per_step_oracle_gain'] and 100 * first['per_step_oracle_gain'], 2, ' %')} over the "
           "fixed b).", "",
           "| method | rule | modelled speedup | gain [95 % CI] | share of the per-step oracle's gain |",
           "| --- | --- | ---: | ---: | ---: |"]
    for m, r in rules.items():
        cap = "-" if r["oracle_gain_captured_per_step"] is None else f"{r['oracle_gain_captured_per_step']:.0%}"
        out.append(f"| {m} | `{r['rule']}` | {r['modelled_speedup']:.3f}x | {r['gain']:+.2%} "
                   f"[{r['gain_ci95'][0]:+.2%}, {r['gain_ci95'][1]:+.2%}] | {cap} |")
    lvt = headline.get("learned_vs_threshold")
    if lvt:
        out += ["", f"Learned (`{lvt['learned']}`) against threshold (`{lvt['threshold']}`), modelled: "
                f"{lvt['gain']:+.2%} [{lvt['gain_ci95'][0]:+.2%}, {lvt['gain_ci95'][1]:+.2%}] over "
                f"{lvt['prompts']} prompts."]
    return out + [""]


def render_distribution(d: Dict[str, Any], samples: int) -> List[str]:
    """summary.md's check of the outputs at T > 0 (pipeline.evaluation.distribution); none at T = 0."""
    if not d:
        return []
    out = ["## Output distribution at T > 0: every token against the target's own sampling distribution", "",
           f"Each row pools {samples} sampled draw(s) per prompt. The randomized PIT of every generated token under "
           "the target's distribution at its prefix is Uniform(0, 1) exactly when a method samples as the target "
           f"does; chi-square over {d['bins']} equal bins, a method fails below p = {d['alpha']}. "
           + ("Every method passes." if d["all_pass"] else f"FAILING: {', '.join(d['failing'])}."), "",
           "| method | tokens | chi2 | p-value | passes |", "| --- | ---: | ---: | ---: | --- |"]
    for m, v in d["methods"].items():
        p = "-" if v["p_value"] is None else f"{v['p_value']:.3g}"
        out.append(f"| {m} | {v['tokens']} | {_fmt(v['chi2'], 1)} | {p} | "
                   f"{'-' if v['passes'] is None else ('yes' if v['passes'] else 'NO')} |")
    return out + [""]


def render_cost_model(c: Dict[str, Any]) -> List[str]:
    """summary.md's table of pipeline.evaluation.cost_check: modelled / measured decode seconds per method (none
    without a cost profile)."""
    if not c:
        return []
    sets = c["datasets"]

    def pct(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:+.1%}"

    out = ["## Cost model against wall clock: modelled / measured decode seconds", "",
           "Per set and averaged: sum over prompts of modelled seconds / sum of measured ones; the median "
           "per-prompt ratio; the ratio over AR's (what a speedup sees); the modelled speedup's error against "
           f"the wall speedup. Mean over methods: |ratio - 1| {pct(c['mean_abs_ratio_error'])}, |speedup error| "
           f"{pct(c['mean_abs_speedup_error'])}.", "",
           "| method | " + " | ".join(sets) + " | average | median per prompt | over AR | speedup error |",
           "| --- |" + " ---: |" * (len(sets) + 4)]
    for m, v in c["methods"].items():
        if v:
            a = v["average"]
            out.append(f"| {m} | " + " | ".join(_fmt(v.get(ds, {}).get("ratio"), 3) for ds in sets) +
                       f" | {_fmt(a['ratio'], 3)} | {_fmt(a['median_ratio'], 3)} | {_fmt(a['ratio_vs_ar'], 3)} | "
                       f"{pct(a['speedup_error'])} |")
    return out + [""]


def render_csv(s: Dict[str, Any]) -> str:
    cols = [*s["datasets"], "average"]
    lines = ["metric,method," + ",".join(cols)]
    for metric in ("tau", "speedup", "modelled_speedup"):
        if not _has_values(s, metric):
            continue
        for m in s["methods"]:
            vals = s["tables"][metric].get(m, {})
            lines.append(f"{metric},{m}," + ",".join("" if vals.get(c) is None else f"{vals[c]:.4f}" for c in cols))
    return "\n".join(lines) + "\n"


def results_card(methods: Sequence[str]) -> str:
    rows = "\n".join(f"| `{n}` | `{t}` | {doc} |" for n, t, doc in RESULT_COLUMNS)
    return (f"# BlockPilot evaluation results\n\nOne row per prompt x method ({', '.join(methods)}); "
            "`results.parquet` holds every shard's rows, `summary.md` / `summary.csv` the tables.\n\n"
            f"| column | type | meaning |\n| --- | --- | --- |\n{rows}\n")


def summary_lines(summary: Dict[str, Any], methods: Sequence[str]) -> List[str]:
    speed = summary["tables"]["speedup"]
    out = ["average speedup vs AR: " + ", ".join(
        f"{m} {_fmt(speed[m].get('average'), 2, 'x')}" for m in methods) + " (tables: summary.md)"]
    d = summary.get("distribution")
    if d:
        worst = min((v["p_value"] for v in d["methods"].values() if v["p_value"] is not None), default=None)
        out.append(f"output distribution vs the target's ({summary.get('samples', 1)} draws a prompt): "
                   + ("every method passes" if d["all_pass"] else f"FAILING {', '.join(d['failing'])}")
                   + f" (lowest p {_fmt(worst, 3)}, fails below {d['alpha']})")
    return out
