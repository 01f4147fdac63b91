"""tune's load check: is b*(c) measured faster than not speculating at c, on the label set's own held-out prompts?

b*(c) is chosen by the cost model (pipeline.policy.load_cost.schedule), and at high load it sits on a knife edge: on
the default run six profiles put the c = 16 ratio of b = 4's step to AR's at 2.57-3.20 against a break-even of 2.80,
so b*(16) came out 4 in four runs and 1 in two, and where it was 4, AR was the faster method on the evaluation
prompts (adaptive against AR -8.91 % [-16.49, -0.99], benchmarks/results/default-run-2026-12-04.md). The model's
error there (5-8 %) is larger than the margin it decides on. So at each evaluated load where b*(c) speculates, the
check times b*(c) against AR in lockstep (pipeline.evaluation.load.evaluate_at_load) on the first
``tune.load_prompts`` val prompts of the label set (never the evaluation sets), over the steps with every row running
(the steady state b*(c) models and a server with more requests than slots runs), repeat after repeat until the
paired interval settles a verdict (pipeline.evaluation.sequential): **kept**, **dropped** (measured slower) or a
**tie** (too close to call within ``tune.load_tie``, or the cap reached), which serves the cheaper choice, no
speculation. Before K = 0 at a load, b = 2 and then 3 are timed there the same way (stages.load_check), and the
first kept is served.

Each load is decided by its own evidence. A load of the schedule's grid the check did not time keeps the model's
b*(c), unless it lies above every checked load, two or more loads were checked, their measured gains fall as c
grows (the monotone fit) and the largest was not kept: then it gets K = 0 too, and the check says so
(``inherited``). A load b*(c) already leaves unspeculated is not checked (the check only takes speculation away).
Ray-free.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence

from pipeline.evaluation.load import evaluate_at_load, paired_ratio
from pipeline.evaluation.sequential import DROPPED, KEPT, TIE, SequentialRule

CHECK_DOC = """
## `load_check.json`: b*(c) against no speculation, measured (tune.load_prompts, tune.load_repeats to tune.load_max_repeats)

b*(c), the cost model's fixed b at each load, timed against AR in lockstep on the first `tune.load_prompts` val
prompts of the label set, at each c > 1 of `evaluate.concurrency` where b*(c) > 1 (with `tune.load_loads=changes`
also at each grid point where b*(c) changes), repeat after repeat until a verdict, while each worker's part is within
`tune.load_budget_s`. evaluate (the schedule at c, the policy's fallback at c, no per-step rule where b = 1) and deploy (vLLM's
schedule, K = 0 where the check serves b = 1) read the schedule it leaves (`schedule`).

