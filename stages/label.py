"""label: Ray actors measure tau at every candidate block size for every prompt and write label shards (schema v1).

Shards, not Ray Data: each prompt shard ``prompts/part-NNNNN.parquet`` becomes exactly one label shard
``labels/part-NNNNN.parquet`` written atomically by the actor that labelled it. A shard is the unit of work, of
retry and of resume (datatrove style): a rerun re-labels only shards whose output is missing or invalid, so a kill
at any point loses at most the shards in flight and never duplicates a row. Ray Data's writer names files itself
and its checkpointing is row-based, which gives neither guarantee for shard-aligned outputs.

Placement: one actor per GPU (``num_gpus=1``, each loads target and draft once), or ``label.num_workers`` CPU
actors when the cluster has no GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import __version__
from pipeline.config import PipelineConfig, write_resolved
from pipeline.dataset import (
    LABELS_SCHEMA_VERSION,
    encode_metadata,
    labels_card,
    labels_schema,
)
from pipeline.shards import (
    MANIFEST,
    check_fingerprint,
    clear_complete,
    ensure_writable,
    file_sha256,
    is_complete,
    list_shards,
    mark_complete,
    read_jsonl,
    write_json_atomic,
    write_jsonl_atomic,
    write_parquet_atomic,
    fingerprint_sha256,
    output_shard_valid,
    write_text_atomic,
)

from .common import ShardTask, run_shard_actors, worker_identity

REJECTS_DIR = "_rejects"  # per-shard reject files; the leading underscore keeps Parquet readers out of it
SUMMARY_COLUMNS = ["prompt_id", "source", "candidates", "tau", "steps", "new_tokens", "label_block_size",
                   "label_index", "label_speedup_block_size"]


# ---- settings every worker and the driver agree on ---------------------------------------------------------------

def trained_block_size(cfg: PipelineConfig) -> int:
    """B: label.block_size, else the draft's config (read without loading weights)."""
    if cfg.label.block_size:
        return int(cfg.label.block_size)
    from dflash.model import _draft_value
    from transformers import PretrainedConfig

    from pipeline.models import resolve_location

    draft_cfg = PretrainedConfig.from_pretrained(resolve_location(cfg.model.draft), revision=cfg.model.draft_revision)
    return int(_draft_value(draft_cfg, "block_size", 16))


def resolve_mode(cfg: PipelineConfig) -> str:
    """auto = replay at T = 0 (exact there, and much cheaper), exhaustive otherwise."""
    if cfg.label.mode != "auto":
        return cfg.label.mode
    return "replay" if cfg.decode.temperature == 0 else "exhaustive"


def fingerprint(cfg: PipelineConfig, candidates: List[int], prompts_manifest_sha: str) -> Dict[str, Any]:
    """The config values that change the label rows: mixing shards made with different ones is refused."""
    from pipeline.models import model_revision

    m, d = cfg.model, cfg.decode
    return {
        "target": m.target, "target_revision": model_revision(m.target, m.target_revision),
        "draft": m.draft, "draft_revision": model_revision(m.draft, m.draft_revision),
        "dtype": m.dtype, "candidates": candidates, "temperature": d.temperature, "top_p": d.top_p,
        "top_k": d.top_k, "max_new_tokens": d.max_new_tokens, "seed": d.seed, "stop_on_eos": d.stop_on_eos,
        "enable_thinking": m.enable_thinking, "prompts_manifest_sha256": prompts_manifest_sha,
        "schema_version": LABELS_SCHEMA_VERSION,
    }


# ---- the actor ---------------------------------------------------------------------------------------------------

