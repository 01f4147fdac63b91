"""label: Ray actors measure tau at every candidate block size for every prompt and write label shards (schema v1).

Shards, not Ray Data: each prompt shard ``prompts/part-NNNNN.parquet`` becomes exactly one label shard
``labels/part-NNNNN.parquet`` written atomically by the actor that labelled it. A shard is the unit of work, of
retry and of resume (datatrove style, through :mod:`pipeline.executor.driver`): a rerun re-labels only shards whose output
is missing or invalid, so a kill at any point loses at most the shards in flight and never duplicates a row. Ray
Data's writer names files itself and its checkpointing is row-based, which gives neither guarantee for
shard-aligned outputs.

Placement: one actor per GPU (``num_gpus=1``, each loads target and draft once), or ``label.num_workers`` CPU
actors when the cluster has no GPU.
"""

from __future__ import annotations

import json
from collections import Counter
from functools import cached_property
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa

from pipeline.runtime.config import ConfigError, PipelineConfig
from pipeline.data.schemas import LABELS_SCHEMA_VERSION, labels_card, labels_schema
from pipeline.io.shards import encode_metadata
from pipeline.executor.driver import Rejects, Worker
from pipeline.runtime.log import get as log
from pipeline.io.shards import MANIFEST, file_sha256
from pipeline.io.storage import location, parquet_file, read_table

from .ray_executor import execute
from .decoding import DecodingStage

SUMMARY_COLUMNS = ["candidates", "tau", "label_block_size", "label_speedup_block_size"]


# ---- settings every worker and the driver agree on ---------------------------------------------------------------

def trained_block_size(cfg: PipelineConfig) -> int:
    """B: label.block_size, else the draft's config (read without loading weights)."""
    if cfg.label.block_size:
        return int(cfg.label.block_size)
    from dflash.model import _draft_value

    from pipeline.decoding.models import draft_config

    return int(_draft_value(draft_config(cfg.model), "block_size", 16))


def resolve_mode(cfg: PipelineConfig) -> str:
    """auto = replay at T = 0 when replay is proven exact for the draft (and much cheaper), exhaustive otherwise.
    Decided from the draft's config, before any model is loaded; label.mode=replay with a draft replay does not
    model fails here."""
    if cfg.label.mode == "exhaustive" or (cfg.label.mode == "auto" and cfg.decode.temperature > 0):
        return "exhaustive"
    from pipeline.decoding.models import draft_config
    from pipeline.labelling.replay import replay_unsupported_config

    try:
        why = replay_unsupported_config(draft_config(cfg.model))
    except Exception as e:  # noqa: BLE001 - a config that cannot be read cannot be proven exact either
        why = f"an unreadable draft config ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    if why is None:
        return "replay"
    if cfg.label.mode == "replay":
        raise ConfigError(f"config key 'label.mode': replay does not model {why} (draft {cfg.model.draft!r}); "
                          "use label.mode=exhaustive or auto")
    log("label").info(f"mode auto: exhaustive, because replay does not model {why}")
    return "exhaustive"


