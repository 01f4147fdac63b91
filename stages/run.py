"""run: prepare -> label -> train -> evaluate -> report in one command.

Each stage skips itself when its output folder is complete and was made with the same config, so rerunning after
a failure picks up where it stopped. Ends by printing where the report is and the headline numbers.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from pipeline.config import PipelineConfig
from pipeline.log import get as log

ORDER = ("prepare", "label", "train", "evaluate", "report")


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    from stages import STAGES

    t0 = time.monotonic()
    summaries: Dict[str, Any] = {}
    for name in ORDER:
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
        for g in h.get("gains", []):
            print(f"[run] adaptive vs {g['against']} (chosen on {g['chosen_on']}): wall-clock gain {g['gain']:+.1%} "
                  f"[{g['gain_ci95'][0]:+.1%}, {g['gain_ci95'][1]:+.1%}] (95 % bootstrap over prompts)", flush=True)
    return {"stage": "run", "report": report["report"], "headline": h, "wall_seconds": wall,
            "label_rows": summaries["label"].get("rows"), "eval_datasets": summaries["evaluate"].get("datasets")}
