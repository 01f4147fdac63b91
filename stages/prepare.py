"""prepare: prompt sources -> clean, deduplicated, chat-formatted prompt shards with stable ids.

Output folder ``<output_dir>/prompts/`` (the layout every stage shares is in :mod:`pipeline.executor.driver`):

* ``part-00000.parquet`` ... : ``prepare.shard_size`` rows each, schema exactly ``pipeline.data.schemas.PROMPTS_SCHEMA``,
  deterministic order (sources in config order, rows in source order);
* ``rejects.jsonl``: one object per rejected row (``source``, ``source_row``, ``prompt_id`` where known, ``reason``,
  ``detail``, ``file``), see :mod:`pipeline.data.sources` for the reasons;
* ``manifest.json``: the driver's manifest plus duplicates, per-source counts, notes, tokenizer / target. It holds
  no timings, so an identical rerun writes an identical manifest (the label stage fingerprints it).

The same stage builds evaluate's prompt sets (``stages.evaluate.prompt_sets``). Runs in the driver process.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pyarrow as pa

from pipeline.runtime.config import PipelineConfig, SourceConfig
from pipeline.data.schemas import PROMPTS_SCHEMA, PROMPTS_SCHEMA_VERSION, prompts_card
from pipeline.io.storage import location
from pipeline.executor.stage import Plan, Rejects, ShardStage, numbered_tasks
from pipeline.runtime.log import get as get_log
from pipeline.data.sources import build_prompts, validate_sources

from pipeline.executor.ray.executor import execute

STAGE_DIR = "prompts"


class PrepareStage(ShardStage):
    name = "prepare"
    unit = "prompts"
    schema_version = PROMPTS_SCHEMA_VERSION

    def __init__(self, cfg: PipelineConfig, folder: Optional[Path] = None,
                 sources: Optional[Sequence[SourceConfig]] = None, limit: Optional[int] = None,
                 section: str = "prepare", shard_size: Optional[int] = None):
        super().__init__(cfg, folder or location(cfg.output_dir) / STAGE_DIR)
        self.sources = list(cfg.prepare.sources if sources is None else sources)
        self.limit = cfg.prepare.limit if sources is None else limit
        self.section = section  # the config key named in errors
        self.shard_size = int(shard_size or cfg.prepare.shard_size)
        self.stats: Dict[str, Any] = {}

    def fingerprint(self) -> Dict[str, Any]:
        p, m = self.cfg.prepare, self.cfg.model
        return {
            "schema_version": PROMPTS_SCHEMA_VERSION, "sources": [asdict(s) for s in self.sources],
            "max_prompt_tokens": p.max_prompt_tokens, "shard_size": self.shard_size, "limit": self.limit,
            "apply_chat_template": p.apply_chat_template, "enable_thinking": m.enable_thinking,
            "target": m.target, "target_revision": m.target_revision, "tokenizer": m.tokenizer or m.target,
        }

    def check(self) -> None:
        validate_sources(self.sources, self.section)  # missing paths, bad templates: before anything is written

    def plan(self) -> Plan:
        from pipeline.decoding.models import load_tokenizer

        p = self.cfg.prepare
        say = get_log(self.section)
        rows, rejects, self.stats = build_prompts(
            self.sources, load_tokenizer(self.cfg.model), p.max_prompt_tokens,
            apply_chat_template=p.apply_chat_template, enable_thinking=self.cfg.model.enable_thinking,
            limit=self.limit, section=self.section, log=say.info if self.cfg.progress else None, debug=say.debug)
        size = self.shard_size
        if self.section == "prepare" and p.shards_per_worker:  # the label prompts: every label worker busy
            from pipeline.executor.sharding import shard_size_for

            from pipeline.executor.ray.placement import expected_label_workers

            workers = expected_label_workers(self.cfg)
            size = shard_size_for(len(rows), workers, self.shard_size, p.shards_per_worker)
            self.stats["sharding"] = {"shard_size": size, "label_workers": workers,
                                      "shards_per_worker": p.shards_per_worker}
        return Plan(numbered_tasks([rows[i:i + size] for i in range(0, len(rows), size)]), rejects)

    def process_shard(self, rows: List[Dict[str, Any]], rejects: Rejects) -> pa.Table:
        return pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA)

    def summarize(self, shards: List[Path]) -> Dict[str, Any]:
        return {"duplicates": self.stats["duplicates"], "notes": self.stats["notes"],
                "sources": {name: s["accepted"] for name, s in self.stats["sources"].items()},
                **({"sharding": self.stats["sharding"]} if "sharding" in self.stats else {})}

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        per_source = " ".join(f"{name}:{n}" for name, n in summary.get("sources", {}).items())
        sharding = summary.get("sharding")
        cut = (f"; shards of {sharding['shard_size']} for {sharding['label_workers']} label worker(s) "
               f"(prepare.shards_per_worker={sharding['shards_per_worker']})") if sharding else ""
        return [f"prompts per source {per_source or 'none'}; {summary.get('duplicates', 0)} duplicates dropped{cut}",
                *summary.get("notes", [])]

    def manifest_extras(self) -> Dict[str, Any]:
        m = self.cfg.model
        return {"duplicates": self.stats["duplicates"], "sources": self.stats["sources"],
                "notes": self.stats["notes"], "tokenizer": m.tokenizer or m.target, "target": m.target,
                "target_revision": m.target_revision}

    def card(self, manifest: Dict[str, Any]) -> str:
        p = self.cfg.prepare
        lines = [prompts_card(), "## This dataset", "",
                 f"Tokenizer: `{manifest['tokenizer']}` (target `{manifest['target']}`); chat template "
                 f"{'applied' if p.apply_chat_template else 'not applied'} (thinking "
                 f"{'on' if self.cfg.model.enable_thinking else 'off'}); max_prompt_tokens {p.max_prompt_tokens}.",
                 f"{manifest['rows']} prompts in {manifest['shards']} shard(s); "
                 f"{manifest['rejects']} rejects ({manifest['duplicates']} duplicates).", "",
                 "| source | kind | path | accepted | rejected |", "| --- | --- | --- | --- | --- |"]
        for name, s in manifest["sources"].items():
            lines.append(f"| `{name}` | {s['kind']} | `{s['path']}` | {s['accepted']} | {s['rejected']} |")
        return "\n".join(lines) + "\n"


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    return execute(PrepareStage(cfg))
