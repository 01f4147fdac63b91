"""The policy trained on each T > 0 label estimator, evaluated on the same held-out prompts at the same temperature.

Takes a complete sampled run (e.g. `blockpilot run -c published:tiny-t1`, whose labels hold both `tau`, one sampled
decode per candidate, the paper's label, and `tau_expected`, the same decode's expected acceptance). For each
column of ``--columns`` and objective of ``--objectives`` (the product's cost-aware regression with its fallback; the
paper's classifier) it copies the run's prompts, labels and evaluation prompts to ``OUT/<objective>/<column>``,
trains the policy on that column (``train.tau_column``) and evaluates it at c = 1 with the run's own config; then
prints, per variant, the train-chosen b, adaptive's speedup over autoregressive decoding and its gain over the train-chosen b, measured
(wall clock, R sampled draws a prompt) and modelled, each with its 95 % interval over prompts.

    python benchmarks/t1_estimators.py runs/published/tiny-t1 --reuse tau_expected/speed --out runs/t1-estimators
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


# The objectives compared: the product's (a cost-aware regression that falls back to the train-chosen b unless it
# predicts a gain beyond its calibrated margin) and the paper's (an MLP classifier on the argmax-tau label, always
# its argmax).
OBJECTIVES = {"speed": [], "paper": ["train.objective=paper", "train.model=mlp"]}


def trained_and_evaluated(run: Path, out: Path, config: str, column: str, objective: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for part in ("prompts", "labels", "eval/prompts"):
        if not (out / part).exists():
            shutil.copytree(run / part, out / part)
    cli = [sys.executable, "-m", "stages.cli"]
    # c = 1 only: the per-prompt pass measures the choice; the pass at load would add minutes per variant
    args = ["-c", config, f"output_dir={out}", f"train.tau_column={column}", *OBJECTIVES[objective],
            "evaluate.concurrency=[1]"]
    for stage in ("train", "evaluate"):
        subprocess.run([*cli, stage, "-q", *args], check=True)
    return json.loads((out / "eval" / "summary.json").read_text())


def row(column: str, s: dict) -> str:
    h = s["headline"]
    cells = []
    for kind in ("wall", "modelled"):
        v = h.get(kind)
        cells.append("-" if v is None else f"{v['adaptive']:.3f}x vs {v['baseline']:.3f}x: {v['gain']:+.2%} "
                     f"[{v['gain_ci95'][0]:+.2%}, {v['gain_ci95'][1]:+.2%}]")
    b = h["wall"]["baseline_b"]
    return f"| {column} | b={b} | {s['adaptive_choices']} | " + " | ".join(cells) + " |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a complete sampled run (its prompts/, labels/ and eval/prompts/)")
    ap.add_argument("--config", default="published:tiny-t1", help="the run's -c config")
    ap.add_argument("--out", type=Path, default=Path("runs/t1-estimators"))
    ap.add_argument("--columns", default="tau,tau_expected")
    ap.add_argument("--objectives", default="speed,paper")
    ap.add_argument("--reuse", default=None, help="COLUMN/OBJECTIVE the run itself trained with: its evaluation is "
                    "read from the run instead of redone")
    a = ap.parse_args(argv)
    results = {}
    for o in a.objectives.split(","):
        for c in a.columns.split(","):
            name = f"{c}/{o}"
            results[name] = (json.loads((a.run / "eval" / "summary.json").read_text()) if name == a.reuse else
                             trained_and_evaluated(a.run, a.out / o / c, a.config, c, o))
    first = next(iter(results.values()))
    print(f"\n{sum(first['prompts'].values())} held-out prompts x {first.get('samples', 1)} sampled draws; "
          f"distribution check: " + ", ".join(f"{c} {'passes' if s['distribution'].get('all_pass') else 'FAILS'}"
                                               for c, s in results.items()))
    print("| label column / objective | train-chosen b | adaptive's choices | measured: adaptive vs train-chosen b, gain [95 % CI] "
          "| modelled: the same |")
    print("| --- | --- | --- | --- | --- |")
    for c, s in results.items():
        print(row(c, s))


if __name__ == "__main__":
    main()
