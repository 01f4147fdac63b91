"""evaluate: adaptive decoding with the policy vs autoregressive, every fixed block size, and the oracle.

The driver builds the held-out prompt sets (``evaluate.sources``, read exactly as ``prepare`` reads sources) into
``eval/prompts/part-NNNNN.parquet``; decoding actors (placed as in ``label``) turn each prompt shard into a result
shard ``eval/results/part-NNNNN.parquet`` with one row per prompt x method (resumable shard by shard); the driver
then writes ``eval/results.parquet`` and the summary tables ``eval/summary.md`` / ``eval/summary.csv``.

Methods per prompt, all from one shared prefill:
* ``AR``: b = 1, plain autoregressive decoding (the speedup reference);
* ``b=N``: each fixed block size (default: the paper's DFlash(4/8/16/32) scaled to B, i.e. {B/4, B/2, B, 2B},
  plus every candidate in C);
* ``adaptive``: the policy's choice from the prefill logits (its latency is measured and recorded);
* ``oracle``: the candidate with the best measured tau for this prompt (ties to the smaller b), read from the
  fixed-b decodes.

speedup = mean time per output token of AR / mean time per output token of the method, per dataset (as DFlash's
benchmark computes it). Time per output token = decode seconds / new tokens (the prefill is the same for all).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import PipelineConfig, write_resolved
from pipeline.dataset import PROMPTS_SCHEMA, encode_metadata
from pipeline.shards import (
    MANIFEST,
    check_fingerprint,
    clear_complete,
    ensure_writable,
    fingerprint_sha256,
    is_complete,
    list_shards,
    mark_complete,
    output_shard_valid,
    read_jsonl,
    shard_name,
    write_json_atomic,
    write_jsonl_atomic,
    write_parquet_atomic,
    write_text_atomic,
)

from .common import ShardTask, run_shard_actors, worker_identity

RESULT_COLUMNS = [
    ("prompt_id", pa.string()), ("source", pa.string()), ("method", pa.string()), ("kind", pa.string()),
    ("block_size", pa.int16()), ("tau", pa.float32()), ("steps", pa.int32()), ("new_tokens", pa.int32()),
    ("decode_seconds", pa.float32()), ("time_per_output_token", pa.float32()), ("prefill_seconds", pa.float32()),
    ("policy_seconds", pa.float32()), ("matches_autoregressive", pa.bool_()), ("worker", pa.string()),
]
RESULTS_SCHEMA = pa.schema(RESULT_COLUMNS)


def default_fixed_block_sizes(B: int, candidates: List[int]) -> List[int]:
    """The paper compares DFlash at b = 4, 8, 16, 32 with B = 16: {B/4, B/2, B, 2B}, plus every candidate."""
    scaled = {max(2, B // 4), max(2, B // 2), B, 2 * B}
    return sorted(scaled | set(candidates))


class EvalWorker:
    """Loads target, draft and policy once; evaluates whole prompt shards. Wrapped with ray.remote by the driver."""

    def __init__(self, cfg: PipelineConfig, policy_dir: str, fixed: List[int], meta: Dict[str, Any], threads: int = 1):
        import torch

        from pipeline.adaptive import AdaptiveDecoder
        from pipeline.engine import Engine
        from pipeline.models import load_models
        from pipeline.policy import BlockSizePolicy

        torch.set_num_threads(max(1, threads))
        self.cfg, self.fixed, self.meta = cfg, fixed, meta
        self.models = load_models(cfg.model)
        stops = self.models.stop_token_ids if cfg.decode.stop_on_eos else None
        self.engine = Engine(self.models.target, self.models.draft, stops)
        self.policy = BlockSizePolicy.from_pretrained(policy_dir, device=self.models.device)
        if self.policy.vocab_size != self.models.vocab_size:
            raise ValueError(f"policy {policy_dir} was trained on V={self.policy.vocab_size}, "
                             f"the target has V={self.models.vocab_size}")
        self.adaptive = AdaptiveDecoder(self.engine, self.policy)
        self.identity = worker_identity()

    def info(self) -> Dict[str, Any]:
        import os

        return {"identity": self.identity, "pid": os.getpid(),
                "device": f"{self.models.device}/{str(self.models.dtype).replace('torch.', '')}"}

    def _row(self, rec, method, kind, b, res, prefill_s, policy_s, ar_ids) -> Dict[str, Any]:
        import torch

        return {"prompt_id": rec["prompt_id"], "source": rec["source"], "method": method, "kind": kind,
                "block_size": b, "tau": res.tau, "steps": res.steps, "new_tokens": res.new_tokens,
                "decode_seconds": res.decode_seconds,
                "time_per_output_token": res.decode_seconds / max(1, res.new_tokens),
                "prefill_seconds": prefill_s, "policy_seconds": policy_s,
                "matches_autoregressive": bool(torch.equal(res.output_ids, ar_ids)), "worker": self.identity}

    def evaluate_shard(self, in_path: str, out_path: str, rejects_path: str) -> Dict[str, Any]:
        import torch

        from pipeline.labeling import argmax_smallest

        d = self.cfg.decode
        kw = dict(max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
                  seed=d.seed)
        cands = self.policy.candidates
        table = pq.read_table(in_path, columns=["prompt_id", "source", "input_ids"])
        rows: List[Dict[str, Any]] = []
        rejects = []
        t0 = time.perf_counter()
        for rec in table.to_pylist():
            try:
                ids = torch.tensor(rec["input_ids"], dtype=torch.long)[None]
                state = self.engine.prefill(ids)
                ar = self.engine.decode(state, block_size=1, **kw)
                fixed = {b: self.engine.decode(state, block_size=b, **kw) for b in sorted(set(self.fixed) | set(cands))}
                ad = self.adaptive.generate(ids, state=state, **kw)
            except Exception as err:  # one prompt's failure must not lose the shard
                if "out of memory" in str(err).lower() and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                rejects.append({"prompt_id": rec["prompt_id"], "source": rec["source"], "reason": "decode_error",
                                "detail": f"{type(err).__name__}: {err}"[:500], "worker": self.identity})
                continue
            p = state.prefill_seconds
            out = [self._row(rec, "AR", "autoregressive", 1, ar, p, None, ar.output_ids)]
            out += [self._row(rec, f"b={b}", "fixed", b, fixed[b], p, None, ar.output_ids) for b in self.fixed]
            out.append(self._row(rec, "adaptive", "adaptive", ad.block_size, ad.decode, p, ad.policy_seconds,
                                 ar.output_ids))
            best = cands[argmax_smallest([fixed[b].tau for b in cands])]
            out.append(self._row(rec, "oracle", "oracle", best, fixed[best], p, None, ar.output_ids))
            rows.extend(out)
        out_table = pa.Table.from_pylist(rows, schema=RESULTS_SCHEMA.with_metadata(encode_metadata(self.meta)))
        write_jsonl_atomic(rejects, Path(rejects_path))
        write_parquet_atomic(out_table, Path(out_path), compression="zstd")
        return {"rows": table.num_rows - len(rejects), "rejects": len(rejects), "worker": self.identity,
                "seconds": time.perf_counter() - t0}


def methods_for(fixed: List[int]) -> List[str]:
    return ["AR", *[f"b={b}" for b in fixed], "adaptive", "oracle"]


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    from pipeline.models import load_tokenizer
    from pipeline.policy import BlockSizePolicy
    from pipeline.sources import build_prompts

    t_start = time.monotonic()
    out = Path(cfg.output_dir)
    policy_dir, eval_dir = out / "train" / "policy", out / "eval"
    if not is_complete(out / "train"):
        raise FileNotFoundError(f"no trained policy in {policy_dir} (run `blockpilot train` first)")
    ensure_writable(eval_dir)
    policy = BlockSizePolicy.from_pretrained(policy_dir)
    cands = policy.candidates
    B = int(policy.info.get("trained_block_size", cands[len(cands) // 2]))
    fixed = sorted(cfg.evaluate.fixed_block_sizes or default_fixed_block_sizes(B, cands))
    fp = {"model": vars(cfg.model), "decode": vars(cfg.decode),
          "sources": json.loads(json.dumps([vars(s) for s in cfg.evaluate.sources])), "limit": cfg.evaluate.limit,
          "fixed": fixed, "policy": (policy_dir / "policy.json").read_text(),
          "max_prompt_tokens": cfg.prepare.max_prompt_tokens}
    has_output = any(list_shards(eval_dir / sub) for sub in ("prompts", "results")) or is_complete(eval_dir)
    if check_fingerprint(eval_dir, fp, cfg.force, has_output):
        print(f"[evaluate] force=true: config changed, discarding earlier results in {eval_dir}", flush=True)
        for sub in ("prompts", "results"):
            for p in list_shards(eval_dir / sub):
                p.unlink()
            clear_complete(eval_dir / sub)
        clear_complete(eval_dir)
    if is_complete(eval_dir):
        print(f"[evaluate] {eval_dir}: complete, nothing to do", flush=True)
        return json.loads((eval_dir / "summary.json").read_text())
    fp_sha = fingerprint_sha256(fp)
    write_resolved(cfg, eval_dir)

    prompts_dir, results_dir = eval_dir / "prompts", eval_dir / "results"
    if not is_complete(prompts_dir):
        tokenizer = load_tokenizer(cfg.model)
        rows, rejects, stats = build_prompts(
            cfg.evaluate.sources, tokenizer, cfg.prepare.max_prompt_tokens, cfg.prepare.apply_chat_template,
            cfg.model.enable_thinking, cfg.evaluate.limit, section="evaluate",
            log=(lambda m: print(m, flush=True)) if cfg.progress else None)
        prompts_dir.mkdir(parents=True, exist_ok=True)
        size = cfg.prepare.shard_size
        for i in range(0, len(rows), size):
            write_parquet_atomic(pa.Table.from_pylist(rows[i:i + size], schema=PROMPTS_SCHEMA),
                                 prompts_dir / shard_name(i // size))
        write_jsonl_atomic(rejects, prompts_dir / "rejects.jsonl")
        write_json_atomic({"rows": len(rows), "rejects": len(rejects), "stats": stats}, prompts_dir / MANIFEST)
        mark_complete(prompts_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    methods = methods_for(fixed)
    todo = []
    for p in list_shards(prompts_dir):
        n = pq.read_metadata(p).num_rows
        o, rj = results_dir / p.name, results_dir / p.with_suffix(".jsonl").name.replace("part-", ".rejects-")
        if not output_shard_valid(o, n, rj, fp_sha, rows_per_input=len(methods)):
            todo.append(ShardTask(p.name, (str(p), str(o), str(rj)), n))
    print(f"[evaluate] methods {methods}; {len(todo)} prompt shard(s) to evaluate", flush=True)
    failures: List[str] = []
    if todo:
        meta = {"fingerprint_sha256": fp_sha, "candidates": cands, "fixed_block_sizes": fixed,
                "temperature": cfg.decode.temperature, "max_new_tokens": cfg.decode.max_new_tokens}
        _, failures = run_shard_actors(cfg, EvalWorker, (cfg, str(policy_dir), fixed, meta), "evaluate_shard",
                                       todo, cfg.evaluate.num_workers, "evaluate")
    if failures:
        raise RuntimeError(f"evaluate: {len(failures)} shard(s) failed after retries: {', '.join(failures)}; "
                           "rerun to retry them")
    results = pa.concat_tables([pq.read_table(p) for p in list_shards(results_dir)])
    decode_rejects = [r for p in sorted(results_dir.glob(".rejects-*.jsonl")) for r in read_jsonl(p)]
    if results.num_rows == 0:
        first = decode_rejects[0]["detail"] if decode_rejects else "no prompts"
        raise RuntimeError(f"evaluate: every prompt failed ({len(decode_rejects)} rejects; first: {first})")
    write_parquet_atomic(results, eval_dir / "results.parquet", compression="zstd")
    summary = summarize(results, methods)
    summary.update({"stage": "evaluate", "output": str(eval_dir), "candidates": cands, "fixed_block_sizes": fixed,
                    "trained_block_size": B,
                    "decode_rejects": len(decode_rejects), "wall_seconds": round(time.monotonic() - t_start, 1)})
    write_text_atomic(render_markdown(summary), eval_dir / "summary.md")
    write_text_atomic(render_csv(summary), eval_dir / "summary.csv")
    write_json_atomic(summary, eval_dir / "summary.json")
    mark_complete(eval_dir)
    print(render_markdown(summary), flush=True)
    return summary


def summarize(results: pa.Table, methods: List[str]) -> Dict[str, Any]:
    """Per dataset and method: mean tau, speedup vs AR (ratio of mean time per output token), and more."""
    import polars as pl

    df = pl.from_arrow(results)
    datasets = sorted(df["source"].unique().to_list())
    per = (df.group_by(["source", "method"])
             .agg(pl.col("tau").mean().alias("tau"), pl.col("time_per_output_token").mean().alias("tpot"),
                  pl.col("matches_autoregressive").mean().alias("lossless"), pl.len().alias("prompts"),
                  pl.col("policy_seconds").mean().alias("policy_seconds"),
                  pl.col("prefill_seconds").mean().alias("prefill_seconds")))
    table: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {"tau": {}, "speedup": {}, "lossless": {}}
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
            table["lossless"][m][ds] = float(row["lossless"][0])
        for metric in table:
            vals = [v for v in table[metric][m].values() if v is not None]
            table[metric][m]["average"] = sum(vals) / len(vals) if vals else None
    adaptive = df.filter(pl.col("method") == "adaptive")
    chosen = adaptive.group_by("block_size").len().sort("block_size")
    return {
        "datasets": datasets, "methods": methods, "tables": table,
        "prompts": {ds: int(df.filter((pl.col("source") == ds) & (pl.col("method") == "AR")).height)
                    for ds in datasets},
        "adaptive_choices": {int(b): int(n) for b, n in zip(chosen["block_size"], chosen["len"])},
        "policy_ms_mean": float(adaptive["policy_seconds"].mean() * 1e3) if adaptive.height else None,
        "prefill_ms_mean": float(adaptive["prefill_seconds"].mean() * 1e3) if adaptive.height else None,
    }


def _fmt(v: Optional[float], digits: int = 2, suffix: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def render_markdown(s: Dict[str, Any]) -> str:
    cols = [*s["datasets"], "average"]
    out = ["# Evaluation", "",
           f"Prompts per dataset: {s['prompts']}. Candidates {s['candidates']}; policy latency "
           f"{_fmt(s['policy_ms_mean'], 3)} ms vs prefill {_fmt(s['prefill_ms_mean'], 3)} ms (mean). "
           f"Adaptive choices: {s['adaptive_choices']}.", ""]
    for metric, title, suffix in (("tau", "Acceptance length tau (tokens per verify step)", ""),
                                  ("speedup", "Speedup vs autoregressive (ratio of mean time per output token)", "x"),
                                  ("lossless", "Share of prompts whose output equals autoregressive output", "")):
        out += [f"## {title}", "", "| method | " + " | ".join(cols) + " |",
                "| --- |" + " ---: |" * len(cols)]
        for m in s["methods"]:
            vals = s["tables"][metric].get(m, {})
            out.append(f"| {m} | " + " | ".join(_fmt(vals.get(c), 2, suffix) for c in cols) + " |")
        out.append("")
    return "\n".join(out)


def render_csv(s: Dict[str, Any]) -> str:
    cols = [*s["datasets"], "average"]
    lines = ["metric,method," + ",".join(cols)]
    for metric in ("tau", "speedup"):
        for m in s["methods"]:
            vals = s["tables"][metric].get(m, {})
            lines.append(f"{metric},{m}," + ",".join("" if vals.get(c) is None else f"{vals[c]:.4f}" for c in cols))
    return "\n".join(lines) + "\n"
