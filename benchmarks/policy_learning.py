"""What a per-request policy can learn from a label set: its input, its size, how many labels it needs, and which
action it should choose (#24). Offline on one label folder; nothing is decoded.

    python benchmarks/policy_learning.py runs/default/labels                 # the ablation and the learning curve
    python benchmarks/policy_learning.py runs/default/labels --write         # and benchmarks/results/policy-learning.md

Every row's value of every action is modelled time per output token under the label set's own cost profile:

- ``b``: a fixed block size among the candidates (the label row's own decode: steps x cost(b) + the first step);
- ``b+rule``: the candidates, and each per-step rule of ``--rules`` at the trace's b_max, simulated from the row's
  per-step trace (pipeline.policy.simulate, exact at T = 0). This is #24's per-request (b or b_max, rule) action.

The fallback is the action fastest on the TRAIN split (for ``b`` the train-chosen fixed b, as train chooses it; for
``b+rule`` whichever of the fixed b and the rules is fastest there). A policy predicts every action's log speed
ratio over the fallback from its input and switches only where the predicted gain clears a margin calibrated on the
calibration split (pipeline.training.analysis.with_fallback). Hyper-parameters (ridge alpha, the MLP's epochs) are
chosen on the calibration split; every number below is on the VAL split, which nothing was fitted or chosen on.
The evaluation sets are never read.

Inputs: ``logits`` (raw last-position prefill logits, the paper's), ``hidden`` (the final hidden state the logits
came from, recovered exactly by least squares on the target's lm_head: the folded policy's input), ``pca-R`` (the
first R principal components of the train rows' logits). Models: ridge regression (closed form) and a one-hidden-
layer MLP with weight decay, stopped early on the calibration split's modelled gain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.io.layout import COST_PROFILE  # noqa: E402
from pipeline.io.shards import decode_metadata, list_shards  # noqa: E402
from pipeline.io.storage import parquet_file, read_table  # noqa: E402
from pipeline.policy.blocksize import speed_gain, speed_targets, split_of  # noqa: E402
from pipeline.policy.cost import CostProfile  # noqa: E402
from pipeline.policy.simulate import pack_traces, simulate_many  # noqa: E402
from pipeline.policy.stats import grouped_paired_bootstrap  # noqa: E402
from pipeline.policy.step_rules import parse_rule  # noqa: E402
from pipeline.policy.trace import Trace  # noqa: E402
from pipeline.training.analysis import with_fallback  # noqa: E402

COLUMNS = ["prompt_id", "source", "prompt_tokens", "candidates", "steps", "trace_block_size", "trace_stopped",
           "trace_match", "trace_confidence", "logits"]
RULES = ["full", "threshold:0.001", "threshold:0.005", "threshold:0.01", "threshold:0.02", "threshold:0.05",
         "threshold:0.1"]
ALPHAS = [0.1, 1.0, 10.0, 100.0, 1000.0, 1e4]


def load(labels: Path, rules: Sequence[str], val_fraction: float, calib_fraction: float):
    """Rows' logits [N, V], split, source, and the action table: names, time per output token [N, A]."""
    shards = list_shards(labels)
    meta = decode_metadata(parquet_file(shards[0]).schema_arrow.metadata)
    profile = CostProfile.load(labels / COST_PROFILE)
    rows = [r for p in shards for r in read_table(p, columns=COLUMNS).to_pylist()]
    rows = [r for r in rows if r["trace_block_size"] is not None]
    cands = [int(b) for b in meta["candidates"]]
    traces = [Trace.from_row(r) for r in rows]
    tokens = np.array([t.new_tokens for t in traces], dtype=np.float64)
    names, seconds = [], []
    for i, b in enumerate(cands):
        names.append(f"b={b}")
        seconds.append([r["steps"][i] * profile.cost(b) + profile.first_step_seconds(b, r["prompt_tokens"])
                        for r in rows])
    packed, b_max = pack_traces(traces), traces[0].block_size
    for rule in rules:
        sim = simulate_many(packed, parse_rule(rule))
        names.append(f"{rule}@{b_max}")
        seconds.append([profile.decode_seconds(v, b_max, rule=True, context=r["prompt_tokens"])
                        for v, r in zip(sim.verified, rows)])
    tpot = np.asarray(seconds, dtype=np.float64).T / tokens[:, None]
    x = np.stack([np.asarray(r["logits"], dtype=np.float32) for r in rows])
    split = np.array([split_of(r["prompt_id"], val_fraction, calib_fraction) for r in rows])
    source = np.array([r["source"] for r in rows])
    return {"x": x, "split": split, "source": source, "names": names, "tpot": tpot, "candidates": cands,
            "meta": meta, "b_max": b_max}


