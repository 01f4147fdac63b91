"""When does a per-step verify rule pay? The per-step rules (threshold, learned), the per-step oracle and the fixed
b, simulated from a run's label traces (nothing decoded) under the run's own cost profile and under the same
profile with the verify's per-token cost scaled up: a machine where verifying one more drafted token costs a larger
share of a step (a GPU serving many requests at once, where the verify is compute-bound; at batch 1 a GPU verify
costs nearly the same at any b, so the scale there is below 1).

For every regime: the fixed b chosen on the TRAIN split by modelled time (what train chooses), then tune's search on
the VAL split (pipeline.evaluation.rule_search.search: the acceptance model fitted on the train traces, the learned
rule at its own Dinkelbach rate, every threshold of the grid, the per-step oracle), and the learned rule against
the best threshold with a paired 95 % bootstrap interval over the val prompts. The evaluation sets are never read.

    python benchmarks/rule_regimes.py runs/default                # the table
    python benchmarks/rule_regimes.py runs/default --write        # and benchmarks/results/rule-regimes.md
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.evaluation.rule_search import fixed_seconds, read_traced, search  # noqa: E402
from pipeline.io.shards import list_shards  # noqa: E402
from pipeline.policy.cost import CostProfile  # noqa: E402
from pipeline.policy.stats import paired_bootstrap  # noqa: E402
from pipeline.runtime.config import load_config  # noqa: E402
from pipeline.io.layout import COST_PROFILE  # noqa: E402

GRID = ["full", "threshold:0.001", "threshold:0.002", "threshold:0.005", "threshold:0.01", "threshold:0.02",
        "threshold:0.05", "threshold:0.1", "threshold:0.2", "threshold:0.3", "threshold:0.5", "threshold:0.7", "learned"]


def scaled(profile: CostProfile, factor: float) -> CostProfile:
    """The profile with the verify's per-token slope times ``factor`` (b >= 2 read from the fit)."""
    p = copy.deepcopy(profile)
    p.fit["verify"] = {**p.fit["verify"], "slope": p.fit["verify"]["slope"] * factor}
    p.seconds = {b: s for b, s in p.seconds.items() if b < 2}  # cost(b >= 2) from the fit
    return p


def regime(rows, profile: CostProfile, max_new_tokens: int):
    cands = rows["train"][0].candidates
    per_b = {b: sum(fixed_seconds(r, b, profile) for r in rows["train"]) for b in cands}
    base = min(per_b, key=per_b.get)
    out = search(rows, GRID, profile, base, max_new_tokens)
    c = out["choice"]
    thr = c["families"]["threshold"]
    secs = {}
    for r in out["rows"]:
        secs.setdefault(r["method"], {})[r["prompt_id"]] = r["modelled_seconds"]
    ids = sorted(secs[f"b={base}"])
    b_max = c["max_block_size"]
    t_thr = np.array([secs[f"{thr['rule']}@{b_max}"][i] for i in ids])
    t_lrn = np.array([secs[f"learned@{b_max}"][i] for i in ids])
    lo, hi = paired_bootstrap(lambda a, b: a / b - 1, t_thr, t_lrn)
    line = {t["rule"]: t for t in c["table"]}
    return {"baseline_b": base, "b_max": b_max, "oracle": c["per_step_oracle"]["gain"], "full": line["full"]["gain"],
            "threshold": thr["rule"], "threshold_gain": thr["gain"], "learned_gain": line["learned"]["gain"],
            "learned_captured": line["learned"]["oracle_gain_captured"], "rate": out["learned"].rate,
            "learned_vs_threshold": t_thr.sum() / t_lrn.sum() - 1, "learned_vs_threshold_ci95": [lo, hi],
            "val_prompts": len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finished run's output_dir (labels/, train/policy/cost_profile.json)")
    ap.add_argument("--factors", type=float, nargs="+", default=[0.25, 1, 2, 4, 8, 16, 32],
                    help="verify per-token slope multipliers (default: %(default)s)")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/rule-regimes.md")
    args = ap.parse_args()
    cfg = load_config(config_file=str(args.run / "train" / "config.yaml"))
    t0 = time.perf_counter()
    rows = read_traced(list_shards(args.run / "labels"), cfg.train.val_fraction, cfg.train.calibration_fraction)
    profile = CostProfile.load(args.run / "train" / "policy" / COST_PROFILE)
    v = profile.fit["verify"]
    step = profile.cost(8)
    lines = [f"run `{args.run}`: {len(rows['val'])} val / {len(rows['train'])} train prompts; the run's verify "
             f"{v['intercept'] * 1e3:.2f} ms + {v['slope'] * 1e3:.4f} ms per token, a b = 8 step {step * 1e3:.2f} ms",
             "", "| verify slope x | one token's verify / b=8 step | fixed b | full@b_max | best threshold | learned "
             "| per-step oracle | learned's share of the oracle | learned vs threshold [95 % CI] |",
             "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for f in args.factors:
        p = scaled(profile, f)
        r = regime(rows, p, cfg.decode.max_new_tokens)
        # A share of an oracle gain under 1 % is noise over a tiny denominator.
        share = "-" if r["learned_captured"] is None or r["oracle"] < 0.01 else f"{r['learned_captured']:.0%}"
        lo, hi = r["learned_vs_threshold_ci95"]
        lines.append(f"| {f:g} | {p.fit['verify']['slope'] / p.cost(8):.1%} | {r['baseline_b']} | {r['full']:+.2%} | "
                     f"`{r['threshold']}` {r['threshold_gain']:+.2%} | {r['learned_gain']:+.2%} | {r['oracle']:+.2%} | "
                     f"{share} | {r['learned_vs_threshold']:+.2%} [{lo:+.2%}, {hi:+.2%}] |")
    lines.append("")
    lines.append(f"Gains are modelled, over the fixed b, on the val split; b_max = the traces' ({r['b_max']}). "
                 f"{time.perf_counter() - t0:.0f} s.")
    text = "\n".join(lines)
    print(text)
    if args.write:
        out = ROOT / "benchmarks" / "results" / "rule-regimes.md"
        out.write_text("# When a per-step verify rule pays: the run's cost profile, its verify slope scaled\n\n"
                       "`python benchmarks/rule_regimes.py RUN --write` (simulated from the label traces; val split "
                       "only).\n\n" + text + "\n")


if __name__ == "__main__":
    main()
