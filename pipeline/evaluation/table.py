"""The one small table a run ends with: each method's speedup over autoregressive decoding, modelled and wall
clock, and its gain over the train-chosen fixed b, all read from evaluate's summary so that the rows agree.

Rows: adaptive (the policy with the tuned rule in place of its fallback b), the rule alone, the policy alone, the
train-chosen b (the baseline), the hindsight b (the fastest fixed b on these very prompts: a bound, not a choice
a user could make) and the per-prompt oracle. Speedups are averages over the evaluation sets; the gain is on the
modelled speedup when there is one (steps x the profiled step cost), else on wall clock, with its 95 % paired
bootstrap interval where evaluate computed one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from pipeline.evaluation.methods import PER_STEP, POLICY_ONLY

MODELLED, WALL = "modelled_speedup", "speedup"


def _average(tables: Dict[str, Any], metric: str, method: str) -> Optional[float]:
    return (tables.get(metric) or {}).get(method, {}).get("average")


def headline_rows(summary: Dict[str, Any]) -> List[Dict[str, Any]]:
    """[{row, method, modelled, wall, gain, gain_ci95}] from an evaluate ``summary.json``; gain is over the
    baseline b (``headline.*.baseline_b``: the train-chosen b, or the hindsight b where that was not evaluated)."""
    tables, head = summary["tables"], summary.get("headline", {})
    kind = "modelled" if head.get("modelled") else "wall"
    metric = MODELLED if kind == "modelled" else WALL
    main = head.get(kind) or {}
    if not main:
        return []
    base_b, hind_b = main["baseline_b"], main["hindsight_b"]
    hindsight = f"b={hind_b}"  # evaluate's (headline.hindsight_method), not recomputed here
    base = _average(tables, metric, f"b={base_b}")
    rows = []

    def add(label: str, method: str, interval: Optional[Dict[str, Any]] = None) -> None:
        value = _average(tables, metric, method)
        gain = None if value is None or not base else value / base - 1
        ci = None
        if interval is not None:
            gain, ci = interval["gain"], interval["gain_ci95"]
        rows.append({"row": label, "method": method, "modelled": _average(tables, MODELLED, method),
                     "wall": _average(tables, WALL, method), "gain": gain, "gain_ci95": ci})

    with_rule = "rule" in (head.get("adaptive_is") or "")
    add("adaptive (policy + rule)" if with_rule else "adaptive (the policy alone)", "adaptive", main)
    for key, method, label in (("per_step", PER_STEP, "per-step rule alone"), ("policy_only", POLICY_ONLY,
                                                                                   "policy alone")):
        part = (head.get(key) or {}).get(kind)
        if part:
            add(label, method, part)
    chosen = "train-chosen" if main.get("baseline_is") == "train_chosen" else "baseline (hindsight)"
    add(f"{chosen} b={base_b}", f"b={base_b}")
    same = " (= the baseline)" if hindsight == f"b={base_b}" else ""
    add(f"hindsight b={hindsight[2:]}{same}", hindsight)
    add("oracle (per prompt)", "oracle")
    for r in rows:
        r.update(gain_on=kind, baseline_b=base_b)
    return rows


def format_rows(rows: List[Dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    if not rows:
        return ""

    def x(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.3f}x"

    def gain(r: Dict[str, Any]) -> str:
        if r["gain"] is None:
            return "-"
        if r["method"] == f"b={rows[0]['baseline_b']}":
            return "(baseline)"
        text = f"{r['gain']:+.2%}"
        return text + (f" [{r['gain_ci95'][0]:+.2%}, {r['gain_ci95'][1]:+.2%}]" if r["gain_ci95"] else "")

    width = max(len(r["row"]) for r in rows)
    baseline = next(r["row"] for r in rows if r["method"] == f"b={rows[0]['baseline_b']}")
    head = f"gain vs {baseline} ({rows[0]['gain_on']}, 95 % CI)"
    lines = [f"{'method':<{width}}  {'modelled':>9}  {'wall':>7}  {head}"]
    lines += [f"{r['row']:<{width}}  {x(r['modelled']):>9}  {x(r['wall']):>7}  {gain(r)}" for r in rows]
    return "\n".join(lines)
