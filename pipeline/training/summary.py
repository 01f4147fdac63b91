"""train's summary (summary.json) and the lines it logs at the end of a run."""

from __future__ import annotations

from typing import Any, Dict, List

from pipeline.policy.labels import speed_label

from .data import histogram
from .export import ExportInput


def label_histograms(inp: ExportInput) -> Dict[str, Dict[int, int]]:
    """Rows per b of the stored argmax-tau label and, under a cost profile, of the speed label."""
    p = inp.problem
    out = {"argmax_tau": histogram(p.splits.y_tau, p.candidates)}
    if p.costs is not None:  # over every action, by name ("b=8", "threshold:0.01@10") when there are rule actions
        keys = p.action_names if p.rule_actions else p.candidates
        out["argmax_tau_over_cost"] = histogram(speed_label(p.splits.tau, p.costs), keys)
    return out


def train_summary(inp: ExportInput, held: Dict[str, Any]) -> Dict[str, Any]:
    p, s = inp.problem, inp.problem.splits
    val_y = s.y[s.val]
    majority = p.majority_index
    return {
        "objective": inp.train.objective, "label_histograms": label_histograms(inp), "held_out": held,
        "fallback_block_size": p.train_chosen_block_size,
        "margin": held["calibration"]["margin"] if held else None,
        "calibration_rows": int(s.calib.sum()), "stage": "train",
        "epochs": inp.epochs, "train_rows": int(s.train.sum()), "val_rows": int(s.val.sum()),
        "candidates": p.candidates, "actions": p.action_names, "best_fixed_block_size": p.train_chosen_block_size,
        # The majority label may be a rule action (the speed label ranges over every action): its b_max then.
        "majority_class": p.action_names[majority],
        "majority_class_block_size": p.actions[majority].block_size,
        "val_majority_accuracy": float((val_y == majority).mean()) if len(val_y) else None,
        "final": inp.history[-1],
    }


def summary_lines(s: Dict[str, Any]) -> List[str]:
    """What the run logs when it is done, from :func:`train_summary` (plus its ``policy`` path)."""
    f = s["final"]
    lines = [f"done: {s['epochs']} epochs -> {s['policy']}" if "ridge_alpha" not in s["final"] else
             f"done: ridge (alpha {s['final']['ridge_alpha']:g}, chosen by leave-one-out) over "
             f"{len(s['actions'])} actions -> {s['policy']}"]
    if "val_accuracy" in f:
        lines.append(f"val accuracy {f['val_accuracy']:.3f} (majority class {s['val_majority_accuracy']:.3f}); val "
                     f"mean tau: policy {f['val_tau_policy']:.3f}, train-chosen b={s['fallback_block_size']} "
                     f"{f['val_tau_best_fixed']:.3f}, oracle {f['val_tau_oracle']:.3f}")
    h = s.get("held_out") or {}
    if h.get("val"):
        cal = h["calibration"]
        margin = "none (always the fallback)" if cal["margin"] is None else f"{cal['margin']:.4f}"
        rows = f"{cal['calibration_rows']} {'out-of-fold ' if cal.get('on') else ''}rows"
        lines.append(f"fallback: the train-chosen b={s['fallback_block_size']}, margin {margin} (calibrated on "
                     f"{rows}: gain {cal['calibration_gain']:+.2%}, {cal['calibration_switched']} switched)")
        shares = ", ".join(f"{k} {v['gain']:+.2%}" + (f" ({v['oracle_gain_captured']:.0%})"
                                                       if v["oracle_gain_captured"] is not None else "")
                           for k, v in h["val"].items())
        lines.append(f"held-out val ({h['val_rows']} rows) modelled gain over the train-chosen b (share of the "
                     f"oracle's): {shares}")
    return lines
