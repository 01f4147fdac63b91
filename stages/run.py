"""run: prepare -> label -> train -> tune -> evaluate -> report in one command.

Each stage skips itself when its output folder is complete and was made with the same config, so rerunning after
a failure picks up where it stopped. Ends with one small table (pipeline.evaluation.table: each method's speedup
over autoregressive decoding, modelled and wall clock, and its gain over the train-chosen fixed b) and the report's
path; the whole headline stays in the report's and evaluate's summary.json.
"""

from __future__ import annotations

import time
from typing import Any, Dict

from pipeline.evaluation.table import format_rows
from pipeline.runtime.config import PipelineConfig
from pipeline.runtime.log import get as log, one_run

ORDER = ("prepare", "label", "train", "tune", "evaluate", "report")


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t0 = time.monotonic()
    summaries: Dict[str, Any] = {}
    seconds: Dict[str, float] = {}
    with one_run():  # later stages say only what changed (pipeline.runtime.log.said_before)
        for name in ORDER:
            _stage(cfg, name, summaries, seconds)
    report = summaries["report"]
    rows = report.get("headline", {}).get("rows", [])
    wall = round(time.monotonic() - t0, 1)
    print(f"\n[run] {done_line(wall, seconds)}; speedups over autoregressive decoding, average of the held-out sets:",
          flush=True)
    if rows:
        print(format_rows(rows), flush=True)
    from pipeline.evaluation.load import render_load

    for load in (summaries["evaluate"].get("load") or {}).values():  # one short table per concurrency
        print("\n".join(render_load(load)), flush=True)
    print(f"report: {report['report']}", flush=True)
    return {"stage": "run", "report": report["report"], "headline": rows, "wall_seconds": wall,
            "stage_seconds": {k: round(v, 1) for k, v in seconds.items()},
            "label_rows": summaries["label"].get("rows"), "eval_datasets": summaries["evaluate"].get("datasets")}


def _stage(cfg: PipelineConfig, name: str, summaries: Dict[str, Any], seconds: Dict[str, float]) -> None:
    from stages import STAGES

    why = skipped(cfg, name)
    if why:
        log("run").info(f"=== {name} === skipped: {why}")
        return
    log("run").debug(f"=== {name} ===")  # each stage's lines carry its name, and its done: line closes them
    t = time.monotonic()
    # evaluate's tables at load are this command's closing block (below), printed once
    summaries[name] = STAGES[name].load()(cfg, **({"load_tables": False} if name == "evaluate" else {}))
    seconds[name] = time.monotonic() - t


def skipped(cfg: PipelineConfig, name: str) -> str:
    """Why ``run`` leaves a stage out ("" when it runs): decided before any stage runs, so nothing fails late."""
    if name == "tune" and not cfg.evaluate.per_step:
        return "evaluate.per_step is false"
    if name == "tune" and cfg.label.engine == "vllm":
        return ("label.engine=vllm: vLLM reports accepted counts, not the draft's per-slot confidences the rules are "
                "simulated from (no per-step trace), and serves no per-step rule; adaptive runs the policy alone")
    if name == "tune" and cfg.decode.temperature > 0:
        return (f"decode.temperature={cfg.decode.temperature}: per-step rules are scored on exact traces, which only "
                "T = 0 has; adaptive runs the policy alone")
    return ""


def done_line(wall: float, seconds: Dict[str, float]) -> str:
    """``done in 674.0 s (prepare 2.2 s, label 213.9 s, ...)``: each stage's time on the one closing line, rather
    than a "finished" line per stage (each stage's own `done:` line already closes its part of the log)."""
    return f"done in {wall} s ({', '.join(f'{k} {v:.1f} s' for k, v in seconds.items())})"
