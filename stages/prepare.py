"""prepare: prompt sources -> clean, deduplicated, chat-formatted prompt shards with stable ids.

Output folder ``<output_dir>/prompts/``:

* ``part-00000.parquet`` ... : ``prepare.shard_size`` rows each, schema exactly ``pipeline.dataset.PROMPTS_SCHEMA``,
  deterministic order (sources in config order, rows in source order);
* ``rejects.jsonl``: one object per rejected row (``source``, ``source_row``, ``prompt_id`` where known, ``reason``,
  ``detail``, ``file``), see :mod:`pipeline.sources` for the reasons;
* ``manifest.json``: files with rows and sha256, totals, rejects by reason and by source, duplicates, per-source
  counts, schema version, tokenizer / target, the fingerprint. It holds no timings, so an identical rerun writes an
  identical manifest (the label stage fingerprints it);
* ``dataset_card.md``, ``config.yaml`` / ``config.sha256`` (the resolved config), ``fingerprint.json``;
* ``_SUCCESS``, written last.

Rerun: a complete folder made with the same output-affecting settings is skipped ("skipped: complete"); one made with
different settings is refused unless ``force=true`` (then rewritten, stale shards beyond the new count deleted).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import pyarrow as pa

from pipeline.config import PipelineConfig, write_resolved
from pipeline.dataset import PROMPTS_SCHEMA, PROMPTS_SCHEMA_VERSION, prompts_card
from pipeline.shards import (
    FINGERPRINT,
    MANIFEST,
    check_fingerprint,
    clear_complete,
    ensure_writable,
    file_sha256,
    is_complete,
    list_shards,
    mark_complete,
    shard_index,
    shard_name,
    write_json_atomic,
    write_jsonl_atomic,
    write_parquet_atomic,
    write_text_atomic,
)
from pipeline.sources import build_prompts, validate_sources

STAGE_DIR = "prompts"
REJECTS = "rejects.jsonl"
CARD = "dataset_card.md"


def prompts_dir(cfg: PipelineConfig) -> Path:
    return Path(cfg.output_dir) / STAGE_DIR


def fingerprint(cfg: PipelineConfig) -> Dict[str, Any]:
    """The config values that change prepare's output."""
    p, m = cfg.prepare, cfg.model
    return {
        "schema_version": PROMPTS_SCHEMA_VERSION,
        "sources": [asdict(s) for s in p.sources],
        "max_prompt_tokens": p.max_prompt_tokens,
        "shard_size": p.shard_size,
        "limit": p.limit,
        "apply_chat_template": p.apply_chat_template,
        "enable_thinking": m.enable_thinking,
        "target": m.target,
        "target_revision": m.target_revision,
        "tokenizer": m.tokenizer or m.target,
    }


def _normalised(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def _previous_summary(folder: Path, fp: Dict[str, Any]):
    """The summary of a complete run with the same fingerprint, else None."""
    if not is_complete(folder):
        return None
    try:
        previous = json.loads((folder / FINGERPRINT).read_text())
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if previous != _normalised(fp):
        return None
    return manifest.get("summary")


def _card(cfg: PipelineConfig, manifest: Dict[str, Any]) -> str:
    lines = [prompts_card(), "## This dataset", "",
             f"Tokenizer: `{manifest['tokenizer']}` (target `{manifest['target']}`); chat template "
             f"{'applied' if cfg.prepare.apply_chat_template else 'not applied'} (thinking "
             f"{'on' if cfg.model.enable_thinking else 'off'}); max_prompt_tokens {cfg.prepare.max_prompt_tokens}.",
             f"{manifest['total_rows']} prompts in {len(manifest['files'])} shard(s); "
             f"{manifest['rejects']['total']} rejects ({manifest['duplicates']} duplicates).", "",
             "| source | kind | path | accepted | rejected |", "| --- | --- | --- | --- | --- |"]
    for name, s in manifest["sources"].items():
        lines.append(f"| `{name}` | {s['kind']} | `{s['path']}` | {s['accepted']} | {s['rejected']} |")
    return "\n".join(lines) + "\n"


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    t0 = time.monotonic()
    log = (lambda msg: print(msg, flush=True)) if cfg.progress else (lambda msg: None)
    out = prompts_dir(cfg)
    ensure_writable(out)
    fp = fingerprint(cfg)

    previous = _previous_summary(out, fp)
    if previous is not None:
        summary = {**previous, "status": "skipped: complete", "wall_seconds": round(time.monotonic() - t0, 2)}
        print(f"[prepare] {out}: skipped: complete ({summary.get('rows')} prompts)", flush=True)
        return summary

    # Cheap checks first (missing paths, bad templates, unknown bundled sets), then the tokenizer, then drift.
    validate_sources(cfg.prepare.sources, "prepare")
    from pipeline.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    check_fingerprint(out, fp, cfg.force)
    clear_complete(out)

    rows, rejects, stats = build_prompts(
        cfg.prepare.sources, tokenizer, cfg.prepare.max_prompt_tokens,
        apply_chat_template=cfg.prepare.apply_chat_template, enable_thinking=cfg.model.enable_thinking,
        limit=cfg.prepare.limit, section="prepare", log=log)

    size = cfg.prepare.shard_size
    files: List[Dict[str, Any]] = []
    for index, start in enumerate(range(0, len(rows), size)):
        path = out / shard_name(index)
        table = pa.Table.from_pylist(rows[start:start + size], schema=PROMPTS_SCHEMA)
        write_parquet_atomic(table, path, compression="zstd")
        files.append({"name": path.name, "rows": table.num_rows, "sha256": file_sha256(path)})
    for stale in list_shards(out):
        if shard_index(stale) >= len(files):
            stale.unlink()
    write_jsonl_atomic(rejects, out / REJECTS)

    n_rejects = len(rejects)
    summary = {
        "stage": "prepare", "status": "done", "output": str(out), "rows": len(rows), "shards": len(files),
        "rejects": stats["rejects_by_reason"], "rejects_total": n_rejects, "duplicates": stats["duplicates"],
        "sources": {name: s["accepted"] for name, s in stats["sources"].items()}, "notes": stats["notes"],
    }
    manifest = {
        "stage": "prepare", "schema_version": PROMPTS_SCHEMA_VERSION,
        "files": files, "total_rows": len(rows),
        "rejects": {"file": REJECTS, "total": n_rejects, "by_reason": stats["rejects_by_reason"],
                    "by_source": stats["rejects_by_source"]},
        "duplicates": stats["duplicates"], "sources": stats["sources"], "notes": stats["notes"],
        "tokenizer": cfg.model.tokenizer or cfg.model.target, "target": cfg.model.target,
        "target_revision": cfg.model.target_revision, "fingerprint": _normalised(fp),
        "summary": summary,
    }
    write_json_atomic(manifest, out / MANIFEST)
    write_text_atomic(_card(cfg, manifest), out / CARD)
    write_resolved(cfg, out)
    mark_complete(out)

    summary = {**summary, "wall_seconds": round(time.monotonic() - t0, 2)}
    reasons = ", ".join(f"{k} {v}" for k, v in summary["rejects"].items()) or "none"
    print(f"[prepare] {out}: {len(rows)} prompts in {len(files)} shard(s); rejects: {reasons}; "
          f"duplicates {stats['duplicates']}; {summary['wall_seconds']}s", flush=True)
    return summary