class LabelWorker:
    """Loads target and draft once; labels whole shards. Wrapped with ray.remote by the driver."""

    def __init__(self, cfg: PipelineConfig, candidates: List[int], mode: str, meta: Dict[str, Any],
                 threads: int = 1):
        import torch

        from pipeline.engine import Engine
        from pipeline.labeling import measure_step_costs
        from pipeline.models import load_models

        torch.set_num_threads(max(1, threads))
        self.cfg, self.candidates, self.mode = cfg, candidates, mode
        self.models = load_models(cfg.model)
        stops = self.models.stop_token_ids if cfg.decode.stop_on_eos else None
        self.engine = Engine(self.models.target, self.models.draft, stops)
        self.identity = worker_identity()
        self.step_cost = measure_step_costs(self.engine, candidates, self.models.vocab_size,
                                            steps=cfg.label.cost_probe_steps, seed=cfg.decode.seed)
        self.meta = dict(meta, step_cost_seconds=self.step_cost, label_mode=mode,
                         device=f"{self.models.device}/{str(self.models.dtype).replace('torch.', '')}",
                         vocab_size=self.models.vocab_size, worker=self.identity)
        self.decode_errors = 0

    def info(self) -> Dict[str, Any]:
        import ray

        return {"identity": self.identity, "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(), "device": self.meta["device"],
                "step_cost_seconds": {b: round(c, 6) for b, c in self.step_cost.items()}}

    def label_shard(self, in_path: str, out_path: str, rejects_path: str) -> Dict[str, Any]:
        import numpy as np
        import torch

        from pipeline import labeling

        d = self.cfg.decode
        table = pq.read_table(in_path, columns=["prompt_id", "source", "input_ids", "prompt_tokens"])
        rows: Dict[str, list] = {name: [] for name in labels_schema(1).names}
        logits_rows: List[np.ndarray] = []
        rejects = []
        t0 = time.perf_counter()
        label_fn = labeling.replay_label_prompt if self.mode == "replay" else labeling.label_prompt
        for i, rec in enumerate(table.to_pylist()):
            try:
                ids = torch.tensor(rec["input_ids"], dtype=torch.long)[None]
                out = label_fn(self.engine, ids, self.candidates, d.max_new_tokens, temperature=d.temperature,
                               top_p=d.top_p, top_k=d.top_k, seed=d.seed, step_cost=self.step_cost)
                logits = labeling.logits_to_numpy(out.logits)
                if not np.isfinite(logits).all():
                    raise FloatingPointError("non-finite prefill logits (float16 overflow or NaN)")
            except Exception as err:  # one prompt's failure must not lose the shard
                self.decode_errors += 1
                if "out of memory" in str(err).lower() and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                rejects.append({"prompt_id": rec["prompt_id"], "source": rec["source"], "reason": "decode_error",
                                "detail": f"{type(err).__name__}: {err}"[:500], "worker": self.identity})
                continue
            logits_rows.append(logits)
            rows["prompt_id"].append(rec["prompt_id"])
            rows["source"].append(rec["source"])
            rows["prompt_tokens"].append(rec["prompt_tokens"])
            rows["candidates"].append(out.candidates)
            rows["tau"].append(out.tau)
            rows["steps"].append(out.steps)
            rows["new_tokens"].append(out.new_tokens)
            rows["decode_seconds"].append(out.decode_seconds)
            rows["label_block_size"].append(out.label_block_size)
            rows["label_index"].append(out.label_index)
            rows["label_speedup_block_size"].append(out.candidates[out.label_speedup_index])
            rows["prefill_seconds"].append(out.prefill_seconds)
            rows["worker"].append(self.identity)
            if self.cfg.progress and (i + 1) % 16 == 0:
                print(f"[label {self.identity}] {Path(in_path).name}: {i + 1}/{table.num_rows} prompts "
                      f"({(i + 1) / (time.perf_counter() - t0):.2f}/s)", flush=True)
        vocab = self.models.vocab_size
        schema = labels_schema(vocab)
        flat = np.concatenate(logits_rows) if logits_rows else np.zeros(0, dtype=np.float16)
        arrays = []
        for f in schema:
            if f.name == "logits":
                arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float16()), vocab))
            else:
                arrays.append(pa.array(rows[f.name], type=f.type))
        meta = dict(self.meta, input_shard=Path(in_path).name)
        out_table = pa.Table.from_arrays(arrays, schema=schema.with_metadata(encode_metadata(meta)))
        # Rejects first, then the shard: the shard's presence is what marks the work done.
        write_jsonl_atomic(rejects, Path(rejects_path))
        write_parquet_atomic(
            out_table, Path(out_path), compression="zstd", use_byte_stream_split=["logits.list.element"],
            use_dictionary=["source", "worker"],
            # ~128 MB of logits per row group keeps readers' memory bounded at full vocabulary.
            row_group_size=max(1, min(max(1, out_table.num_rows), (128 << 20) // (2 * vocab))),
        )
        return {"shard": Path(out_path).name, "rows": out_table.num_rows, "rejects": len(rejects),
                "seconds": time.perf_counter() - t0, "worker": self.identity}


# ---- the driver --------------------------------------------------------------------------------------------------

def _require_prompts(prompts_dir: Path) -> str:
    if not is_complete(prompts_dir):
        raise FileNotFoundError(f"no complete prompt shards in {prompts_dir} (run `blockpilot prepare` first)")
    return file_sha256(prompts_dir / MANIFEST)


def _reset(labels_dir: Path) -> None:
    for p in list_shards(labels_dir):
        p.unlink()
    shutil.rmtree(labels_dir / REJECTS_DIR, ignore_errors=True)
    for name in (MANIFEST, "rejects.jsonl"):
        (labels_dir / name).unlink(missing_ok=True)
    clear_complete(labels_dir)


def summarize(labels_dir: Path) -> Dict[str, Any]:
    """Rows, label histogram and mean tau per candidate, read without the logits column."""
    shards = list_shards(labels_dir)
    if not shards:
        return {"rows": 0}
    t = pa.concat_tables([pq.read_table(p, columns=SUMMARY_COLUMNS) for p in shards])
    rows = t.num_rows
    if rows == 0:
        return {"rows": 0}
    candidates = t.column("candidates")[0].as_py()
    taus = t.column("tau").to_pylist()
    mean_tau = {int(b): sum(r[i] for r in taus) / rows for i, b in enumerate(candidates)}
    hist = Counter(t.column("label_block_size").to_pylist())
    speed_hist = Counter(t.column("label_speedup_block_size").to_pylist())
    return {
        "rows": rows, "candidates": candidates,
        "label_histogram": {int(b): hist.get(b, 0) for b in candidates},
        "speedup_label_histogram": {int(b): speed_hist.get(b, 0) for b in candidates},
        "mean_tau": {b: round(v, 4) for b, v in mean_tau.items()},
    }


def _write_manifest(labels_dir: Path, fp: Dict[str, Any], workers: List[Dict[str, Any]]) -> Dict[str, Any]:
    files = []
    rejects = []
    for p in list_shards(labels_dir):
        rj = labels_dir / REJECTS_DIR / p.with_suffix(".jsonl").name
        shard_rejects = read_jsonl(rj)
        rejects.extend(shard_rejects)
        files.append({"file": p.name, "rows": pq.read_metadata(p).num_rows, "bytes": p.stat().st_size,
                      "sha256": file_sha256(p), "rejects": len(shard_rejects)})
    write_jsonl_atomic(rejects, labels_dir / "rejects.jsonl")
    # Workers of earlier (interrupted) runs too: each labelled some of the shards.
    if (labels_dir / MANIFEST).exists():
        earlier = json.loads((labels_dir / MANIFEST).read_text()).get("workers", [])
        seen = {(w.get("identity"), w.get("pid")) for w in workers}
        workers = [w for w in earlier if (w.get("identity"), w.get("pid")) not in seen] + workers
    summary = summarize(labels_dir)
    manifest = {
        "schema_version": LABELS_SCHEMA_VERSION, "files": files, "rows": sum(f["rows"] for f in files),
        "rejects": len(rejects), "rejects_by_reason": dict(Counter(r["reason"] for r in rejects)),
        # A worker with many decode errors (a bad GPU, OOM on long prompts) stands out here.
        "rejects_by_worker": dict(Counter(r.get("worker", "?") for r in rejects)),
        "fingerprint": fp, "workers": workers, "summary": summary,
    }
    write_json_atomic(manifest, labels_dir / MANIFEST)
    return manifest


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t_start = time.monotonic()
    out = Path(cfg.output_dir)
    prompts_dir, labels_dir = out / "prompts", out / "labels"
    prompts_sha = _require_prompts(prompts_dir)
    ensure_writable(labels_dir)
    from pipeline.labeling import candidate_block_sizes

    B = trained_block_size(cfg)
    candidates = candidate_block_sizes(B, cfg.label.k)
    mode = resolve_mode(cfg)
    fp = fingerprint(cfg, candidates, prompts_sha)
    if check_fingerprint(labels_dir, fp, cfg.force):
        print(f"[label] force=true: config changed, discarding existing shards in {labels_dir}", flush=True)
        _reset(labels_dir)
    fp_sha = fingerprint_sha256(fp)
    cfg_sha = write_resolved(cfg, labels_dir)
    write_text_atomic(labels_card(), labels_dir / "dataset_card.md")
    (labels_dir / REJECTS_DIR).mkdir(exist_ok=True)

    todo = []
    total_rows = 0
    for p in list_shards(prompts_dir):
        n = pq.read_metadata(p).num_rows
        o, rj = labels_dir / p.name, labels_dir / REJECTS_DIR / p.with_suffix(".jsonl").name
        if not output_shard_valid(o, n, rj, fp_sha):
            todo.append((p, o, rj, n))
            total_rows += n
    if not todo and is_complete(labels_dir):
        print(f"[label] {labels_dir}: complete, nothing to do", flush=True)
        manifest = json.loads((labels_dir / MANIFEST).read_text())
        return {"stage": "label", "skipped": True, "output": str(labels_dir), **manifest["summary"],
                "rejects": manifest["rejects"]}
    clear_complete(labels_dir)
    for stale in labels_dir.glob(".part-*.tmp-*"):  # left by a writer killed mid-write
        stale.unlink(missing_ok=True)
    n_shards = len(list_shards(prompts_dir))
    print(f"[label] B={B} candidates={candidates} mode={mode}: {len(todo)}/{n_shards} shards "
          f"({total_rows} prompts) to label", flush=True)

    meta = {"schema_version": LABELS_SCHEMA_VERSION, "target": cfg.model.target, "draft": cfg.model.draft,
            "target_revision": fp["target_revision"], "draft_revision": fp["draft_revision"],
            "trained_block_size": B, "candidates": candidates, "temperature": cfg.decode.temperature,
            "top_p": cfg.decode.top_p, "top_k": cfg.decode.top_k, "max_new_tokens": cfg.decode.max_new_tokens,
            "seed": cfg.decode.seed, "config_sha256": cfg_sha, "fingerprint_sha256": fp_sha,
            "package_version": __version__}
    failures: List[str] = []
    workers_info: List[Dict[str, Any]] = []
    if todo:
        workers_info, failures = _label_on_ray(cfg, candidates, mode, meta, todo, total_rows)
    manifest = _write_manifest(labels_dir, fp, workers_info)
    summary = {"stage": "label", "output": str(labels_dir), "mode": mode, **manifest["summary"],
               "rejects": manifest["rejects"], "rejects_by_reason": manifest["rejects_by_reason"],
               "rejects_by_worker": manifest["rejects_by_worker"], "workers": workers_info, "wall_seconds": round(time.monotonic() - t_start, 1)}
    if failures:
        summary["failed_shards"] = failures
        print(f"[label] {len(failures)} shard(s) failed: {failures}; rerun `blockpilot label` to retry them",
              flush=True)
        raise RuntimeError(f"label: {len(failures)} shard(s) failed after retries: {', '.join(failures)}")
    if manifest["rows"] == 0 and manifest["rejects"]:
        first = read_jsonl(labels_dir / "rejects.jsonl")[0]["detail"]
        raise RuntimeError(f"label: every prompt failed ({manifest['rejects']} rejects; first: {first})")
    mark_complete(labels_dir)
    _print_summary(summary)
    return summary


def _label_on_ray(cfg, candidates, mode, meta, todo, total_rows):
    tasks = [ShardTask(p.name, (str(p), str(o), str(rj)), n) for p, o, rj, n in todo]
    return run_shard_actors(cfg, LabelWorker, (cfg, candidates, mode, meta), "label_shard", tasks,
                            cfg.label.num_workers, "label")


def _print_summary(s: Dict[str, Any]) -> None:
    print(f"[label] done: {s.get('rows', 0)} rows, {s['rejects']} rejects, {s['wall_seconds']} s -> {s['output']}")
    if s.get("rows"):
        print(f"[label] label histogram {s['label_histogram']}; mean tau {s['mean_tau']}", flush=True)
