"""Per dataset and method: what evaluate's result rows sum up to (tau, speedup vs AR, the modelled speedup, the
share of lossless outputs), the policy's choices, and the folded policy's agreement with the policy on logits."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import pyarrow as pa

from pipeline.evaluation.results import MODELLED_TPOT



def summarize(results: pa.Table, methods: List[str]) -> Dict[str, Any]:
    """Per dataset and method: mean tau, speedup vs AR (ratio of mean time per output token), and more."""
    import polars as pl

    df = pl.from_arrow(results)
    modelled = MODELLED_TPOT in df.columns
    datasets = sorted(df["source"].unique().to_list())
    per = (df.group_by(["source", "method"])
             .agg(pl.col("tau").mean().alias("tau"), pl.col("time_per_output_token").mean().alias("tpot"),
                  (pl.col(MODELLED_TPOT).mean() if modelled else pl.lit(None, pl.Float64))
                  .alias("mtpot"),
                  pl.col("matches_autoregressive").mean().alias("lossless"), pl.len().alias("prompts"),
                  pl.col("policy_seconds").mean().alias("policy_seconds"),
                  pl.col("prefill_seconds").mean().alias("prefill_seconds")))
    table: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {"tau": {}, "speedup": {}, "lossless": {}}
    if modelled:  # steps x profiled step cost: deterministic at T = 0, free of the shared machine's noise
        table["modelled_speedup"] = {}
    for m in methods:
        for metric in table:
            table[metric][m] = {}
        for ds in datasets:
            row = per.filter((pl.col("source") == ds) & (pl.col("method") == m))
            ar = per.filter((pl.col("source") == ds) & (pl.col("method") == "AR"))
            if row.height == 0:
                continue
            table["tau"][m][ds] = float(row["tau"][0])
            table["speedup"][m][ds] = float(ar["tpot"][0] / row["tpot"][0]) if ar.height else None
            lossless = row["lossless"][0]  # null at T > 0: checked by distribution instead
            table["lossless"][m][ds] = None if lossless is None else float(lossless)
            if modelled:
                table["modelled_speedup"][m][ds] = float(ar["mtpot"][0] / row["mtpot"][0]) if ar.height else None
        for metric in table:
            vals = [v for v in table[metric][m].values() if v is not None]
            table[metric][m]["average"] = sum(vals) / len(vals) if vals else None
    adaptive = df.filter(pl.col("method") == "adaptive")

    def choices(rows) -> Dict[str, int]:  # prompts per policy action, block sizes first then rule actions, by b
        counts = rows.group_by("policy_action", "policy_block_size").len()
        counts = counts.with_columns(pl.col("policy_action").str.contains("@").alias("ruled"))
        return {a: int(n) for a, _, n, _ in counts.sort("ruled", "policy_block_size", "policy_action").iter_rows()}

    return {
        "datasets": datasets, "methods": methods, "tables": table,
        "prompts": {ds: int(df.filter((pl.col("source") == ds) & (pl.col("method") == "AR")).height)
                    for ds in datasets},
        "adaptive_choices": choices(adaptive),
        "adaptive_choices_per_set": {ds: choices(adaptive.filter(pl.col("source") == ds)) for ds in datasets},
        "adaptive_rule_rows": int(adaptive["step_rule"].is_not_null().sum()),
        "policy_ms_mean": float(adaptive["policy_seconds"].mean() * 1e3) if adaptive.height else None,
        "prefill_ms_mean": float(adaptive["prefill_seconds"].mean() * 1e3) if adaptive.height else None,
    }


def folded_agreement(results: pa.Table) -> Dict[str, Any]:
    """On every adaptive row: did the folded policy (final hidden state; what adaptive ran) choose what the policy
    on raw logits (as trained) chose?"""
    rows = [r for r in results.select(["method", "policy_action", "unfolded_action"]).to_pylist()
            if r["method"] == "adaptive" and r["unfolded_action"] is not None]
    agree = sum(r["policy_action"] == r["unfolded_action"] for r in rows)
    return {"prompts": len(rows), "agree": agree, "all_equal": agree == len(rows)}
