"""tune's load check: is b*(c) measured faster than not speculating at c, on the label set's own held-out prompts?

b*(c) is chosen by the cost model (pipeline.policy.load_cost.schedule), and at high load it sits on a knife edge: on
the default run six profiles put the c = 16 ratio of b = 4's step to AR's at 2.57-3.20 against a break-even of 2.80,
so b*(16) came out 4 in four runs and 1 in two, and where it was 4, AR was the faster method on the evaluation
prompts (adaptive against AR -8.91 % [-16.49, -0.99], benchmarks/results/default-run-2026-12-04.md). The model's
error there (5-8 %) is larger than the margin it decides on. So at each evaluated load where b*(c) speculates, the
check times b*(c) against AR in lockstep (pipeline.evaluation.load.evaluate_at_load) on the first
``tune.load_prompts`` val prompts of the label set (never the evaluation sets), over the steps with every row running
(the steady state b*(c) models and a server with more requests than slots runs): b*(c) is kept only when the lower
end of the paired 95 % interval of its gain is above ``tune.load_min_gain``; otherwise that load, and every larger one
of the schedule's grid, gets b = 1 (K = 0): speculating only gets relatively dearer as the batch grows. A load
b*(c) already leaves unspeculated is not checked (the check only takes speculation away). Ray-free.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from pipeline.evaluation.load import evaluate_at_load, paired_ratio

CHECK_DOC = """
## `load_check.json`: b*(c) against no speculation, measured (tune.load_prompts, tune.load_repeats)

b*(c), the cost model's fixed b at each load, timed against AR in lockstep on the first `tune.load_prompts` val
prompts of the label set, at each c > 1 of `evaluate.concurrency` where b*(c) > 1. evaluate (b*(c), the policy's
fallback at c, no per-step rule where b = 1) and deploy (vLLM's schedule, K = 0 from the first load not kept on)
read the schedule it leaves (`schedule`).

| key | meaning |
| --- | --- |
| `fingerprint` | the policy, the cost profile, the prompts and the settings it was measured with (a rerun with the same keeps it) |
| `where` | the device and Ray node of the one task that timed it |
| `model_schedule` | `{c: b}`: b*(c) as train chose it by the cost model |
| `schedule` | `{c: b}`: what the check leaves: b*(c), or 1 at a load not kept and every larger one |
| `loads` | `{c: {b, kept, why, full_steps, whole_run, per_repeat, prompts, repeats}}` per checked c: `full_steps` and `whole_run` the measured gain of b over AR (`gain`, paired 95 % `ci95` over the repeats) over the steps with all c rows running and over the whole run; `per_repeat` `{AR, b=N: {throughput, full_throughput}}` tokens per second in each repeat; `kept` whether `full_steps.ci95[0]` > `min_gain` |
| `min_gain` | `tune.load_min_gain` |
"""


def check_at(batched, prompts: List[List[int]], c: int, b: int, repeats: int, max_new_tokens: int, load_cost=None,
             seed: int = 0, max_engines: Optional[int] = None, min_gain: float = 0.0,
             log: Callable[[str], None] = lambda s: None, **sampling) -> Dict[str, Any]:
    """b against AR at c: both decoded in lockstep every repeat; the verdict on the full steps' paired interval."""
    spec = f"b={b}"  # every request at b (the choosers of pipeline.decoding.batched.fixed, a layer above this one)
    choosers = {"AR": lambda i, logits, hidden: (1, None), spec: lambda i, logits, hidden: (int(b), None)}
    rows = evaluate_at_load(batched, prompts, c, choosers, ["AR", spec], repeats,
                            max_new_tokens, load_cost, seed, log=log, max_engines=max_engines, **sampling)
    by = {m: sorted((r for r in rows if r["method"] == m), key=lambda r: r["repeat"]) for m in ("AR", spec)}
    whole = paired_ratio([r["throughput"] for r in by[spec]], [r["throughput"] for r in by["AR"]])
    full = None
    if all(r["full_throughput"] for r in by[spec] + by["AR"]):
        full = paired_ratio([r["full_throughput"] for r in by[spec]], [r["full_throughput"] for r in by["AR"]])
    kept, why = decide(full, whole, min_gain, c, len(prompts))
    per_repeat = {m: {k: [r[k] for r in by[m]] for k in ("throughput", "full_throughput")} for m in by}
    return {"b": int(b), "kept": kept, "why": why, "full_steps": full, "whole_run": whole,
            "prompts": len(prompts), "repeats": int(repeats), "per_repeat": per_repeat, "rows": rows}


def decide(full: Optional[Dict[str, Any]], whole: Dict[str, Any], min_gain: float, c: int,
           prompts: int) -> tuple:
    """(kept, why): kept only when the full steps' lower 95 % bound clears ``min_gain``; with no full step at all
    (fewer prompts than c), the whole run's bound decides."""
    got, over = (full, "full steps") if full is not None else (whole, f"the whole run ({prompts} prompts < c={c})")
    ci = got.get("ci95")
    if ci is None:
        return False, f"no interval over {over} (one repeat): not speculating unless measured faster"
    verdict = ci[0] > min_gain
    return verdict, (f"measured {got['gain']:+.2%} [{ci[0]:+.2%}, {ci[1]:+.2%}] against AR over {over}: lower "
                     f"bound {'above' if verdict else 'not above'} {min_gain:+.2%}")


def checked_schedule(model: Dict[int, int], loads: Dict[Any, Dict[str, Any]]) -> Dict[int, int]:
    """The schedule the check leaves: b*(c), or 1 from the smallest load not kept on (larger loads included, checked
    or not)."""
    dropped = [int(c) for c, v in loads.items() if not v["kept"]]
    first = min(dropped) if dropped else None
    return {int(c): (1 if first is not None and int(c) >= first else int(b)) for c, b in sorted(model.items())}


def check_lines(check: Dict[str, Any]) -> List[str]:
    """What tune says about the check, one line per checked load."""
    if not check.get("loads"):
        return [f"load check: nothing to check ({check.get('skipped', 'b*(c) = 1 at every evaluated load')})"]
    out = []
    for c, v in sorted(check["loads"].items(), key=lambda kv: int(kv[0])):
        out.append(f"load check c={c}: b={v['b']} {'kept' if v['kept'] else 'dropped: K = 0 from here on'}, "
                   f"{v['why']} ({v['prompts']} val label prompts, {v['repeats']} repeats)")
    return out


def loads_to_check(model: Dict[int, int], evaluated: Sequence[int]) -> List[int]:
    """The evaluated loads c > 1 of the schedule where b*(c) speculates."""
    return [int(c) for c in evaluated if int(c) > 1 and model.get(int(c), 1) > 1]


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