def hidden_of(x: np.ndarray, target: Path) -> np.ndarray:
    """The final (normed) hidden state h with logits = h @ W.T, W the target's lm_head [V, H], by least squares."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    w = model.get_output_embeddings().weight.detach().numpy().astype(np.float64)  # [V, H]
    h, *_ = np.linalg.lstsq(w, x.T.astype(np.float64), rcond=None)
    resid = np.abs(h.T @ w.T - x).max()
    print(f"[policy] hidden state from logits by least squares: H={w.shape[1]}, max |logit residual| {resid:.2e}")
    return h.T.astype(np.float32)


def features(x: np.ndarray, kind: str, train: np.ndarray, hidden: Optional[np.ndarray]) -> np.ndarray:
    if kind == "logits":
        z = x.astype(np.float64)
    elif kind == "hidden":
        z = hidden.astype(np.float64)
    elif kind.startswith("pca-"):
        mu = x[train].mean(axis=0)
        _, _, vt = np.linalg.svd(x[train] - mu, full_matrices=False)
        z = (x - mu) @ vt[:int(kind[4:])].T
    else:
        raise ValueError(kind)
    mu, sd = z[train].mean(axis=0), z[train].std(axis=0).clip(1e-6)
    return (z - mu) / sd


def ridge(z: np.ndarray, y: np.ndarray, fit: np.ndarray, alpha: float) -> np.ndarray:
    """Ridge predictions for every row, fitted on the ``fit`` rows (dual form when there are more features)."""
    zf, yf = z[fit], y[fit]
    mu = yf.mean(axis=0)
    if zf.shape[1] > zf.shape[0]:
        k = zf @ zf.T
        a = np.linalg.solve(k + alpha * np.eye(len(k)), yf - mu)
        return z @ (zf.T @ a) + mu
    w = np.linalg.solve(zf.T @ zf + alpha * np.eye(zf.shape[1]), zf.T @ (yf - mu))
    return z @ w + mu


def mlp(z: np.ndarray, y: np.ndarray, fit: np.ndarray, calib: np.ndarray, score, hidden: int = 64,
        epochs: int = 200, seed: int = 0) -> np.ndarray:
    """A one-hidden-layer MLP (dropout 0.2, weight decay 1e-2) on MSE, the epoch with the best calibration score."""
    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(z.shape[1], hidden), torch.nn.GELU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(hidden, y.shape[1]))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    zt, yt = torch.from_numpy(z).float(), torch.from_numpy(y).float()
    idx = np.flatnonzero(fit)
    rng = np.random.default_rng(seed)
    best, best_pred, patience = -np.inf, None, 0
    for _ in range(epochs):
        net.train()
        for chunk in np.array_split(rng.permutation(idx), max(1, len(idx) // 32)):
            loss = torch.nn.functional.mse_loss(net(zt[chunk]), yt[chunk])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            pred = net(zt).numpy().astype(np.float64)
        s = score(pred)
        if s > best + 1e-9:
            best, best_pred, patience = s, pred, 0
        else:
            patience += 1
            if patience >= 20:
                break
    return best_pred


class Problem:
    """One action set: the rows' time per token over the actions, the fallback chosen on the train split."""

    def __init__(self, data, actions: List[int]):
        self.tpot = data["tpot"][:, actions]
        self.names = [data["names"][a] for a in actions]
        self.split = data["split"]
        self.train, self.calib, self.val = (self.split == s for s in ("train", "calib", "val"))
        self.fallback = int(np.argmin(self.tpot[self.train].mean(axis=0)))
        # tau / cost = speed with unit costs: pipeline.policy.blocksize's helpers then speak time per token.
        self.speed, self.ones = 1.0 / self.tpot, np.ones(len(actions))
        self.target = speed_targets(self.speed, self.ones, self.fallback)

    def choose(self, pred: np.ndarray):
        return with_fallback(pred, self.calib, self.speed, self.ones, self.fallback)

    def gain(self, chosen: np.ndarray, rows: np.ndarray) -> float:
        fb = np.full(int(rows.sum()), self.fallback)
        return speed_gain(self.speed[rows], self.ones, chosen[rows], fb)

    def calib_score(self, pred: np.ndarray) -> float:
        return self.gain(pred.argmax(axis=1), self.calib)

    def evaluate(self, pred: np.ndarray) -> Dict:
        best, chosen, cal = self.choose(pred)
        va = self.val
        oracle = self.tpot.argmin(axis=1)
        fb = self.tpot[va, self.fallback]
        ci = grouped_paired_bootstrap(lambda a, b: a / b - 1, fb, self.tpot[va, chosen[va]], reps=2000, seed=0)
        o = self.gain(oracle, va)
        g = self.gain(chosen, va)
        return {"gain": g, "ci95": list(ci[None]), "argmax_gain": self.gain(best, va), "oracle_gain": o,
                "captured": g / o if o > 0 else None, "switched": int((chosen[va] != self.fallback).sum()),
                "margin": cal["margin"], "chosen": chosen}