| key | meaning |
| --- | --- |
| `fingerprint` | the policy, the cost profile, the prompts and the settings it was measured with (a rerun with the same keeps it) |
| `where` | the device and Ray node of the one task that timed it |
| `model_schedule` | `{c: b}`: b*(c) as train chose it by the cost model |
| `schedule` | `{c: b}`: what the check leaves: `serve` at a checked load, K = 0 at an `inherited` one, else b*(c) |
| `loads` | `{c: {...}}` per checked c, below |
| `inherited` | `{c: why}`: unchecked loads given K = 0 by the monotone fit over the checked ones (module docstring) |
| `unmeasured` | unchecked loads of the grid that keep the model's b*(c) |
| `over_budget` | loads to check that no worker reached within `tune.load_budget_s` (among `unmeasured` unless inherited) |
| `seconds` | the check's time: the sum of its loads' `seconds` (workers' parts run side by side on GPUs) |
| `min_gain` | `tune.load_min_gain`: the threshold the intervals are held against |

Per checked load (`loads[c]`): `b` (b*(c)); `verdict` (`kept`, `dropped`: the interval's upper end below `min_gain`,
or `tie`); `kept` (verdict is kept); `why` (the verdict in words); `repeats` (the repeats taken, from
`tune.load_repeats` up to `tune.load_max_repeats`); `interval` (`gain`, `ci` at `level` per look, `half_width` of the
log ratio, over `over`: the full steps of the window b and AR shared in lockstep, each run's full steps when they ran
one after the other, or the whole run where a repeat had no full step); `engines_at_once` (2: b
and AR in lockstep; 1: the memory plan fits one engine, so they ran one after the other) and `timing` (its words);
`full_steps`, `whole_run` (the measured gain with a 95 % `ci95` over the repeats, for reading beside evaluate);
`per_repeat` (`{AR, b=N: {window_throughput, full_throughput, throughput}}` tokens per second in each repeat); `small_b` (where b*(c)
was not kept: b = 2 and 3 checked the same way, each with these keys); `serve` (the b the check leaves there: b*(c)
kept, else the first small b kept, else 1); `prompts`; `seconds` (this load's timing, its small b included).
"""


OVER = {"window_throughput": "the full steps of the window both shared in lockstep",
        "full_throughput": "full steps", "throughput": "the whole run"}


def _ratios(rows: List[Dict[str, Any]], spec: str):
    """The paired log ratios of b over AR per repeat: over the window of full steps both shared in lockstep
    (pipeline.evaluation.load.window_throughputs) where every repeat had one; else over each run's full steps (one
    engine at a time); else over the whole run (fewer prompts than c)."""
    by = {m: sorted((r for r in rows if r["method"] == m), key=lambda r: r["repeat"]) for m in ("AR", spec)}
    n = min(len(by["AR"]), len(by[spec]))
    pairs = list(zip(by[spec][:n], by["AR"][:n]))
    key = next((k for k in OVER if pairs and all(a.get(k) and b.get(k) for a, b in pairs)), "throughput")
    return [math.log(a[key] / b[key]) for a, b in pairs], OVER[key], by


def check_at(batched, prompts: List[List[int]], c: int, b: int, rule: SequentialRule, max_new_tokens: int,
             load_cost=None, seed: int = 0, max_engines: Optional[int] = None, min_gain: float = 0.0,
             log: Callable[[str], None] = lambda s: None, **sampling) -> Dict[str, Any]:
    """b against AR at c, decoded in lockstep each repeat, repeats added until ``rule`` settles a verdict."""
    spec = f"b={b}"  # every request at b (the choosers of pipeline.decoding.batched.fixed, a layer above this one)
    choosers = {"AR": lambda i, logits, hidden: (1, None), spec: lambda i, logits, hidden: (int(b), None)}
    rows = evaluate_at_load(batched, prompts, c, choosers, ["AR", spec], rule.max_repeats, max_new_tokens,
                            load_cost, seed, log=log, max_engines=max_engines,
                            until=lambda got: rule.verdict(_ratios(got, spec)[0], min_gain) is not None, **sampling)
    d, over, by = _ratios(rows, spec)
    verdict = rule.verdict(d, min_gain) or TIE
    interval = {**rule.interval(d), "over": over}
    whole = paired_ratio([r["throughput"] for r in by[spec]], [r["throughput"] for r in by["AR"]])
    full = None
    if all(r["full_throughput"] for r in by[spec] + by["AR"]):
        full = paired_ratio([r["full_throughput"] for r in by[spec]], [r["full_throughput"] for r in by["AR"]])
    engines = max(1, min(max_engines or 2, 2))
    per_repeat = {m: {k: [r.get(k) for r in by[m]] for k in OVER} for m in by}
    return {"b": int(b), "verdict": verdict, "kept": verdict == KEPT,
            "why": explain(verdict, interval, rule, min_gain, c, len(prompts)), "repeats": len(d),
            "interval": interval, "engines_at_once": engines,
            "timing": "in lockstep" if engines == 2 else "one after the other (the memory plan fits one engine)",
            "full_steps": full, "whole_run": whole, "prompts": len(prompts), "per_repeat": per_repeat, "rows": rows}


def explain(verdict: str, interval: Dict[str, Any], rule: SequentialRule, min_gain: float, c: int,
            prompts: int) -> str:
    lo, hi = interval["ci"]
    over = interval["over"] + (f" ({prompts} prompts < c={c})" if interval["over"] == "the whole run" else "")
    said = (f"measured {interval['gain']:+.2%} [{lo:+.2%}, {hi:+.2%}] ({interval['level']:.0%} per look) against AR "
            f"over {over} in {interval['repeats']} repeats")
    if verdict == KEPT:
        return f"{said}: lower end above {min_gain:+.2%}"
    if verdict == DROPPED:
        return f"{said}: upper end below {min_gain:+.2%}"
    if interval["half_width"] <= rule.tie:
        return f"{said}: a tie (half-width {interval['half_width']:.2%} within tune.load_tie {rule.tie:.2%})"
    return f"{said}: a tie (no verdict within tune.load_max_repeats {rule.max_repeats})"


def served(v: Dict[str, Any]) -> int:
    """The b a checked load leaves (``serve``; a check written before it had one: b if kept, else 1)."""
    return int(v["serve"]) if "serve" in v else (int(v["b"]) if v["kept"] else 1)


def inherited(model: Dict[int, int], loads: Dict[Any, Dict[str, Any]]) -> Dict[int, str]:
    """{c: why} for the unchecked loads above every checked one that the monotone fit gives K = 0 (module
    docstring): two or more checked loads, their gains not rising with c, the largest not served speculation."""
    checked = sorted(int(c) for c in loads)
    if len(checked) < 2 or any("interval" not in loads[str(c)] for c in checked):
        return {}
    gains = [loads[str(c)]["interval"]["gain"] for c in checked]
    top = checked[-1]
    if any(g2 > g1 for g1, g2 in zip(gains, gains[1:])) or served(loads[str(top)]) != 1:
        return {}
    why = (f"above c={top}, where K = 0 was measured; the gains at c={checked} ("
           + ", ".join(f"{g:+.1%}" for g in gains) + ") fall as c grows")
    return {c: why for c, b in model.items() if c > top and b > 1}


def checked_schedule(model: Dict[int, int], loads: Dict[Any, Dict[str, Any]]) -> Dict[int, int]:
    """The schedule the check leaves: each checked load's own verdict (:func:`served`), K = 0 at the loads the
    monotone fit covers (:func:`inherited`), b*(c) elsewhere."""
    out = {int(c): int(b) for c, b in sorted(model.items())}
    for c, v in loads.items():
        out[int(c)] = served(v)
    for c in inherited(out, {str(k): v for k, v in loads.items()}):
        out[c] = 1
    return out


SUMMARY_KEYS = ("b", "verdict", "kept", "serve", "why", "prompts", "repeats", "engines_at_once", "timing", "small_b",
                "seconds")


def summary_of(check: Dict[str, Any]) -> Dict[str, Any]:
    """What tune's summary keeps of load_check.json: enough for :func:`check_lines` (its closing lines)."""
    return {"schedule": check["schedule"], "skipped": check.get("skipped"),
            "inherited": check.get("inherited") or {}, "unmeasured": check.get("unmeasured") or [],
            "over_budget": check.get("over_budget") or [], "seconds": check.get("seconds"),
            "loads": {c: {k: v.get(k) for k in SUMMARY_KEYS} for c, v in check["loads"].items()}}


def check_lines(check: Dict[str, Any]) -> List[str]:
    """What tune says about the check, one line per checked load."""
    if not check.get("loads"):
        return [f"load check: nothing to check ({check.get('skipped', 'b*(c) = 1 at every evaluated load')})"]
    out = []
    for c, v in sorted(check["loads"].items(), key=lambda kv: int(kv[0])):
        verdict = v.get("verdict", KEPT if v["kept"] else DROPPED)
        small = "".join(f"; b={s['b']} {s.get('verdict', '')}" for s in v.get("small_b", []))
        out.append(f"load check c={c}: b={v['b']} {verdict}{small}: serves "
                   f"{'no speculation' if served(v) == 1 else f'b={served(v)}'} ({v['why']}; {v['prompts']} val label "
                   f"prompts, {v.get('timing', 'in lockstep')}"
                   + (f", {v['seconds']:.1f} s" if v.get("seconds") is not None else "") + ")")
    for c, why in sorted((check.get("inherited") or {}).items(), key=lambda kv: int(kv[0])):
        out.append(f"load check c={c}: not timed, K = 0 ({why})")
    if check.get("unmeasured"):
        out.append(f"load check: c in {check['unmeasured']} not timed: the model's b*(c) stands there"
                   + (f" (c in {check['over_budget']}: past tune.load_budget_s)" if check.get("over_budget") else ""))
    if check.get("seconds") is not None:
        out.append(f"load check: {check['seconds']:.1f} s of timing over {len(check['loads'])} load(s)")
    return out


def loads_to_check(model: Dict[int, int], evaluated: Sequence[int], which: str = "evaluated") -> List[int]:
    """The loads c > 1 where b*(c) speculates, in increasing c: the evaluated ones (tune.load_loads=evaluated), and
    with ``changes`` also every grid point of the schedule where b*(c) differs from the point before it (where a
    3-item range starts: a server's K changes there)."""
    loads = {int(c) for c in evaluated}
    if which == "changes":
        cs = sorted(int(c) for c in model)
        loads |= {c for prev, c in zip(cs, cs[1:]) if model[c] != model[prev]}
    return sorted(c for c in loads if c > 1 and model.get(c, 1) > 1)


def check_for(path, model: Dict[int, int]) -> Optional[Dict[str, Any]]:
    """tune's load check at ``path`` when it was measured for ``model`` (train's b*(c)); None without one, or for
    one made for another schedule (a policy trained again since: said, and ignored)."""
    import json

    from pipeline.runtime.log import get as log

    if not path.is_file():
        return None
    check = json.loads(path.read_text())
    if {int(c): int(b) for c, b in check["model_schedule"].items()} != dict(model):
        log("tune").warning(f"{path} was measured for another schedule ({check['model_schedule']}, not {model}): "
                            "ignored; run `blockpilot tune` again")
        return None
    return check


def read_checked(path, model: Dict[int, int]) -> Dict[int, int]:
    """The schedule a reader runs: ``model`` as the load check at ``path`` left it (:func:`check_for`), else itself."""
    check = check_for(path, model)
    return dict(model) if check is None else checked_schedule(model, check["loads"])
