"""report: tables and plots over the label set, training and evaluation -> ``output_dir/report/``.

Reads only what the other stages wrote (polars over the Parquet files, the train summary and metrics, the eval
results); it runs no model except the exported policy, once over the val rows, for the confusion matrix.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from pipeline.runtime.config import PipelineConfig
from pipeline.executor.folder import StageFolder
from pipeline.runtime.log import get as log
from pipeline.io.shards import is_complete, list_shards, write_text_atomic
from pipeline.evaluation.table import headline_rows
from pipeline.evaluation.rule_search import adoption_line
from pipeline.io.layout import CONFIG, POLICY, STEP_RULE, SUMMARY, RunLayout
from pipeline.io.storage import location, read_table, savefig


def _save(fig, path) -> None:
    """Every plot of the report: tight layout, written where the report goes (local or object storage), closed."""
    fig.tight_layout()
    savefig(fig, path, dpi=90)
    _plt().close(fig)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _md_table(header: List[str], rows: List[List[Any]]) -> str:
    fmt = [lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(fmt[0](v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def label_section(labels_dir: Path, out: Path) -> List[str]:
    import polars as pl

    cols = ["prompt_id", "source", "candidates", "tau", "label_block_size", "label_speedup_block_size"]
    df = pl.concat([pl.from_arrow(read_table(p, columns=cols)) for p in list_shards(labels_dir)])
    cands = df["candidates"][0].to_list()
    tau = np.array(df["tau"].to_list(), dtype=np.float64)
    sources = sorted(df["source"].unique().to_list())
    md = ["## Label set", "", f"{df.height} labelled prompts from {len(sources)} source(s); candidates {cands}.", ""]
    rows = []
    for src in sources:
        sub = df.filter(pl.col("source") == src)
        counts = [int((sub["label_block_size"] == b).sum()) for b in cands]
        rows.append([src, sub.height, *[f"{c} ({c / sub.height:.0%})" for c in counts]])
    md += ["Optimal block size (argmax tau, ties to the smaller b) per source:", "",
           _md_table(["source", "prompts", *[f"b={b}" for b in cands]], rows), ""]
    q = np.percentile(tau, [25, 50, 75], axis=0)
    md += ["Tau per candidate over all prompts:", "",
           _md_table(["b", "mean tau", "p25", "median", "p75"],
                     [[b, float(tau[:, i].mean()), float(q[0, i]), float(q[1, i]), float(q[2, i])]
                      for i, b in enumerate(cands)]), ""]
    speed = [int((df["label_speedup_block_size"] == b).sum()) for b in cands]
    md += [f"Cost-aware label (argmax tau/cost) histogram: {dict(zip(cands, speed))}.", ""]

    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(1, len(sources))
    for k, src in enumerate(sources):
        sub = df.filter(pl.col("source") == src)
        share = [float((sub["label_block_size"] == b).mean()) for b in cands]
        ax.bar(np.arange(len(cands)) + k * width, share, width, label=src)
    ax.set(xticks=np.arange(len(cands)) + width * (len(sources) - 1) / 2, xticklabels=[str(b) for b in cands],
           xlabel="optimal block size", ylabel="share of prompts", title="Optimal b per source")
    ax.legend()
    _save(fig, out / "optimal_b_hist.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.fill_between(cands, q[0], q[2], alpha=0.3, label="25-75%")
    ax.plot(cands, q[1], marker="o", label="median")
    ax.plot(cands, tau.mean(axis=0), marker="s", linestyle="--", label="mean")
    ax.set(xlabel="block size b", ylabel="tau", title="Acceptance length against b")
    ax.legend()
    _save(fig, out / "tau_vs_b.png")
    md += ["![optimal b per source](optimal_b_hist.png) ![tau against b](tau_vs_b.png)", ""]
    return md


def train_section(train_dir: Path, labels_dir: Path, out: Path) -> List[str]:
    import polars as pl
    import torch

    from pipeline.policy.blocksize import BlockSizePolicy, is_val, train_chosen_block_size

    s = json.loads((train_dir / SUMMARY).read_text())
    f = s["final"]
    md = ["## Policy", "", f"{s['train_rows']} train / {s['val_rows']} val rows, {s['epochs']} epochs; "
          f"training curves: ![curves](../train/curves.png)", ""]
    if "val_accuracy" in f:
        md += [_md_table(["metric", "value"], [
            ["val accuracy", f["val_accuracy"]],
            [f"val majority-class accuracy ({s.get('majority_class', 'b=' + str(s['majority_class_block_size']))})",
             s["val_majority_accuracy"]],
            ["val top-2 accuracy", f["val_top2_accuracy"]],
            ["val mean tau: policy", f["val_tau_policy"]],
            [f"val mean tau: train-chosen b={train_chosen_block_size(s)}", f["val_tau_best_fixed"]],
            ["val mean tau: trained B", f["val_tau_trained_b"]],
            ["val mean tau: oracle", f["val_tau_oracle"]],
            ["val regret (oracle - policy)", f["val_regret"]]]), ""]
    policy = BlockSizePolicy.from_pretrained(train_dir / POLICY)
    from omegaconf import OmegaConf

    # The split the policy was trained with, from the train stage's resolved config.
    val_fraction = float(OmegaConf.create((train_dir / CONFIG).read_text()).train.val_fraction)
    label_col = "label_speedup_block_size" if policy.info.get("label") == "speedup" else "label_block_size"
    rows = []
    for p in list_shards(labels_dir):
        d = pl.from_arrow(read_table(p, columns=["prompt_id", "logits", label_col]))
        rows.append(d.filter(pl.col("prompt_id").map_elements(lambda i: is_val(i, val_fraction),
                                                                return_dtype=pl.Boolean)))
    val = pl.concat(rows)
    if val.height:
        x = torch.from_numpy(np.stack(val["logits"].to_numpy()).astype(np.float32))
        cm, names = confusion(policy, x, val[label_col].to_list())
        cands = policy.candidates
        plt = _plt()
        fig, ax = plt.subplots(figsize=(4.5 + 0.8 * (len(names) - len(cands)), 4))
        ax.imshow(cm, cmap="Blues")
        for i in range(len(cands)):
            for j in range(len(names)):
                ax.text(j, i, str(cm[i, j]), ha="center", va="center")
        ax.set(xticks=range(len(names)), yticks=range(len(cands)), yticklabels=cands,
               xlabel="policy's choice", ylabel="label", title="Confusion matrix (val)")
        ax.set_xticklabels(names, rotation=30 if len(names) > len(cands) else 0, ha="right" if len(names) > len(cands) else "center")
        _save(fig, out / "confusion.png")
        md += ["![confusion matrix](confusion.png)", ""]
    return md


def confusion(policy, logits, labels: List[int]):
    """The val confusion counts [label, action] and the actions' names. Rows: the label (a candidate b); columns:
    the policy's actions, the candidates then its rule actions, whose b_max need not be a candidate (b_max = 10 over
    candidates 7..9 once crashed this table)."""
    names = [a.name for a in policy.actions]
    cm = np.zeros((len(policy.candidates), len(names)), dtype=int)
    for t, a in zip(labels, policy.choose_actions(logits)):
        cm[policy.candidates.index(int(t)), policy.actions.index(a)] += 1
    return cm, names


def eval_section(eval_dir: Path, out: Path) -> List[str]:
    s = json.loads((eval_dir / SUMMARY).read_text())
    md = ["## Evaluation (held-out prompt sets)", "", (eval_dir / "summary.md").read_text().split("\n", 1)[1], ""]
    plt = _plt()
    methods, datasets = s["methods"], [*s["datasets"], "average"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods)), 3.8))
    width = 0.8 / len(datasets)
    for k, ds in enumerate(datasets):
        vals = [s["tables"]["speedup"][m].get(ds) or 0.0 for m in methods]
        ax.bar(np.arange(len(methods)) + k * width, vals, width, label=ds)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xticks=np.arange(len(methods)) + width * (len(datasets) - 1) / 2, xticklabels=methods,
           ylabel="speedup vs AR", title="Speedup per dataset and method")
    ax.legend(fontsize=8)
    _save(fig, out / "speedup.png")
    md += ["![speedup per dataset and method](speedup.png)", ""]
    dist = (s.get("distribution") or {}).get("methods")
    if dist:  # T > 0: the share of each method's tokens per PIT bin, flat at 1 / bins when it samples as the target
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        for m, v in dist.items():
            bins = len(v["histogram"])
            ax.plot((np.arange(bins) + 0.5) / bins, np.asarray(v["histogram"]) * bins, marker=".", linewidth=0.8,
                    label=m)
        ax.axhline(1.0, color="black", linewidth=1.2)
        ax.set(xlabel="PIT of the token under the target's sampling distribution", ylabel="density (1 = exact)",
               title="Output distribution at T > 0, per method")
        ax.legend(fontsize=6, ncol=3)
        _save(fig, out / "distribution.png")
        md += ["![output distribution per method](distribution.png)", ""]
    return md


def tune_section(tune_dir: Path, out: Path) -> List[str]:
    """The per-step rule tune chose (on held-out label prompts): its table, per-step traces of a few prompts, and
    the distribution of verified lengths per rule variant."""
    import polars as pl

    choice = json.loads((tune_dir / STEP_RULE).read_text())
    df = pl.concat([pl.from_arrow(read_table(p)) for p in list_shards(tune_dir)])
    md = ["## Per-step verify length", "",
          f"Chosen on {choice['prompts']} {choice['chosen_on']}: `{choice['rule']}` at b_max={choice['max_block_size']}"
          f", modelled gain {choice['gain']:+.2%} over b={choice['baseline_b']} there.", "",
          *([adoption_line(choice["adoption"]) + ".", ""] if choice.get("adoption") else []),
          _md_table(["method", "modelled time per token (ms)", "gain vs the fixed b", "share of the per-step oracle's"],
                    [[t["method"], t["modelled_time_per_token"] * 1e3, f"{t['gain']:+.2%}",
                      "-" if t.get("oracle_gain_captured") is None else f"{t['oracle_gain_captured']:.0%}"]
                     for t in choice["table"]]),
          ""]
    oracle = choice.get("per_step_oracle")
    if oracle:  # format of tune since the simulating search (older step_rule.json files have none)
        md += [f"Per-step oracle (the best verify length at each step in hindsight): modelled gain "
               f"{oracle['gain']:+.2%} over b={choice['baseline_b']}. Simulated against decoded on the confirmation "
               f"prompts: {choice.get('confirmed', {}).get('simulated_equals_decoded', '-')} equal.", ""]
    rel = choice.get("reliability")
    if rel and rel.get("table"):
        md += [f"Acceptance model (learned rule) on the val split: log loss {rel['log_loss']:.4f} against "
               f"{rel['base_rate_log_loss']:.4f} for the base rate; reliability per decile of predicted acceptance:",
               "", _md_table(["decile", "predicted", "observed", "slots"],
                             [[r["decile"], r["predicted"], r["observed"], r["slots"]] for r in rel["table"]]), ""]
    chosen = f"{choice['rule']}@{choice['max_block_size']}"
    base = f"b={choice['baseline_b']}"
    plt = _plt()
    ids = df.filter(pl.col("method") == chosen)["prompt_id"].unique().sort().to_list()[:3]
    fig, axes = plt.subplots(1, max(1, len(ids)), figsize=(4.5 * max(1, len(ids)), 3.4), squeeze=False)
    for ax, pid in zip(axes[0], ids):
        for method, style in ((chosen, "-"), (base, ":")):
            row = df.filter((pl.col("prompt_id") == pid) & (pl.col("method") == method)).row(0, named=True)
            ax.step(range(1, len(row["committed"]) + 1), row["committed"], style, where="mid",
                    label=f"{method} committed")
            if method == chosen:
                ax.step(range(1, len(row["verified"]) + 1), [v + 1 for v in row["verified"]], "--", where="mid",
                        label=f"{method} verified + 1")
        ax.set(title=pid[:24], xlabel="step", ylabel="tokens")
    axes[0][0].legend(fontsize=7)
    _save(fig, out / "per_step_traces.png")
    methods = [t["method"] for t in choice["table"]][:6]
    # Every val prompt's simulated lengths (tune decodes only a few prompts, and only some rules).
    simulated = tune_dir / "simulated.parquet"
    sim = pl.from_arrow(read_table(simulated)) if simulated.exists() else df
    fig, ax = plt.subplots(figsize=(7, 3.4))
    top = int(sim["block_size"].max())
    for method in methods:
        v = [x for lst in sim.filter(pl.col("method") == method)["verified"].to_list() if lst for x in lst]
        if v:  # a density of nothing divides by zero
            ax.hist(v, bins=np.arange(0.5, top + 0.5), histtype="step", density=True, label=method)
    ax.set(xlabel="drafted tokens verified per step", ylabel="share of steps",
           title="Verified length per rule (held-out label prompts)")
    ax.legend(fontsize=7)
    _save(fig, out / "per_step_verified.png")
    md += ["![per-step traces](per_step_traces.png) ![verified lengths](per_step_verified.png)", ""]
    return md


def deploy_section(output_dir: Path) -> List[str]:
    """What to set in vLLM / SGLang (pipeline/evaluation/deploy.py), short; `blockpilot deploy` prints it whole."""
    from pipeline.evaluation.deploy import load_deploy, render

    try:
        return ["## Deploy", "", render(load_deploy(output_dir), short=True)]
    except (FileNotFoundError, KeyError, ValueError) as err:  # the rest of the report still stands without it
        return ["## Deploy", "", f"No deploy settings: {err}", ""]


def headline(output_dir: Path) -> Dict[str, Any]:
    """What `blockpilot run` ends with: the table rows (pipeline.evaluation.table) and evaluate's whole headline
    (modelled and wall, per set, intervals, the rule and the policy apart), from eval/summary.json."""
    p = RunLayout(output_dir).eval / SUMMARY
    if not p.exists():
        return {}
    s = json.loads(p.read_text())
    return {"rows": headline_rows(s), "train_chosen_b": s.get("train_chosen_b"),
            "trained_block_size": s.get("trained_block_size"), **s.get("headline", {}),
            "comparisons": s.get("comparisons", []), "folded_policy": s.get("folded_policy")}


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t0 = time.monotonic()
    root = location(cfg.output_dir)
    run_dir = RunLayout(root)
    out = run_dir.report
    folder = StageFolder(out, "report")  # no fingerprint: a report is always remade from what is there
    folder.ensure_writable()
    folder.start(cfg)
    md = ["# BlockPilot report", "", f"Run folder: `{root}`.", ""]
    done = []
    if is_complete(run_dir.labels):
        md += label_section(run_dir.labels, out)
        done.append("labels")
    if is_complete(run_dir.train):
        md += train_section(run_dir.train, run_dir.labels, out)
        done.append("train")
    if is_complete(run_dir.tune):
        md += tune_section(run_dir.tune, out)
        done.append("tune")
    if is_complete(run_dir.eval):
        md += eval_section(run_dir.eval, out)
        done.append("eval")
    if is_complete(run_dir.train):  # after the results it rests on
        md += deploy_section(root)
        done.append("deploy")
    if not done:
        raise FileNotFoundError(f"nothing to report in {root}: no complete labels, train or eval stage")
    write_text_atomic("\n".join(md) + "\n", out / "report.md")
    summary = {"stage": "report", "status": "done", "report": str(out / "report.md"), "sections": done,
               "plots": sorted(p.name for p in out.glob("*.png")), "headline": headline(root),
               "wall_seconds": round(time.monotonic() - t0, 1)}
    folder.complete(summary)
    log("report").info(f"done: {len(done)} section(s) ({', '.join(done)}), {len(summary['plots'])} plot(s); "
                       f"{summary['wall_seconds']} s -> {out / 'report.md'}")
    return summary
