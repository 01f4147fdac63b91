"""prepare: prompt sources -> clean, deduplicated, chat-formatted prompt shards with stable ids.

Output folder ``<output_dir>/prompts/`` (the layout every stage shares is in :mod:`pipeline.executor.driver`):

* ``part-00000.parquet`` ... : ``prepare.shard_size`` rows each, schema exactly ``pipeline.data.schemas.PROMPTS_SCHEMA``,
  deterministic order (sources in config order, rows in source order);
* ``rejects.jsonl``: one object per rejected row (``source``, ``source_row``, ``prompt_id`` where known, ``reason``,
  ``detail``, ``file``), see :mod:`pipeline.data.sources` for the reasons;
* ``manifest.json``: the driver's manifest plus duplicates, per-source counts, notes, tokenizer / target, and
  ``prompt_tokens`` ``{"max", "prompts"}``: the longest prompt's tokens over how many prompts, which every decoding
  worker sizes its memory plan for (``stages.decoding.DecodingStage.longest_prompt``: one read of this file, not
  one of every shard). It holds no timings, so an identical rerun writes an identical manifest (the label stage
  fingerprints it).

The same stage builds evaluate's prompt sets (``stages.evaluate.prompt_sets``). Runs in the driver process, with
bounded memory at a million prompts: the sources are read one row at a time
(:func:`pipeline.data.sources.stream_prompts`), each planned shard's rows go to a spool file on the head's local
disk as soon as its boundaries are known (:func:`pipeline.executor.sharding.cut`), and a task's input is that
file's path. The spool (zstd Arrow IPC, about the size of the shards) is a temporary folder (``TMPDIR``: not a
tmpfs, or it is memory again), removed when the stage completes or its object goes.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import pyarrow as pa

from pipeline.runtime.config import PipelineConfig, SourceConfig
from pipeline.data.schemas import PROMPTS_SCHEMA, PROMPTS_SCHEMA_VERSION, prompts_card
from pipeline.io.shards import shard_name
from pipeline.io.storage import location
from pipeline.executor.sharding import cut
from pipeline.executor.stage import Plan, Rejects, ShardStage, ShardTask
from pipeline.runtime.log import get as get_log
from pipeline.data.sources import stream_prompts, validate_sources

from pipeline.executor.ray.executor import execute

STAGE_DIR = "prompts"
SPOOL = pa.ipc.IpcWriteOptions(compression="zstd")


def write_spool(rows: List[Dict[str, Any]], path: Path) -> None:
    """One planned shard's rows, as the table its shard will hold, in an Arrow IPC file: the plan holds them only
    until they are here."""
    table = pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=SPOOL) as writer:
        writer.write_table(table)


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
        self.io_threads = cfg.prepare.write_threads  # a shard is a spool read and a write: the store's latency
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
        rows, rejects, self.stats = stream_prompts(
            self.sources, load_tokenizer(self.cfg.model), p.max_prompt_tokens,
            apply_chat_template=p.apply_chat_template, enable_thinking=self.cfg.model.enable_thinking,
            limit=self.limit, section=self.section, log=say.info if self.cfg.progress else None, debug=say.debug)
        size_for, workers = (lambda n: self.shard_size), None
        if self.section == "prepare" and p.shards_per_worker:  # the label prompts: every label worker busy
            from pipeline.executor.sharding import shard_size_for

            from pipeline.executor.ray.placement import expected_label_workers

            workers = expected_label_workers(self.cfg)
            size_for = lambda n: shard_size_for(n, workers, self.shard_size, p.shards_per_worker)  # noqa: E731
        spool = self._spool()
        tasks = []
        for i, shard in enumerate(cut(rows, size_for)):
            path = spool / f"{i:05d}.arrow"
            write_spool(shard, path)
            tasks.append(ShardTask(shard_name(i), str(path), len(shard)))
        if workers is not None:
            self.stats["sharding"] = {"shard_size": size_for(self.stats["prompts"]), "label_workers": workers,
                                      "shards_per_worker": p.shards_per_worker}
        return Plan(tasks, rejects)

    def _spool(self) -> Path:
        """A fresh spool folder for this plan's shards, removed with the stage object (or at exit) if
        :meth:`finalize` does not remove it first."""
        folder = Path(tempfile.mkdtemp(prefix=f"blockpilot-{self.section}-spool-"))
        weakref.finalize(self, shutil.rmtree, folder, True)
        self.spool = folder
        return folder

    def process_shard(self, path: str, rejects: Rejects) -> pa.Table:
        with pa.OSFile(path) as source:
            return pa.ipc.open_file(source).read_all()

    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        shutil.rmtree(self.spool, ignore_errors=True)  # every shard is written: its rows are not needed again
        return {}

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
                "target_revision": m.target_revision,
                "prompt_tokens": {"max": self.stats["longest_prompt"], "prompts": self.stats["prompts"]}}

    def card(self, manifest: Dict[str, Any]) -> str:
        p = self.cfg.prepare
        lines = [prompts_card(), "## This dataset", "",
                 f"Tokenizer: `{manifest['tokenizer']}` (target `{manifest['target']}`); chat template "
                 f"{'applied' if p.apply_chat_template else 'not applied'} (thinking "
                 f"{'on' if self.cfg.model.enable_thinking else 'off'}); max_prompt_tokens {p.max_prompt_tokens}.",
                 f"{manifest['rows']} prompts in {manifest['shards']} shard(s), the longest "
                 f"{manifest['prompt_tokens']['max']} tokens; "
                 f"{manifest['rejects']} rejects ({manifest['duplicates']} duplicates).", "",
                 "| source | kind | path | accepted | rejected |", "| --- | --- | --- | --- | --- |"]
        for name, s in manifest["sources"].items():
            lines.append(f"| `{name}` | {s['kind']} | `{s['path']}` | {s['accepted']} | {s['rejected']} |")
        return "\n".join(lines) + "\n"


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    return execute(PrepareStage(cfg))
