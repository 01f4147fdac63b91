"""What label and evaluate share: a shard stage whose workers decode prompt shards with the target + draft pair.

Prompt shard ``part-N`` becomes output shard ``part-N``. Each worker loads the models once (``setup``); one prompt
that fails while decoding becomes a ``decode_error`` (or ``out_of_memory``) reject and the rest of its shard
completes, and a rerun retries it. A failure of the worker's device (a sticky CUDA error, or prompts failing one
after another) is not turned into rejects: the shard goes to another worker (pipeline.executor.failures).
"""

from __future__ import annotations

import time
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Tuple

import pyarrow as pa

from pipeline.executor.stage import Plan, Rejects, Resources, ShardStage, Worker, tasks_from_shards
from pipeline.io.storage import location


class DecodingStage(ShardStage):
    unit = "prompts"

    on_ray = False  # set by pipeline.executor.ray.executor.execute: the actor pool's placement decides where models run

    def __init__(self, cfg, folder: Path, prompts: Path, num_workers, workers_key: str):
        super().__init__(cfg, folder)
        self.prompts = location(prompts)  # the prompt shards (prepare's schema) it decodes
        self.num_workers = num_workers
        self.workers_key = workers_key

    def plan(self) -> Plan:
        return Plan(tasks_from_shards(self.prompts))

    def resources(self) -> Resources:
        w = self.cfg.workers
        return Resources(actors=True, num_workers=self.num_workers, cpus_per_worker=w.cpus_per_worker,
                         max_retries=w.max_retries, workers_key=self.workers_key, device=self.cfg.model.device)

    # -- what was loaded, where: the fingerprint's part that no config value says --
    @cached_property
    def placement(self):
        """The pool's pipeline.executor.ray.placement.Placement when the stage runs on Ray (decided once, when the fingerprint
        first needs it: after the driver's cheap checks, so a bad folder fails before Ray starts); else None."""
        if not self.on_ray:
            return None
        from pipeline.executor.ray.placement import plan_workers
        from pipeline.executor.ray.runtime import init_ray

        return plan_workers(self.resources(), init_ray(self.cfg.ray).cluster_resources())

    @property
    def runs_on(self) -> str:
        """"cuda" or "cpu": where the workers run the models (the pool's placement; in-process, this machine)."""
        if self.placement is not None:
            return self.placement.device
        from pipeline.decoding.models import resolve_device

        return resolve_device(self.cfg.model.device).type

    @cached_property
    def provenance(self) -> Dict[str, Any]:
        """What the models are (pipeline.decoding.provenance: a hub commit, or a hash of a folder's weights), the
        packages that compute with them, and the dtype and device kind they run in: a rerun that differs in any of
        these is refused, so that one folder never mixes fp32-CPU rows with bf16-GPU ones, or two trainings of one
        draft. Read in the driver: a local model folder must be readable there too."""
        from pipeline.decoding.models import resolve_dtype
        from pipeline.decoding.provenance import model_provenance, software_versions

        import torch

        m = self.pinned_model
        dtype = resolve_dtype(m.dtype, torch.device(self.runs_on))
        return {"model.target": model_provenance(m.target, m.target_revision, "model.target"),
                "model.draft": model_provenance(m.draft, m.draft_revision, "model.draft"),
                "dtype": str(dtype).replace("torch.", ""), "device": self.runs_on, "versions": software_versions()}

    REVISIONS = (("model.target", "target", "target_revision"), ("model.draft", "draft", "draft_revision"))

    def recorded_revisions(self) -> Dict[str, str]:
        """The revisions the labels were made with (labels/fingerprint.json: ``target_revision``,
        ``draft_revision``); {} for the label stage itself."""
        return {}

    @cached_property
    def pinned_model(self):
        """cfg.model with the hub commits the labels were made with, where the config leaves a revision null: a
        draft pushed to "main" between label and evaluate is not evaluated by accident (issue #51)."""
        from dataclasses import replace

        m, recorded = self.cfg.model, self.recorded_revisions()
        pins = {field: recorded[field] for _, _, field in self.REVISIONS
                if getattr(m, field) is None and not str(recorded.get(field) or "sha256:").startswith("sha256:")}
        return replace(m, **pins) if pins else m

    def check_revisions(self) -> None:
        """Refuses a model that is not the one the labels were made with (another commit, or a local folder whose
        weights changed), naming both revisions."""
        recorded, p = self.recorded_revisions(), self.provenance
        for key, name, field in self.REVISIONS:
            was, now = recorded.get(field), p[key]["revision"]
            if was and now != was:
                raise ValueError(f"{key}: {getattr(self.cfg.model, name)} is {now} now, but the labels were made with "
                                 f"{was} (labels/fingerprint.json): set {key}_revision to the labels' commit, or label "
                                 "again with this model")

    def worker_model(self):
        """What a worker loads: the pinned model, and for a hub id the commit the driver resolved once for the whole
        job (its provenance, shipped with the stage), so that no worker resolves "main" again on its own."""
        from dataclasses import replace

        m, p = self.pinned_model, self.__dict__.get("provenance")
        if not p:
            return m
        pins = {field: p[key]["revision"] for key, _, field in self.REVISIONS
                if getattr(m, field) is None and p[key]["kind"] == "hub"}
        return replace(m, **pins) if pins else m

    @cached_property
    def longest_prompt(self) -> int:
        """The longest prompt the stage decodes, in tokens (what its memory plan is sized for): what prepare recorded
        in the prompts' manifest (``prompt_tokens.max``), one small read in every worker's timed preflight (reading
        every shard's ``prompt_tokens`` took each worker 15-30 minutes at 15,625 shards on S3); for a folder
        prepared before prepare recorded it, its shards' ``prompt_tokens`` (said once); else
        prepare.max_prompt_tokens (shards not written yet)."""
        import json

        from pipeline.io.layout import MANIFEST
        from pipeline.io.shards import list_shards
        from pipeline.io.storage import read_table
        from pipeline.runtime.log import get as get_log

        manifest = self.prompts / MANIFEST
        recorded = json.loads(manifest.read_text()).get("prompt_tokens") if manifest.exists() else None
        if recorded:
            return int(recorded["max"] or self.cfg.prepare.max_prompt_tokens)
        shards = list_shards(self.prompts) if self.prompts.exists() else []
        if shards:
            get_log(self.name).info(f"{self.prompts / MANIFEST} records no longest prompt (prepared by an older "
                                    f"version): reading the prompt_tokens of its {len(shards)} shard(s)")
        longest = max((max(read_table(p, columns=["prompt_tokens"]).column(0).to_pylist() or [0]) for p in shards),
                      default=0)
        return int(longest or self.cfg.prepare.max_prompt_tokens)

    @property
    def largest_block(self) -> int:
        """The largest block size the stage decodes (its memory plan's verify and draft logits)."""
        return max(self.candidates)

    def memory_check(self, facts: Dict[str, Any], dtype) -> Dict[str, Any]:
        from pipeline.executor.memory_checks import engine_check

        return engine_check(self, facts, dtype)

    def preflight_spec(self, placement, token: str):
        from pipeline.executor.preflight import PreflightSpec

        m, p = self.worker_model(), self.provenance
        return PreflightSpec(self.name, placement.device, m.dtype,
                             models={"model.target": (m.target, m.target_revision),
                                     "model.draft": (m.draft, m.draft_revision)},
                             expect={k: p[k] for k in ("model.target", "model.draft", "versions")},
                             output_dir=str(self.cfg.output_dir), token=token)

    def setup(self, worker: Worker) -> None:
        import torch

        from pipeline.decoding.compiled import apply_compile
        from pipeline.decoding.engine import Engine
        from pipeline.decoding.models import load_models

        if worker.threads:
            torch.set_num_threads(worker.threads)
        self.worker = worker
        self.models = load_models(self.worker_model())
        stops = self.models.stop_token_ids if self.cfg.decode.stop_on_eos else None
        self.compiled = apply_compile(self.models, self.cfg.engine.compile)
        self.engine = Engine(self.models.target, self.models.draft, stops)
        self.device = f"{self.models.device}/{str(self.models.dtype).replace('torch.', '')}"

    @cached_property
    def prompt_failures(self):
        """This worker's prompt failures (pipeline.executor.failures): a sticky device error, or
        FAILURES_IN_A_ROW prompts failing one after another, raise DeviceFailure out of the shard."""
        from pipeline.executor.failures import PromptFailures

        return PromptFailures(getattr(getattr(self, "worker", None), "identity", "driver"))

    def worker_info(self) -> Dict[str, Any]:
        return {"device": self.device, "compiled": self.compiled}

    def decode_kwargs(self) -> Dict[str, Any]:
        d = self.cfg.decode
        return dict(max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
                    seed=d.seed)

    def each_prompt(self, shard: str, table: pa.Table, rejects: Rejects,
                    measure: Callable[[Dict[str, Any]], Any]) -> Iterator[Tuple[Dict[str, Any], Any]]:
        """``(row, measure(row))`` for every prompt row of a shard; a row whose measure raises is rejected."""
        import torch

        from pipeline.executor.failures import PROMPT_BREAKS_DEVICE
        from pipeline.runtime.log import verbosity

        t0 = time.perf_counter()
        verbose = self.cfg.progress and verbosity() >= 1
        failures = self.prompt_failures
        failures.new_shard()
        for i, rec in enumerate(table.to_pylist()):
            reason = None
            broke = rejects.refused.get(rec.get("prompt_id"))
            if broke is not None:  # it broke two workers' devices (the pool's charges): not decoded again
                rejects.add(rec, PROMPT_BREAKS_DEVICE, broke)
                continue
            try:
                result = measure(rec)
            except Exception as err:  # noqa: BLE001 - one prompt's failure must not lose the shard
                # raises DeviceFailure when it is the device's (charged to this prompt if sticky), not the prompt's
                reason = failures.failed(err, rec.get("prompt_id"))
                rejects.add(rec, reason, f"{type(err).__name__}: {err}")
            if reason is not None:
                # out of the except block: the exception and its frames (their tensors) are gone before the
                # allocator's cache is emptied, else it cannot give that memory back
                if reason == "out_of_memory" and torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            failures.succeeded()
            yield rec, result
            if verbose and (i + 1) % 16 == 0:  # inside a shard, with -v only: the driver reports every shard
                print(f"[{self.name} {self.worker.identity}] {location(shard).name}: {i + 1}/{table.num_rows} prompts "
                      f"({(i + 1) / (time.perf_counter() - t0):.2f}/s)", flush=True)

    @staticmethod
    def input_ids(rec: Dict[str, Any]):
        import torch

        return torch.tensor(rec["input_ids"], dtype=torch.long)[None]

