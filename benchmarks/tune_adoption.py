"""Tune's choice and its adoption check (pipeline.evaluation.rule_search.cross_fitted_gain), offline, on the folders
of earlier runs: each run's own labels, policy, cost profile and train-chosen b, beside the step_rule.json tune
wrote then. Nothing is decoded.

    python benchmarks/tune_adoption.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.evaluation.rule_search import adoption_line, read_traced, search
from pipeline.io.shards import list_shards
from pipeline.policy.blocksize import train_chosen_block_size
from pipeline.policy.cost import CostProfile
from pipeline.runtime.config import load_config
from pipeline.io.layout import COST_PROFILE, POLICY_META


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (output_dir of blockpilot run)")
    args = ap.parse_args()
    cfg = load_config([])
    for run in args.runs:
        policy = run / "train" / "policy"
        info = json.loads((policy / POLICY_META).read_text())
        rows = read_traced(list_shards(run / "labels"), cfg.train.val_fraction, cfg.train.calibration_fraction)
        got = search(rows, cfg.tune.rules, CostProfile.load(policy / COST_PROFILE),
                     train_chosen_block_size(info), cfg.decode.max_new_tokens)["choice"]
        old = json.loads((run / "tune" / "step_rule.json").read_text())
        print(f"{run}: chose {got['rule']} {got['gain']:+.2%} (tune wrote {old['rule']} {old['gain']:+.2%}); "
              f"{adoption_line(got['adoption'])}")


if __name__ == "__main__":
    main()
