"""run: prepare -> label -> train -> evaluate -> report in one command.

Each stage skips itself when its output folder is complete and was made with the same config, so rerunning after
a failure picks up where it stopped. Ends by printing where the report is and the headline numbers.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from pipeline.runtime.config import PipelineConfig
from pipeline.runtime.log import get as log

ORDER = ("prepare", "label", "train", "tune", "evaluate", "report")


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    from stages import STAGES

    t0 = time.monotonic()
    summaries: Dict[str, Any] = {}
    for name in ORDER:
        if name == "tune" and not cfg.evaluate.per_step:
            continue
        log("run").info(f"=== {name} ===")
        t = time.monotonic()
        summaries[name] = STAGES[name].load()(cfg)
        log("run").info(f"{name} finished in {time.monotonic() - t:.1f} s")
    report = summaries["report"]
    h = report.get("headline", {})
    wall = round(time.monotonic() - t0, 1)
    print(f"[run] done in {wall} s. Report: {report['report']}")
    if h:
        line = (f"[run] held-out average tau / speedup vs AR: adaptive {h['adaptive_tau']:.2f} / "
                f"{h['adaptive_speedup']:.2f}x; best fixed {h['best_fixed']} {h['best_fixed_tau']:.2f} / "
                f"{h['best_fixed_speedup']:.2f}x; oracle {h['oracle_tau']:.2f} / {h['oracle_speedup']:.2f}x")
        if h.get("trained_b"):
            line += f"; trained B ({h['trained_b']}) {h['trained_b_tau']:.2f} / {h['trained_b_speedup']:.2f}x"
        print(line, flush=True)
        if h.get("adaptive_is"):
            print(f"[run] adaptive = {h['adaptive_is']}", flush=True)
        for kind in ("modelled", "wall"):
            k = h.get(kind)
            if not k:
                continue
            cap = "-" if k["oracle_gain_captured"] is None else f"{k['oracle_gain_captured']:.0%}"
            print(f"[run] {kind} speedup vs AR (held-out average): adaptive {k['adaptive']:.3f}x; best fixed "
                  f"b={k['best_fixed_b']} (train split) {k['best_fixed']:.3f}x; hindsight b={k['hindsight_fixed_b']} "
                  f"{k['hindsight_fixed']:.3f}x; oracle {k['oracle']:.3f}x; gain {k['gain']:+.2%} "
                  f"[{k['gain_ci95'][0]:+.2%}, {k['gain_ci95'][1]:+.2%}]; oracle gain captured {cap}", flush=True)
        for key in ("policy_only", "per_step"):  # adaptive's two parts apart: the policy alone, the tuned rule alone
            ps = h.get(key)
            if not ps:
                continue
            what = f"{ps['method']} ({ps['rule']}, b_max {ps['max_block_size']})" if ps["rule"] else ps["method"]
            for kind in ("modelled", "wall"):
                k = ps.get(kind)
                if k:
                    print(f"[run] {kind} {what} alone: {k['adaptive']:.3f}x vs best fixed b={k['best_fixed_b']} "
                          f"{k['best_fixed']:.3f}x; gain {k['gain']:+.2%} [{k['gain_ci95'][0]:+.2%}, "
                          f"{k['gain_ci95'][1]:+.2%}]", flush=True)
        if h.get("folded_policy"):
            f = h["folded_policy"]
            print(f"[run] folded policy: same choice on {f['agree']}/{f['prompts']} evaluation prompts", flush=True)
        for g in h.get("gains", []):
            print(f"[run] adaptive vs {g['against']} (chosen on {g['chosen_on']}): wall-clock gain {g['gain']:+.1%} "
                  f"[{g['gain_ci95'][0]:+.1%}, {g['gain_ci95'][1]:+.1%}] (95 % bootstrap over prompts)", flush=True)
    # The full headline (per set, intervals, the oracle) is in report/summary.json and eval/summary.json; the lines
    # above print it. What the command ends with stays short.
    short = {k: h.get(k) for k in ("adaptive_speedup", "best_fixed", "best_fixed_speedup", "oracle_speedup")}
    for key in ("modelled", "wall"):
        if h.get(key):
            short[f"{key}_gain"] = {"gain": h[key]["gain"], "gain_ci95": h[key]["gain_ci95"]}
    for key in ("policy_only", "per_step"):
        if h.get(key, {}).get("modelled"):
            m = h[key]["modelled"]
            short[f"{key}_modelled_gain"] = {"gain": m["gain"], "gain_ci95": m["gain_ci95"]}
    return {"stage": "run", "report": report["report"], "headline": short, "wall_seconds": wall,
            "label_rows": summaries["label"].get("rows"), "eval_datasets": summaries["evaluate"].get("datasets")}
