"""How much a per-prompt "no speculation" action could save at c = 1 (issue #44 point 1), on a run's own label set.

For every label row (the label set's own tau per candidate b, the run's cost profile), modelled time per token at b
is cost(b) / tau(b) and without speculation cost(1). Printed per split: the rows that lose to AR at EVERY candidate
(their best b's speed over AR), and three per-row choices' mean time per token, relative to the train-chosen fixed b
on every row: the per-row best candidate (the policy's ceiling today), the same with AR as one more action, and
AR only where it beats the train-chosen b. The last two are oracle upper bounds: a learned gate gets less.

    python benchmarks/ar_rows.py --run runs/default
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from pipeline.io.layout import COST_PROFILE, POLICY_META


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/default", help="a run folder with labels/ and train/policy/")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    from pipeline.io.shards import list_shards
    from pipeline.policy.blocksize import train_chosen_block_size
    from pipeline.policy.cost import CostProfile
    from pipeline.training.data import read_splits

    run = Path(args.run)
    info = json.loads((run / "train" / "policy" / POLICY_META).read_text())
    cands = [int(b) for b in info["candidates"]]
    profile = CostProfile.load(run / "train" / "policy" / COST_PROFILE)
    cfg = OmegaConf.load(run / "train" / "config.yaml").train
    splits = read_splits(list_shards(run / "labels"), cfg.val_fraction, cands, cfg.calibration_fraction)
    tau = splits.tau[:, :len(cands)].astype(np.float64)
    per_token = np.array([profile.cost(b) for b in cands])[None, :] / tau  # rows x candidates
    ar = profile.cost(1)
    fixed = per_token[:, cands.index(train_chosen_block_size(info))]
    print(f"{run}: candidates {cands}, train-chosen b={train_chosen_block_size(info)}, cost(1) {ar * 1e3:.3f} ms")
    print("split  rows  lose-to-AR-at-every-b (their best/AR)  best-b  best-b-or-AR  fixed-b-or-AR  (time per token vs fixed b)")
    for split in ("train", "val", "all"):
        keep = np.ones(len(tau), bool) if split == "all" else splits.split == split
        pt, fx = per_token[keep], fixed[keep]
        best = pt.min(axis=1)
        losing = best > ar
        ratio = float(np.mean(ar / best[losing])) if losing.any() else float("nan")
        rel = lambda x: float(x.mean() / fx.mean() - 1)  # noqa: E731 - a mean time per token against the fixed b's
        print(f"{split:<6}{keep.sum():>5}  {losing.sum():>5} ({losing.mean():.1%}; best at {ratio:.2f}x AR)"
              f"{rel(best):>+19.2%}{rel(np.minimum(best, ar)):>+14.2%}{rel(np.minimum(fx, ar)):>+15.2%}")


if __name__ == "__main__":
    main()