class LabelStage(DecodingStage):
    """prompts/part-N -> labels/part-N: tau at every candidate b, the labels, and the raw prefill logits."""

    name = "label"
    schema_version = LABELS_SCHEMA_VERSION
    extra_outputs = ("cost_profile.json",)

    def __init__(self, cfg: PipelineConfig):
        out = location(cfg.output_dir)
        super().__init__(cfg, out / "labels", out / "prompts", cfg.label.num_workers)
        self.mode = resolve_mode(cfg)

    def requires(self):
        return [(self.prompts, "blockpilot prepare")]

    @cached_property
    def block_size(self) -> int:
        return trained_block_size(self.cfg)

    @cached_property
    def candidates(self) -> List[int]:
        from pipeline.labelling.labels import candidate_block_sizes

        return candidate_block_sizes(self.block_size, self.cfg.label.k)

    @cached_property
    def revisions(self) -> Dict[str, str]:
        from pipeline.decoding.models import model_revision

        m = self.cfg.model
        return {"target_revision": model_revision(m.target, m.target_revision),
                "draft_revision": model_revision(m.draft, m.draft_revision)}

    def fingerprint(self) -> Dict[str, Any]:
        """The config values that change the label rows: mixing shards made with different ones is refused."""
        m, d = self.cfg.model, self.cfg.decode
        return {
            "target": m.target, "draft": m.draft, **self.revisions,
            "dtype": m.dtype, "candidates": self.candidates, "temperature": d.temperature, "top_p": d.top_p,
            "top_k": d.top_k, "max_new_tokens": d.max_new_tokens, "seed": d.seed, "stop_on_eos": d.stop_on_eos,
            "enable_thinking": m.enable_thinking, "prompts_manifest_sha256": file_sha256(self.prompts / MANIFEST),
            "schema_version": LABELS_SCHEMA_VERSION,
        }

    @property
    def label_batch_size(self) -> int:
        """Prompts per forward: label.batch_size in replay mode; exhaustive mode is batch-1 (the reference)."""
        return int(self.cfg.label.batch_size) if self.mode == "replay" else 1

    def describe(self) -> str:
        return f"B={self.block_size} candidates={self.candidates} mode={self.mode} batch_size={self.label_batch_size}"

    # -- every actor --
    def setup(self, worker: Worker) -> None:
        from pipeline.policy.cost import profile_for

        super().setup(worker)
        # The cost model, once per worker on its own device and dtype (pipeline/policy/cost.py): b in 1..2B, draft and
        # verify timed apart; it goes into every shard's metadata and, at the end, into cost_profile.json.
        self.cost_profile = profile_for(self.engine, self.cfg, self.block_size, self.candidates,
                                        {**self.revisions, "worker": worker.identity})
        self.step_cost = self.cost_profile.costs(self.candidates)

    def worker_info(self) -> Dict[str, Any]:
        p = self.cost_profile
        return {**super().worker_info(), "step_cost_seconds": {b: round(c, 6) for b, c in self.step_cost.items()},
                "cost_profile": {"rounds": p.meta["rounds"], "stable": p.meta["stable"],
                                 "seconds": p.meta["wall_seconds"], "fit": p.fit}}

    def shard_metadata(self) -> Dict[str, Any]:
        d = self.cfg.decode
        return {"schema_version": LABELS_SCHEMA_VERSION, "target": self.cfg.model.target,
                "draft": self.cfg.model.draft, **self.revisions, "trained_block_size": self.block_size,
                "candidates": self.candidates, "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k,
                "max_new_tokens": d.max_new_tokens, "seed": d.seed, "step_cost_seconds": self.step_cost,
                "cost_profile": self.cost_profile.to_dict(),
                "label_mode": self.mode, "label_batch_size": self.label_batch_size, "device": self.device,
                "vocab_size": self.models.vocab_size,
                "worker": self.worker.identity}

    def process_shard(self, input: str, rejects: Rejects) -> pa.Table:
        from pipeline.labelling import labels as labeling

        label_fn = labeling.replay_label_prompt if self.mode == "replay" else labeling.label_prompt
        kw = self.decode_kwargs()

        batches = None  # replay mode at label.batch_size > 1: the shard's prompts labelled in batches (below)

        def measure(rec):
            if batches is not None:
                out = batches(rec)  # raises this prompt's own error, so each_prompt rejects it alone
            else:
                out = label_fn(self.engine, self.input_ids(rec), self.candidates, step_cost=self.step_cost, **kw)
            logits = labeling.logits_to_numpy(out.logits)
            if not np.isfinite(logits).all():
                raise FloatingPointError("non-finite prefill logits (float16 overflow or NaN)")
            return out, logits

        table = read_table(input, columns=["prompt_id", "source", "input_ids", "prompt_tokens"])
        if self.label_batch_size > 1:
            from pipeline.labelling.batched import ShardBatches, batched_replay_label_prompts

            batches = ShardBatches(
                table.column("prompt_id").to_pylist(), table.column("input_ids").to_pylist(), self.label_batch_size,
                lambda ids: batched_replay_label_prompts(self.engine, ids, self.candidates, step_cost=self.step_cost,
                                                         **kw))
        vocab = self.models.vocab_size
        schema = labels_schema(vocab)
        rows: Dict[str, list] = {name: [] for name in schema.names}
        for rec, (out, logits) in self.each_prompt(input, table, rejects, measure):
            values = {"prompt_id": rec["prompt_id"], "source": rec["source"], "prompt_tokens": rec["prompt_tokens"],
                      "logits": logits, "candidates": out.candidates, "tau": out.tau, "steps": out.steps,
                      "new_tokens": out.new_tokens, "decode_seconds": out.decode_seconds,
                      "label_block_size": out.label_block_size, "label_index": out.label_index,
                      "label_speedup_block_size": out.candidates[out.label_speedup_index],
                      "prefill_seconds": out.prefill_seconds, "worker": self.worker.identity}
            for name in schema.names:
                rows[name].append(values[name])
        arrays = []
        for f in schema:
            if f.name == "logits":
                # float16-rounded values (the precision of v1) stored as float32: every reader reads float32 with
                # byte-stream-split, and the low mantissa bytes, all zero, cost almost nothing once split.
                flat = np.concatenate(rows["logits"]).astype(np.float32) if rows["logits"] else \
                    np.zeros(0, dtype=np.float32)
                arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), vocab))
            else:
                arrays.append(pa.array(rows[f.name], type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema.with_metadata(encode_metadata(self.shard_metadata())))

    def parquet_options(self, table: pa.Table) -> Dict[str, Any]:
        vocab = table.schema.field("logits").type.list_size
        return dict(compression="zstd", use_byte_stream_split=["logits.list.element"],
                    use_dictionary=["source", "worker"],
                    # ~128 MB of logits per row group keeps readers' memory bounded at full vocabulary.
                    row_group_size=max(1, min(max(1, table.num_rows), (128 << 20) // (4 * vocab))))

    # -- the driver, at the end --
    def summarize(self, shards: List[Path]) -> Dict[str, Any]:
        """Label histograms and mean tau per candidate, read without the logits column."""
        if not shards:
            return {}
        t = pa.concat_tables([read_table(p, columns=SUMMARY_COLUMNS) for p in shards])
        if t.num_rows == 0:
            return {}
        candidates = t.column("candidates")[0].as_py()
        taus = np.array(t.column("tau").to_pylist(), dtype=np.float64)
        hist = Counter(t.column("label_block_size").to_pylist())
        speed_hist = Counter(t.column("label_speedup_block_size").to_pylist())
        return {
            "mode": self.mode, "candidates": candidates,
            "label_histogram": {int(b): hist.get(b, 0) for b in candidates},
            "speedup_label_histogram": {int(b): speed_hist.get(b, 0) for b in candidates},
            "mean_tau": {int(b): round(float(taus[:, i].mean()), 4) for i, b in enumerate(candidates)},
        }

    def manifest_extras(self) -> Dict[str, Any]:
        return {"cost_profile": "cost_profile.json"}

    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        """cost_profile.json beside the shards: the profile of the worker that labelled the most rows (every
        shard's own worker profile stays in its metadata, `blockpilot.cost_profile`)."""
        from pipeline.policy.cost import FILENAME, CostProfile
        from pipeline.io.shards import decode_metadata

        rows: Dict[str, int] = Counter()
        profiles: Dict[str, Dict[str, Any]] = {}
        for f in manifest["files"]:
            meta = decode_metadata(parquet_file(self.folder / f["file"]).schema_arrow.metadata)
            if "cost_profile" in meta:
                key = json.dumps(meta["cost_profile"].get("seconds"), sort_keys=True)
                profiles[key] = meta["cost_profile"]
                rows[key] += f["rows"]
        if not profiles:
            return {}
        chosen = CostProfile.from_dict(profiles[max(rows, key=rows.get)])
        chosen.save(self.folder / FILENAME)
        cands = self.candidates
        return {"cost_profile": str(self.folder / FILENAME), "cost_profiles_seen": len(profiles),
                "step_cost_ms": {b: round(chosen.cost(b) * 1e3, 3) for b in cands}}

    def card(self, manifest: Dict[str, Any]) -> str:
        from pipeline.policy.cost import FORMAT_DOC

        return labels_card("\n" + FORMAT_DOC)

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        if not summary.get("rows"):
            return []
        return [f"label histogram {summary['label_histogram']}; mean tau {summary['mean_tau']}"]


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    return execute(LabelStage(cfg))
