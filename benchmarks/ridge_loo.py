"""The ridge policy's penalty and fallback margin: chosen on a 15 % calibration split (the fit on the train split
alone, what train did before) against chosen on exact leave-one-out predictions of every non-val row (the fit on
train + calibration, pipeline.training.ridge.fit_ridge: what train does now). Offline on a finished run's labels
and the cost profile its policy was trained with; every number is on the VAL split, which neither fit nor choice
reads. The evaluation sets are never read.

    python benchmarks/ridge_loo.py runs/default            # a table: val gain overall and per source, switches
    python benchmarks/ridge_loo.py runs/default --write    # and appends it to benchmarks/results/ridge-loo.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.io.storage import read_table  # noqa: E402
from pipeline.policy.blocksize import calibrate_margin, speed_gain, speed_targets  # noqa: E402
from pipeline.runtime.config import load_config  # noqa: E402
from pipeline.training.analysis import apply_margin  # noqa: E402
from pipeline.training.data import read_logits  # noqa: E402
from pipeline.training.problem import load_problem  # noqa: E402
from pipeline.training.ridge import ALPHAS, fit_ridge  # noqa: E402


def load_run(run: Path):
    """(the train problem of a finished run, every row's logits, tau, source), in the problem's row order: what the
    offline benchmarks of the ridge policy read (this one and set_win_rate.py)."""
    cfg = load_config(config_file=str(run / "train" / "config.yaml"))
    p = load_problem(cfg.train, run / "labels")
    x = read_logits(p.shards).astype(np.float64)
    src = np.array([v for f in p.shards for v in read_table(f, columns=["source"]).column("source").to_pylist()])
    return p, x, p.splits.tau.astype(np.float64), src


def calibration_split_ridge(x, tau, train, calib, costs, fb, scale):
    """The old fit: ridge on the train rows, the penalty whose raw argmax gains most on the calibration rows, the
    margin calibrated on them; returns predicted log speed ratios for every row and the margin."""
    mu, sd = x[train].mean(0), x[train].std(0).clip(1e-6)
    z = (x - mu) / sd
    y = speed_targets(tau, costs, fb) / scale
    ym = y[train].mean(0)
    evals, evecs = np.linalg.eigh(z[train] @ z[train].T)
    proj = evecs.T @ (y[train] - ym)
    best = None
    for a in ALPHAS:
        w = z[train].T @ (evecs @ (proj / (evals.clip(0) + a)[:, None]))
        pred = (z @ w + ym) * scale
        g = speed_gain(tau[calib], costs, pred[calib].argmax(1), np.full(calib.sum(), fb))
        if best is None or (round(g, 12), a) >= (round(best[0], 12), best[1]):
            best = (g, a, pred)
    pred = best[2]
    cal = calibrate_margin((pred.max(1) - pred[:, fb])[calib], pred.argmax(1)[calib], tau[calib], costs, fb)
    return pred, cal["margin"], best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finished run's output_dir (labels/ and train/)")
    ap.add_argument("--write", action="store_true", help="append the table to benchmarks/results/ridge-loo.md")
    args = ap.parse_args()
    p, x, tau, src = load_run(args.run)
    s, costs, fb, scale = p.splits, np.asarray(p.costs), p.fixed_index, p.speed["scale"]
    va = s.val
    old, old_margin, old_alpha = calibration_split_ridge(x, tau, s.train, s.calib, costs, fb, scale)
    fit = s.train | s.calib
    model, info = fit_ridge(x[fit], tau[fit], costs, fb, scale)
    with torch.no_grad():
        new = model(torch.from_numpy(x).float()).double().numpy() * scale
    oracle = speed_gain(tau[va], costs, (tau[va] / costs).argmax(1), np.full(va.sum(), fb))
    lines = [f"run `{args.run}`: {int(va.sum())} val rows, fallback b={p.candidates[fb]}, {len(p.actions)} actions, "
             f"val oracle {oracle:+.2%}", "",
             "| fit | rows fitted | penalty | margin | val gain | switched | " +
             " | ".join(sorted(set(src))) + " |", "| --- " * (6 + len(set(src))) + "|"]
    for name, pred, margin, alpha, rows in (("calibration split", old, old_margin, old_alpha, int(s.train.sum())),
                                            ("leave-one-out", new, info["calibration"]["margin"], info["alpha"],
                                             int(fit.sum()))):
        ch = apply_margin(pred, margin, fb)
        per = [speed_gain(tau[va & (src == k)], costs, ch[va & (src == k)], np.full((va & (src == k)).sum(), fb))
               for k in sorted(set(src))]
        m = "none" if margin is None else f"{margin:.4f}"
        lines.append(f"| {name} | {rows} | {alpha:g} | {m} | "
                     f"{speed_gain(tau[va], costs, ch[va], np.full(va.sum(), fb)):+.2%} | {int((ch[va] != fb).sum())} | "
                     + " | ".join(f"{g:+.2%}" for g in per) + " |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        out = ROOT / "benchmarks" / "results" / "ridge-loo.md"
        head = "" if out.exists() else ("# The ridge policy's penalty and margin: calibration split vs leave-one-out\n\n"
                                        "`python benchmarks/ridge_loo.py RUN --write` (val split only; the "
                                        "evaluation sets are never read).\n\n")
        out.write_text((out.read_text() if out.exists() else head) + text + "\n\n")


if __name__ == "__main__":
    main()
