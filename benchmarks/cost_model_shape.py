"""Is the cost model's FORM right? The affine per-step model (a + c b for b >= 2, AR its own constant, a per-decode
first-step term) refitted by least squares on a run's own evaluate wall clock (the fixed-b and AR rows), then its
per-method error, beside each fixed b's measured seconds per step. What this refit cannot explain is the form's
error (a per-b effect an affine line misses); what evaluate's `cost_model` shows beyond it is the start-up
profile's (the machine at label time against the machine at evaluate time). A diagnostic of the evaluation rows:
no choice is made from it.

    python benchmarks/cost_model_shape.py runs/default [more runs...]
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np
import polars as pl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="finished runs' output_dir (eval/part-*.parquet)")
    args = ap.parse_args()
    for run in args.runs:
        df = pl.read_parquet(sorted(glob.glob(str(run / "eval" / "part-*.parquet"))))
        fx = df.filter(pl.col("step_rule").is_null() &
                       (pl.col("method").str.starts_with("b=") | (pl.col("method") == "AR")))
        b = np.array([1 if m == "AR" else int(m[2:]) for m in fx["method"]])
        steps, sec = fx["steps"].to_numpy().astype(float), fx["decode_seconds"].to_numpy()
        spec = b >= 2
        x = np.c_[steps * spec, steps * b * spec, spec.astype(float), steps * ~spec, (~spec).astype(float)]
        coef, *_ = np.linalg.lstsq(x, sec, rcond=None)
        pred = x @ coef
        methods = sorted(set(fx["method"]), key=lambda s: 0 if s == "AR" else int(s[2:]))
        err, ms = {}, {}
        for m in methods:
            i = (fx["method"] == m).to_numpy()
            err[m] = pred[i].sum() / sec[i].sum() - 1
            ms[m] = sec[i].sum() / steps[i].sum() * 1e3
        print(f"{run}: refit a = {coef[0] * 1e3:.3f} ms + {coef[1] * 1e3:.4f} ms x b, AR {coef[3] * 1e3:.3f} ms; "
              f"mean |error| {np.mean([abs(e) for e in err.values()]):.2%}")
        print("| method | " + " | ".join(methods) + " |\n|" + " --- |" * (len(methods) + 1))
        print("| measured ms / step | " + " | ".join(f"{ms[m]:.2f}" for m in methods) + " |")
        print("| refit error | " + " | ".join(f"{err[m]:+.1%}" for m in methods) + " |\n")


if __name__ == "__main__":
    main()