def fit_predict(p: Problem, z: np.ndarray, model: str, fit: np.ndarray) -> np.ndarray:
    if model == "ridge":
        scored = [(p.calib_score(pr), a, pr) for a in ALPHAS for pr in [ridge(z, p.target, fit, a)]]
        return max(scored, key=lambda t: (t[0], t[1]))[2]  # on a tie the stronger penalty
    return mlp(z, p.target, fit, p.calib, p.calib_score)


def run(args) -> str:
    t0 = time.time()
    data = load(args.labels, args.rules, args.val_fraction, args.calibration_fraction)
    n_c = len(data["candidates"])
    problems = {"b": Problem(data, list(range(n_c))), "b+rule": Problem(data, list(range(len(data["names"]))))}
    counts = {s: int((data["split"] == s).sum()) for s in ("train", "calib", "val")}
    print(f"[policy] {len(data['split'])} rows ({counts}), {len(data['names'])} actions, loaded in "
          f"{time.time() - t0:.0f} s")
    train = problems["b"].train
    hidden = hidden_of(data["x"], args.target) if "hidden" in args.inputs else None
    feats = {k: features(data["x"], k, train, hidden) for k in args.inputs}
    out = [f"# Per-request policy: input, size, labels, action (`{' '.join(sys.argv[1:])}`)", "",
           f"Label folder `{args.labels}`: {len(data['split'])} rows with traces, split train {counts['train']} / "
           f"calibration {counts['calib']} / val {counts['val']} (the hash split train uses: val_fraction "
           f"{args.val_fraction}, calibration_fraction {args.calibration_fraction}). Modelled time per output token "
           "under the set's own cost profile. Every number is on the val split; alpha and the MLP's stopping epoch "
           "were chosen on the calibration split, the margin too.", ""]
    for pname, p in problems.items():
        o = p.evaluate(np.eye(len(p.names))[p.tpot.argmin(axis=1)])  # an oracle's predictions, for the headroom
        out += [f"## Actions `{pname}` ({len(p.names)}: {', '.join(p.names)}); fallback `{p.names[p.fallback]}` "
                f"(fastest on the train split); val oracle headroom {o['oracle_gain']:+.2%}", "",
                "| input | model | val gain over fallback [95 % CI] | raw argmax | share of oracle | switched |",
                "| --- | --- | ---: | ---: | ---: | ---: |"]
        for kind, z in feats.items():
            for model in args.models:
                r = p.evaluate(fit_predict(p, z, model, p.train))
                cap = "-" if r["captured"] is None else f"{r['captured']:.0%}"
                out.append(f"| {kind} | {model} | {r['gain']:+.2%} [{r['ci95'][0]:+.2%}, {r['ci95'][1]:+.2%}] | "
                           f"{r['argmax_gain']:+.2%} | {cap} | {r['switched']}/{int(p.val.sum())} |")
                print(f"[policy] {pname} {kind} {model}: val {r['gain']:+.2%} ({time.time() - t0:.0f} s)")
        out.append("")
    # The learning curve: the train split cut to n rows (5 draws each), the best input by the table's own metric
    # would be selection on val: the curve uses --curve-input, fixed up front.
    p = problems[args.curve_actions]
    z = feats[args.curve_input]
    idx = np.flatnonzero(p.train)
    out += [f"## Learning curve: `{args.curve_input}` + ridge, actions `{args.curve_actions}`, train rows cut to n "
            "(5 random draws each; calibration and val splits unchanged)", "",
            "| train rows | val gain over fallback (mean of draws) | min | max | share of oracle |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    sizes = [n for n in args.curve if n < len(idx)] + [len(idx)]
    for n in sizes:
        res = []
        for seed in range(5 if n < len(idx) else 1):
            fit = np.zeros(len(p.split), dtype=bool)
            fit[np.random.default_rng(seed).choice(idx, n, replace=False)] = True
            res.append(p.evaluate(fit_predict(p, z, "ridge", fit)))
        g = [r["gain"] for r in res]
        cap = [r["captured"] for r in res if r["captured"] is not None]
        out.append(f"| {n} | {np.mean(g):+.2%} | {min(g):+.2%} | {max(g):+.2%} | "
                   f"{np.mean(cap):.0%} |" if cap else f"| {n} | {np.mean(g):+.2%} | {min(g):+.2%} | "
                   f"{max(g):+.2%} | - |")
        print(f"[policy] curve n={n}: {np.mean(g):+.2%}")
    # Per source of the val rows: what the b+rule policy picks and its gain.
    p = problems["b+rule"]
    r = p.evaluate(fit_predict(p, feats[args.curve_input], "ridge", p.train))
    out += ["", f"## Per source (val rows): `{args.curve_input}` + ridge over `b+rule`", "",
            "| source | rows | fastest fixed b (train) | fallback gain | policy gain over fallback | picks |",
            "| --- | ---: | --- | ---: | ---: | --- |"]
    fixed = problems["b"]
    for src in sorted(set(data["source"].tolist())):
        rows = p.val & (data["source"] == src)
        if not rows.any():
            continue
        fb_vs_fixed = fixed.tpot[rows, fixed.fallback].mean() / p.tpot[rows, p.fallback].mean() - 1
        best_b = fixed.names[int(np.argmin(fixed.tpot[p.train & (data["source"] == src)].mean(axis=0)))]
        picks = dict(zip(*np.unique([p.names[c] for c in r["chosen"][rows]], return_counts=True)))
        out.append(f"| {src} | {int(rows.sum())} | {best_b} | {fb_vs_fixed:+.2%} vs {fixed.names[fixed.fallback]} "
                   f"| {p.gain(r['chosen'], rows):+.2%} | "
                   + ", ".join(f"{k}: {int(v)}" for k, v in picks.items()) + " |")
    out += ["", f"Run time {time.time() - t0:.0f} s."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("labels", type=Path, help="a label folder (schema v3: rows with per-step traces)")
    ap.add_argument("--target", type=Path, default=ROOT / "pipeline" / "assets" / "tiny-target",
                    help="the target whose lm_head maps hidden state to logits (for the 'hidden' input)")
    ap.add_argument("--inputs", nargs="+", default=["logits", "hidden", "pca-8", "pca-32", "pca-128"])
    ap.add_argument("--models", nargs="+", default=["ridge", "mlp"], choices=["ridge", "mlp"])
    ap.add_argument("--rules", nargs="+", default=RULES, help="per-step rules of the b+rule action set")
    ap.add_argument("--val-fraction", type=float, default=0.3, help="train.val_fraction of the run")
    ap.add_argument("--calibration-fraction", type=float, default=0.15, help="train.calibration_fraction")
    ap.add_argument("--curve", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048])
    ap.add_argument("--curve-input", default="pca-32")
    ap.add_argument("--curve-actions", default="b+rule", choices=["b", "b+rule"])
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/policy-learning.md")
    args = ap.parse_args(argv)
    md = run(args)
    print(md)
    if args.write:
        (ROOT / "benchmarks" / "results" / "policy-learning.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
