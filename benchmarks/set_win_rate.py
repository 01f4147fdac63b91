"""How often a held-out set of n prompts shows the per-request policy at least as fast as the fallback b, per source:
the question behind "every held-out set wins". Offline on a finished run's labels, with the ridge policy train
fits (pipeline.training.ridge.fit_ridge on every non-val row, its margin), and only out-of-sample choices: the
leave-one-out choice for a fitted row, the model's choice for a val row. Every source's rows are the population; a
"set" is n of them drawn without replacement, its gain the ratio of mean modelled time per token (evaluate's
headline). The evaluation sets are never read.

    python benchmarks/set_win_rate.py runs/default                  # the table, n = 16 / 32 / 64
    python benchmarks/set_win_rate.py runs/default --write          # and appends it to results/set-win-rate.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ridge_loo import load_run  # noqa: E402
from pipeline.training.analysis import apply_margin  # noqa: E402
from pipeline.training.ridge import fit_ridge  # noqa: E402


def out_of_sample_choices(x, tau, fit, costs, fb, scale):
    """(choice per row, the fit's info): leave-one-out for the fitted rows, the fitted model's for the others."""
    model, info = fit_ridge(x[fit], tau[fit], costs, fb, scale)
    pred = np.empty((len(x), len(costs)))
    pred[fit] = info["loo_predictions"]
    with torch.no_grad():
        pred[~fit] = model(torch.from_numpy(x[~fit]).float()).double().numpy() * scale
    return apply_margin(pred, info["calibration"]["margin"], fb), info


def set_gains(t_chosen, t_fallback, n, draws, rng):
    """Gains of ``draws`` sets of n rows drawn without replacement (ratio of mean time per token, minus 1)."""
    idx = np.stack([rng.choice(len(t_chosen), n, replace=False) for _ in range(draws)])
    return t_fallback[idx].mean(1) / t_chosen[idx].mean(1) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finished run's output_dir (labels/ and train/)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64], help="prompts per set")
    ap.add_argument("--draws", type=int, default=4000, help="sets drawn per source and size")
    ap.add_argument("--write", action="store_true", help="append the table to benchmarks/results/set-win-rate.md")
    args = ap.parse_args()
    p, x, tau, src = load_run(args.run)
    s, costs, fb, scale = p.splits, np.asarray(p.costs), p.fixed_index, p.speed["scale"]
    fit = s.train | s.calib
    chosen, info = out_of_sample_choices(x, tau, fit, costs, fb, scale)
    rows = np.arange(len(tau))
    t = costs[None, :] / np.maximum(tau, 1e-6)
    t_ch, t_fb = t[rows, chosen], t[:, fb]
    rng = np.random.default_rng(0)
    sources = sorted(set(src))
    margin = info["calibration"]["margin"]
    lines = [f"run `{args.run}`: fallback b={p.candidates[fb]}, penalty {info['alpha']:g}, margin "
             f"{'none' if margin is None else f'{margin:.4f}'}; out-of-sample choices of {len(tau)} label rows "
             f"({int(fit.sum())} leave-one-out, {int((~fit).sum())} val); {args.draws} sets per cell", "",
             "| source | rows | switched | gain, all rows [95 % CI] | " +
             " | ".join(f"P(set of {n} >= 0)" for n in args.sizes) + " |", "| --- " * (4 + len(args.sizes)) + "|"]
    win_all = {n: np.ones(args.draws, dtype=bool) for n in args.sizes}
    for k in sources:
        m = src == k
        g = float(t_fb[m].mean() / t_ch[m].mean() - 1)
        # A bootstrap over the source's rows (with replacement) for the all-rows interval.
        bi = rng.integers(0, int(m.sum()), size=(2000, int(m.sum())))
        bg = t_fb[m][bi].mean(1) / t_ch[m][bi].mean(1) - 1
        cells = []
        for n in args.sizes:
            if n > m.sum():
                cells.append("-")
                continue
            sg = set_gains(t_ch[m], t_fb[m], n, args.draws, rng)
            win_all[n] &= sg >= -1e-12
            cells.append(f"{(sg >= -1e-12).mean():.0%}")
        lines.append(f"| {k} | {int(m.sum())} | {int((chosen[m] != fb).sum())} | {g:+.2%} "
                     f"[{np.quantile(bg, 0.025):+.2%}, {np.quantile(bg, 0.975):+.2%}] | " + " | ".join(cells) + " |")
    lines.append("| every source at once | | | | " + " | ".join(f"{win_all[n].mean():.0%}" for n in args.sizes) + " |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        out = ROOT / "benchmarks" / "results" / "set-win-rate.md"
        head = "" if out.exists() else (
            "# How often a held-out set of n prompts shows the policy at least as fast as the fallback\n\n"
            "`python benchmarks/set_win_rate.py RUN --write`: out-of-sample choices on the label set's own rows "
            "(leave-one-out and val); the evaluation sets are never read. \"every source at once\" draws the "
            "sources' sets independently and counts the draws where all of them are >= 0.\n\n")
        out.write_text((out.read_text() if out.exists() else head) + text + "\n\n")


if __name__ == "__main__":
    main()
